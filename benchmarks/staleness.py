"""The staleness study: synchronous on-policy training against asynchronous training at staleness 1, 2, 4 and 8,
each with AIPO's importance weights and without them (the behaviour policy ignored).

    python benchmarks/staleness.py                          # the default task (tiny model), 400 RL steps each
    python benchmarks/staleness.py --settings sync,async1,async4-uncorrected run.steps=200
    python benchmarks/staleness.py -c configs/smollm2-arithmetic.yaml   # the real-model recipe (30+ min a run)
    python benchmarks/staleness.py --from checkpoints/staleness-A checkpoints/staleness-B   # a study run in parts

Each setting is one `megatron-rl train` from scratch (same seed, same data; only the schedule and the correction
differ) into checkpoints/staleness-<time>/<setting>/. Held-out reward is plotted against RL step and against wall
time (one PNG, staleness.png in that directory, one colour per staleness); the results, curves included, are
rewritten to study.json there after each run, so a study run in parts (or cut short) can be drawn whole with
`--from`. The table gives the held-out reward at the start, its best and
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


COLORS = {"sync": "black", "async1": "tab:blue", "async2": "tab:orange", "async4": "tab:green", "async8": "tab:red"}


def run_setting(name: str, config: str | None, overrides: list[str], root: Path) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *(["-c", config] if config else []),
           f"checkpoint.dir={root}", f"run.name={name}", *SETTINGS[name], *overrides]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                   stdout=subprocess.DEVNULL)
    return {**summarize(name, root / name), "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(name: str, run_dir: Path) -> dict:
    """One setting's row and curve, from the metrics.jsonl of its run directory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/reward" in r]
    t_rl = 0.0
    curve = []
    for r in rows:  # wall time of the RL phase (the warm start is the same for every setting)
        t_rl += r["time/total_s"]
        if "eval/reward" in r:
            curve.append((r["step"], round(t_rl, 2), r["eval/reward"]))
    tail = evals[-max(len(evals) // 4, 1):]
    return {"setting": name, "wall_s": None, "start": evals[0]["eval/reward"],
            "best": max(e["eval/reward"] for e in evals), "last": evals[-1]["eval/reward"],
            "last_quarter_mean": round(sum(e["eval/reward"] for e in tail) / len(tail), 4),
            "mean_step_s": round(sum(r["time/total_s"] for r in rows) / len(rows), 4),
            "logp_diff_mean": round(sum(r.get("logp_diff_mean") or 0 for r in rows) / len(rows), 5),
            "curve": curve}


def collect(sources: list[Path]) -> list[dict]:
    """The settings of a study run in parts, in the order of SETTINGS. Each source is a study directory (one
    subdirectory per setting run, with its metrics.jsonl) or a study.json (the results a study wrote, kept when its
    run directories are gone). A setting found twice is an error: which one to plot would be a guess."""
    found: dict[str, tuple[Path, dict]] = {}
    for src in sources:
        if src.is_file():
            rows = json.loads(src.read_text())["results"]
        elif src.is_dir():
            rows = [summarize(n, src / n) for n in SETTINGS if (src / n / "metrics.jsonl").is_file()]
        else:
            raise SystemExit(f"staleness.py: --from {src}: no such file or directory")
        for r in rows:
            if r["setting"] not in SETTINGS:
                raise SystemExit(f"staleness.py: {src}: unknown setting {r['setting']!r}")
            if r["setting"] in found:
                raise SystemExit(f"staleness.py: setting {r['setting']} is in both {found[r['setting']][0]} and {src}")
            found[r["setting"]] = (src, r)
    if not found:
        raise SystemExit(f"staleness.py: no runs of any setting in {', '.join(map(str, sources))}")
    return [found[n][1] for n in SETTINGS if n in found]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        style = "--" if r["setting"].endswith("uncorrected") else "-"
        color = COLORS[r["setting"].split("-")[0]]  # one colour per staleness, AIPO and uncorrected alike
        steps, secs, reward = zip(*r["curve"])
        axes[0].plot(steps, reward, style, color=color, label=r["setting"])
        if None not in secs:  # a study.json may keep only the step curve of a run
            axes[1].plot(secs, reward, style, color=color, label=r["setting"])
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("staleness study: AIPO (solid) and uncorrected (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default=None, help="job config (default: the built-in default job)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    p.add_argument("overrides", nargs="*", default=[], help="overrides for every run (default: run.steps=400)")
    p.add_argument("--from", dest="from_dirs", nargs="+", type=Path, metavar="SRC",
                   help="run nothing: tabulate and plot the settings of a study run in parts, from its study "
                        "directories or study.json files (default plot: staleness-combined.png beside the first)")
    p.add_argument("--plot", type=Path, default=None, help="where to write the PNG")
    p.add_argument("--save", type=Path, default=None,
                   help="also write the results, curves included, to this study.json (e.g. to keep a study whose run "
                        "directories will not be kept; `--from` reads it back)")
    args = p.parse_args(argv)
    if args.from_dirs:
        results = collect(args.from_dirs)
        png = args.plot or args.from_dirs[0].parent / "staleness-combined.png"
    else:
        names = args.settings.split(",")
        unknown = [n for n in names if n not in SETTINGS]
        if unknown:
            p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
        overrides = args.overrides or (["run.steps=400"] if args.config is None else [])
        root = ROOT / "checkpoints" / f"staleness-{time.strftime('%Y%m%d-%H%M%S')}"
        results = []
        for n in names:  # study.json is rewritten after each run, so a study cut short keeps what it finished
            results.append(run_setting(n, args.config, overrides, root))
            (root / "study.json").write_text(json.dumps(
                {"config": args.config or "default", "overrides": overrides, "results": results}, indent=1) + "\n")
        png = args.plot or root / "staleness.png"
    plot(results, png)
    if args.save:
        args.save.write_text(json.dumps({"from": [str(d) for d in args.from_dirs or []] or None,
                                         "config": args.config, "results": results}, indent=1) + "\n")
    print(f"wrote {png}")
    print(f"{'setting':<22} {'start':>6} {'best':>6} {'last':>6} {'last 1/4':>8} {'step s':>7} {'|dlogp|':>8}")
    for r in results:
        print(f"{r['setting']:<22} {r['start']:6.3f} {r['best']:6.3f} {r['last']:6.3f} {r['last_quarter_mean']:8.3f} "
              f"{r['mean_step_s']:7.3f} {r['logp_diff_mean']:8.4f}")
    source = {"from": [str(d) for d in args.from_dirs]} if args.from_dirs else {
        "config": args.config or "default", "overrides": overrides}
    emit({"benchmark": "staleness", **source, "plot": str(png),
          "results": [{k: v for k, v in r.items() if k != "curve"} for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
