"""The staleness study: synchronous on-policy training against asynchronous training at staleness 1, 2, 4 and 8,
each with AIPO's importance weights and without them (the behaviour policy ignored).

    python benchmarks/staleness.py                          # the default task (tiny model), 400 RL steps each
    python benchmarks/staleness.py --settings sync,async1,async4-uncorrected run.steps=200
    python benchmarks/staleness.py -c configs/smollm2-arithmetic.yaml   # the real-model recipe (30+ min a run)

Each setting is one `megatron-rl train` from scratch (same seed, same data; only the schedule and the correction
differ) into checkpoints/staleness-<time>/<setting>/. Held-out reward is plotted against RL step and against wall
time (one PNG, staleness.png in that directory); the table gives the held-out reward at the start, its best and
its last value, the mean of the last quarter of evaluations, the mean step time and the mean |logp_pi - logp_mu|.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

SETTINGS = {
    "sync": ["rollout.mode=sync"],
    **{f"async{s}": ["rollout.mode=async", f"rollout.staleness={s}"] for s in (1, 2, 4, 8)},
    **{f"async{s}-uncorrected": ["rollout.mode=async", f"rollout.staleness={s}", "algorithm.importance_weights=false"]
       for s in (1, 2, 4, 8)},
}


def run_setting(name: str, config: str | None, overrides: list[str], root: Path) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *(["-c", config] if config else []),
           f"checkpoint.dir={root}", f"run.name={name}", *SETTINGS[name], *overrides]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/reward" in r]
    t_rl = 0.0
    curve = []
    for r in rows:  # wall time of the RL phase (the warm start is the same for every setting)
        t_rl += r["time/total_s"]
        if "eval/reward" in r:
            curve.append((r["step"], round(t_rl, 2), r["eval/reward"]))
    tail = evals[-max(len(evals) // 4, 1):]
    return {"setting": name, "wall_s": round(wall, 1), "start": evals[0]["eval/reward"],
            "best": max(e["eval/reward"] for e in evals), "last": evals[-1]["eval/reward"],
            "last_quarter_mean": round(sum(e["eval/reward"] for e in tail) / len(tail), 4),
            "mean_step_s": round(sum(r["time/total_s"] for r in rows) / len(rows), 4),
            "logp_diff_mean": round(sum(r.get("logp_diff_mean") or 0 for r in rows) / len(rows), 5),
            "curve": curve}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        style = "--" if r["setting"].endswith("uncorrected") else "-"
        steps, secs, reward = zip(*r["curve"])
        axes[0].plot(steps, reward, style, label=r["setting"])
        axes[1].plot(secs, reward, style, label=r["setting"])
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("staleness study: AIPO (solid) and uncorrected (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default=None, help="job config (default: the built-in default job)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    p.add_argument("overrides", nargs="*", default=[], help="overrides for every run (default: run.steps=400)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    overrides = args.overrides or (["run.steps=400"] if args.config is None else [])
    root = ROOT / "checkpoints" / f"staleness-{time.strftime('%Y%m%d-%H%M%S')}"
    results = [run_setting(n, args.config, overrides, root) for n in names]
    plot(results, root / "staleness.png")
    print(f"{'setting':<22} {'start':>6} {'best':>6} {'last':>6} {'last 1/4':>8} {'step s':>7} {'|dlogp|':>8}")
    for r in results:
        print(f"{r['setting']:<22} {r['start']:6.3f} {r['best']:6.3f} {r['last']:6.3f} {r['last_quarter_mean']:8.3f} "
              f"{r['mean_step_s']:7.3f} {r['logp_diff_mean']:8.4f}")
    emit({"benchmark": "staleness", "config": args.config or "default", "overrides": overrides,
          "plot": str(root / "staleness.png"), "results": [{k: v for k, v in r.items() if k != "curve"}
                                                            for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
