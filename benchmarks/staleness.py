"""The staleness study: synchronous on-policy training against asynchronous training at staleness 1, 2, 4 and 8,
each with AIPO's importance weights, without them (the behaviour policy ignored), and with the peers' corrections
(`algorithm.correction`: mask, decoupled, sequence), and with in-flight weight updates (`async<s>-inflight`:
`rollout.in_flight`, the bound on each sample's oldest token), over seeds.

    python benchmarks/staleness.py                          # the default task (tiny model), 400 RL steps each
    python benchmarks/staleness.py --settings sync,async1,async4-uncorrected run.steps=200
    python benchmarks/staleness.py -c configs/smollm2-arithmetic.yaml   # the real-model recipe (30+ min a run)
    python benchmarks/staleness.py --from checkpoints/staleness-A checkpoints/staleness-B   # a study run in parts
    python benchmarks/staleness.py -c configs/smollm2-arithmetic.yaml --seeds 3 \
        --settings sync,async1,async1-uncorrected,async4,async4-uncorrected,async4-mask,async4-decoupled,async4-sequence
    python benchmarks/staleness.py ... --seeds 3 --first-seed 1     # seeds 1 and 2 only, to join seed 0's with --from

Seeds: `--seeds N` runs each setting N times, with run.seed = 1234, 1235, ... (the seed changes the sampling and the
order of the training problems, never the held-out set) into <setting>-seed<i>/. Each setting's held-out accuracy
at the last evaluation is reported as the mean over seeds with its standard error, and pairs of settings (the
claims the study tests) as the mean of their paired differences, seed by seed, with its standard error
(`seed_stats`, `paired`). The seed spread already holds each evaluation's binomial noise, p(1 - p)/n for n
held-out responses; with three seeds the spread's estimate is itself rough, so the binomial variance is its floor.

Each setting is one `megatron-rl train` from scratch (same seed, same data; only the schedule and the correction
differ) into checkpoints/staleness-<time>/<setting>/. Held-out reward is plotted against RL step and against wall
time (one PNG, staleness.png in that directory, one colour per staleness); the results, curves included, are
rewritten to study.json there after each run, so a study run in parts (or cut short) can be drawn whole with
`--from`. The table gives the held-out reward at the start, its best and
its last value, the mean of the last quarter of evaluations, the mean step time and the mean |logp_pi - logp_mu|.
For each stale setting it then splits the gap to sync into what the lag alone explains (sync's curve s steps earlier,
`lag_alone`) and the rest, and compares the train reward of the same policy versions (`by_version`).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
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
    **{f"async{s}-{c}": ["rollout.mode=async", f"rollout.staleness={s}", f"algorithm.correction={c}"]
       for s in (1, 2, 4, 8) for c in ("mask", "decoupled", "sequence")},
    # In-flight weight updates (`rollout.in_flight`): the bound is on each sample's oldest token.
    **{f"async{s}-inflight": ["rollout.mode=async", f"rollout.staleness={s}", "rollout.in_flight=true"]
       for s in (1, 2, 4)},
}
FIRST_SEED = 1234  # run.seed's default: seed 0 of a study is the run a study without --seeds makes
# The claims the study tests, as (setting, against it): the paper's (async AIPO as good as sync), AReaL's (a
# correction beats none at staleness 4), and the goal (a correction at staleness 4 as good as sync).
PAIRS = [("async1", "sync"), ("async1", "async1-uncorrected"), ("async4", "async4-uncorrected"),
         *((f"async4-{c}", "async4-uncorrected") for c in ("mask", "decoupled", "sequence")),
         *((f"async4{c}", "sync") for c in ("", "-mask", "-decoupled", "-sequence")),
         # In-flight updates against batch mode at the same bound, and at the same overlap with the trainer.
         ("async1-inflight", "async1"), ("async2-inflight", "async1")]


COLORS = {"sync": "black", "async1": "tab:blue", "async2": "tab:orange", "async4": "tab:green", "async8": "tab:red"}


def run_name(setting: str, seed: int | None) -> str:
    return setting if seed is None else f"{setting}-seed{seed}"


def run_setting(name: str, config: str | None, overrides: list[str], root: Path, seed: int | None = None) -> dict:
    seeded = [] if seed is None else [f"run.seed={FIRST_SEED + seed}"]
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *(["-c", config] if config else []),
           f"checkpoint.dir={root}", f"run.name={run_name(name, seed)}", *SETTINGS[name], *overrides, *seeded]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                   stdout=subprocess.DEVNULL)
    return {**summarize(name, root / run_name(name, seed), seed), "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(name: str, run_dir: Path, seed: int | None = None) -> dict:
    """One run's row and curve, from the metrics.jsonl of its run directory; `heldout` is the number of held-out
    responses each evaluation scores (data.eval_size x data.eval_samples, from its config.yaml)."""
    import yaml

    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/reward" in r]
    t_rl = 0.0
    curve = []
    for r in rows:  # wall time of the RL phase (the warm start is the same for every setting)
        t_rl += r["time/total_s"]
        if "eval/reward" in r:
            curve.append((r["step"], round(t_rl, 2), r["eval/reward"]))
    tail = evals[-max(len(evals) // 4, 1):]
    return {"setting": name, "seed": seed, "heldout": data["eval_size"] * data["eval_samples"], "wall_s": None,
            "start": evals[0]["eval/reward"],
            "best": max(e["eval/reward"] for e in evals), "last": evals[-1]["eval/reward"],
            "last_quarter_mean": round(sum(e["eval/reward"] for e in tail) / len(tail), 4),
            "mean_step_s": round(sum(r["time/total_s"] for r in rows) / len(rows), 4),
            "logp_diff_mean": round(sum(r.get("logp_diff_mean") or 0 for r in rows) / len(rows), 5),
            "curve": curve,
            # each step's policy version that sampled its batch, train reward and trainer-generator log-prob gap
            # (for `by_version`, and for the gap the job warns at: controller/metrics.py, LOGP_GAP_WARN)
            "train": [(r["step"], r["generated_with_version"], round(r["reward"], 5),
                       round(r.get("logp_diff_mean") or 0.0, 5)) for r in rows]}


def _setting_and_seed(dirname: str) -> tuple[str, int | None]:
    name, sep, seed = dirname.rpartition("-seed")
    return (name, int(seed)) if sep and seed.isdigit() else (dirname, None)


def collect(sources: list[Path]) -> list[dict]:
    """The runs of a study run in parts, in the order of SETTINGS, then seed. Each source is a study directory (one
    subdirectory per run, <setting> or <setting>-seed<i>, with its metrics.jsonl) or a study.json (the results a
    study wrote, kept when its run directories are gone). A run found twice is an error: which one to use would be
    a guess."""
    found: dict[tuple, tuple[Path, dict]] = {}
    for src in sources:
        if src.is_file():
            study = json.loads(src.read_text())
            rows = study["results"]
            for r in rows:  # files written before seeds: the held-out count from the study's own config
                r.setdefault("heldout", _heldout(study.get("config"), study.get("overrides") or []))
        elif src.is_dir():
            rows = []
            for d in sorted(src.iterdir()):
                if (d / "metrics.jsonl").is_file():
                    name, seed = _setting_and_seed(d.name)
                    rows.append(summarize(name, d, seed))
        else:
            raise SystemExit(f"staleness.py: --from {src}: no such file or directory")
        for r in rows:
            if r["setting"] not in SETTINGS:
                raise SystemExit(f"staleness.py: {src}: unknown setting {r['setting']!r}")
            if r.get("seed") is None:  # a run without --seeds ran at run.seed 1234: seed 0 of a seeded study
                r["seed"] = 0
            key = (r["setting"], r["seed"])
            if key in found:
                raise SystemExit(f"staleness.py: run {run_name(*key)} is in both {found[key][0]} and {src}")
            found[key] = (src, r)
    if not found:
        raise SystemExit(f"staleness.py: no runs of any setting in {', '.join(map(str, sources))}")
    order = {n: i for i, n in enumerate(SETTINGS)}
    return [found[k][1] for k in sorted(found, key=lambda k: (order[k[0]], -1 if k[1] is None else k[1]))]


def _heldout(config: str | None, overrides: list[str]) -> int | None:
    """Held-out responses per evaluation of a study's job (data.eval_size x data.eval_samples)."""
    from megatron_rl.config import load_config

    if config is None or (config != "default" and not (ROOT / config).is_file()):
        return None  # (a study.json that `--from --save` wrote names no config)
    cfg = load_config(None if config == "default" else ROOT / config, overrides)
    return cfg.data.eval_size * cfg.data.eval_samples


def _variance(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0


def seed_stats(results: list[dict]) -> list[dict]:
    """Each setting's held-out accuracy at its last evaluation: the mean over its seeds and that mean's standard
    error, sqrt(max(s^2, p(1 - p)/n) / k) for k seeds with sample variance s^2, mean p and n held-out responses."""
    out = []
    for name in dict.fromkeys(r["setting"] for r in results):
        runs = [r for r in results if r["setting"] == name]
        acc = [r["last"] for r in runs]
        k, p = len(acc), sum(acc) / len(acc)
        binomial = p * (1 - p) / runs[0]["heldout"] if runs[0].get("heldout") else 0.0  # unknown in older files
        se = math.sqrt(max(_variance(acc), binomial) / k) if binomial or k > 1 else None
        out.append({"setting": name, "seeds": k, "mean": p, "se": se,
                    "seed_sd": math.sqrt(_variance(acc)), "binomial_se_one_eval": math.sqrt(binomial)})
    return out


def paired(results: list[dict], a: str, b: str) -> dict | None:
    """Setting a minus setting b, seed by seed over the seeds both ran: the mean difference, its standard error
    (the same floor: the two evaluations' binomial variances), and the difference in SEs. None without a shared
    seed."""
    by = {(r["setting"], r.get("seed")): r for r in results}
    shared = {s for (n, s) in by if n == a} & {s for (n, s) in by if n == b}
    seeds = sorted(shared, key=lambda s: -1 if s is None else s)
    if not seeds:
        return None
    d = [by[(a, s)]["last"] - by[(b, s)]["last"] for s in seeds]
    diff = sum(d) / len(d)
    se = _paired_se(d, by, seeds, (a, b))
    return {"a": a, "b": b, "seeds": len(d), "diff": diff, "se": se, "in_se": diff / se if se else None}


def _paired_se(d: list[float], by: dict, seeds: list, names: tuple[str, str]) -> float | None:
    """The SE of the mean of per-seed differences d between two settings: from the spread of d, floored by the sum
    of the two settings' binomial variances at their mean last evaluations (unknown held-out counts add none)."""
    means = {n: sum(by[(n, s)]["last"] for s in seeds) / len(seeds) for n in names}
    binomial = sum(m * (1 - m) / by[(n, seeds[0])]["heldout"] for n, m in means.items()
                   if by[(n, seeds[0])].get("heldout"))
    return math.sqrt(max(_variance(d), binomial) / len(d)) if binomial or len(d) > 1 else None


def _staleness(setting: str) -> int:
    return int(setting.split("-")[0].removeprefix("async"))


def _interpolate(curve: list, step: float) -> float:
    """A held-out curve's value at `step`, linear between its evaluations ([step, seconds, reward] rows)."""
    for (s0, _, r0), (s1, _, r1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return r0 + (r1 - r0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step {step} is outside the curve's evaluations {curve[0][0]}..{curve[-1][0]}")


def lag_alone(results: list[dict], setting: str) -> dict | None:
    """How much of a stale setting's gap to sync its lag alone explains. At staleness s the first s batches come
    from the starting weights and every later one is s updates old; if that lag were all staleness did, the run
    would reach at its last evaluation T what sync reached at T - s. Seed by seed: `lag` = sync(T) - sync(T - s)
    (sync's held-out curve, linear between its evaluations) and `rest` = sync(T - s) - setting(T), what the lag
    does not explain, with its SE (the same floor as `paired`). None without a seed both ran."""
    by = {(r["setting"], r.get("seed")): r for r in results}
    seeds = sorted({s for (n, s) in by if n == setting} & {s for (n, s) in by if n == "sync"})
    if not seeds or not setting.startswith("async"):
        return None
    lag, rest = [], []
    for seed in seeds:
        sync, stale = by[("sync", seed)], by[(setting, seed)]
        last = stale["curve"][-1][0]
        delayed = _interpolate(sync["curve"], last - _staleness(setting))
        lag.append(_interpolate(sync["curve"], last) - delayed)
        rest.append(delayed - stale["last"])
    se = _paired_se(rest, by, seeds, ("sync", setting))
    gap = sum(lag) / len(lag) + sum(rest) / len(rest)
    return {"setting": setting, "seeds": len(seeds), "gap": gap, "lag": sum(lag) / len(lag),
            "rest": sum(rest) / len(rest), "rest_se": se}


def by_version(results: list[dict], setting: str, last: int = 10) -> dict | None:
    """The train reward of the same policy versions: the mean train reward of the batches sampled by the last
    `last` policy versions the stale run reached, against sync's batches from those versions, seed by seed (runs
    that kept their per-step rows). A lag that only delays learning gives a policy of version v the same reward in
    both (it has had v updates either way); a lower reward means each stale update was worth less. Returns the
    paired mean difference and its SE over seeds (the SE of one run's mean is not floored: batches differ)."""
    by = {(r["setting"], r.get("seed")): r for r in results if r.get("train")}
    seeds = sorted({s for (n, s) in by if n == setting} & {s for (n, s) in by if n == "sync"})
    if not seeds:
        return None
    diffs, versions = [], None
    for seed in seeds:
        rows = {n: {} for n in ("sync", setting)}
        for n in rows:
            for _, version, reward, *_ in by[(n, seed)]["train"]:
                rows[n].setdefault(version, []).append(reward)
        shared = sorted(set(rows["sync"]) & set(rows[setting]))[-last:]
        versions = (shared[0], shared[-1])
        mean = {n: sum(sum(rows[n][v]) / len(rows[n][v]) for v in shared) / len(shared) for n in rows}
        diffs.append(mean[setting] - mean["sync"])
    se = math.sqrt(_variance(diffs) / len(diffs)) if len(diffs) > 1 else None
    return {"setting": setting, "seeds": len(seeds), "versions": versions, "diff": sum(diffs) / len(diffs), "se": se}


def _pm(value: float, se: float | None) -> str:
    return f"{value:+.3f} +- " + ("  n/a" if se is None else f"{se:5.3f}")


STYLES = {"": "-", "uncorrected": "--", "mask": ":", "decoupled": "-.", "sequence": (0, (6, 2, 1, 2, 1, 2)),
          "inflight": (0, (3, 1, 1, 1))}


def plot(results: list[dict], path: Path) -> None:
    """Held-out reward against RL step and against RL wall time: the mean over a setting's seeds, with a band of
    one standard error of that mean where there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in dict.fromkeys(r["setting"] for r in results):
        curves = [r["curve"] for r in results if r["setting"] == name]
        n = min(len(c) for c in curves)
        steps = [c[0] for c in curves[0][:n]]
        reward = [[c[i][2] for c in curves] for i in range(n)]
        mean = [sum(v) / len(v) for v in reward]
        se = [math.sqrt(_variance(v) / len(v)) for v in reward]
        secs = [None if None in [c[i][1] for c in curves] else sum(c[i][1] for c in curves) / len(curves)
                for i in range(n)]
        style = STYLES[name.partition("-")[2]]
        color = COLORS[name.split("-")[0]]  # one colour per staleness, one line style per correction
        label = name + (f" ({len(curves)} seeds)" if len(curves) > 1 else "")
        for ax, xs in ((axes[0], steps), (axes[1], secs)):
            if None in xs:  # a study.json may keep only the step curve of a run
                continue
            ax.plot(xs, mean, linestyle=style, color=color, label=label)
            if len(curves) > 1:
                ax.fill_between(xs, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)],
                                color=color, alpha=0.12)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("staleness study: AIPO (solid), uncorrected (dashed), mask (dotted), decoupled (dash-dot), "
                 "sequence (dash-dot-dot)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


DEFAULT_SETTINGS = ["sync", *(f"async{s}{c}" for c in ("", "-uncorrected") for s in (1, 2, 4, 8))]


def report(results: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Print the runs, the settings over seeds, the pairs the study tests and how much of each stale setting's gap
    to sync its lag alone explains; returns (settings, pairs, lags)."""
    print(f"{'run':<28} {'start':>6} {'best':>6} {'last':>6} {'last 1/4':>8} {'step s':>7} {'|dlogp|':>8}")
    for r in results:
        print(f"{run_name(r['setting'], r.get('seed')):<28} {r['start']:6.3f} {r['best']:6.3f} {r['last']:6.3f} "
              f"{r['last_quarter_mean']:8.3f} {r['mean_step_s']:7.3f} {r['logp_diff_mean']:8.4f}")
    stats = seed_stats(results)
    print(f"\n{'setting':<22} {'seeds':>5} {'last eval, mean +- SE':>22} {'seed sd':>8} {'binomial SE':>12}")
    for st in stats:
        print(f"{st['setting']:<22} {st['seeds']:5d} {_pm(st['mean'], st['se']):>22} {st['seed_sd']:8.3f} "
              f"{st['binomial_se_one_eval']:12.3f}")
    pairs = [q for q in (paired(results, a, b) for a, b in PAIRS) if q is not None]
    if pairs:
        print(f"\n{'paired difference':<40} {'seeds':>5} {'mean +- SE':>16} {'in SE':>6}")
    for q in pairs:
        in_se = "" if q["in_se"] is None else f"{q['in_se']:+6.1f}"
        print(f"{q['a'] + ' - ' + q['b']:<40} {q['seeds']:5d} {_pm(q['diff'], q['se']):>16} {in_se:>6}")
    stale = [n for n in dict.fromkeys(r["setting"] for r in results) if n.startswith("async")]
    lags = [q for q in (lag_alone(results, n) for n in stale) if q is not None]
    if lags:
        print(f"\n{'gap to sync, held-out':<28} {'seeds':>5} {'gap':>7} {'the lag':>8} "
              f"{'the rest +- SE':>16}   train reward at the same policy versions, setting - sync")
    for q in lags:
        v = by_version(results, q["setting"])
        at = "" if v is None else f"{_pm(v['diff'], v['se'])} (versions {v['versions'][0]}-{v['versions'][1]}, " \
                                  f"{v['seeds']} seeds)"
        print(f"{q['setting']:<28} {q['seeds']:5d} {q['gap']:+7.3f} {q['lag']:+8.3f} {_pm(q['rest'], q['rest_se']):>16}"
              f"   {at}")
    return stats, pairs, lags


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default=None, help="job config (default: the built-in default job)")
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="run each setting with N run seeds (1234, 1235, ...) into <setting>-seed<i>")
    p.add_argument("--first-seed", type=int, default=0, metavar="I",
                   help="with --seeds N: run seeds I..N-1 only (a study continued in parts; --from joins them)")
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
        if args.seeds is not None and not 0 <= args.first_seed < args.seeds:
            p.error("--seeds N must be >= 1 and --first-seed below it")
        results = []
        seeds = [None] if args.seeds is None else list(range(args.first_seed, args.seeds))
        for seed in seeds:  # every setting once, then again with the next seed: a study cut short stays balanced
            for n in names:  # study.json is rewritten after each run, so a study cut short keeps what it finished
                results.append(run_setting(n, args.config, overrides, root, seed))
                (root / "study.json").write_text(json.dumps(
                    {"config": args.config or "default", "overrides": overrides, "results": results}, indent=1) + "\n")
        png = args.plot or root / "staleness.png"
    plot(results, png)
    if args.save:
        args.save.write_text(json.dumps({"from": [str(d) for d in args.from_dirs or []] or None,
                                         "config": args.config, "results": results}, indent=1) + "\n")
    print(f"wrote {png}")
    stats, pairs, lags = report(results)
    source = {"from": [str(d) for d in args.from_dirs]} if args.from_dirs else {
        "config": args.config or "default", "overrides": overrides}
    emit({"benchmark": "staleness", **source, "plot": str(png),
          "results": [{k: v for k, v in r.items() if k not in ("curve", "train")} for r in results],
          "settings": stats, "pairs": pairs, "lag_alone": lags})
    return 0


if __name__ == "__main__":
    sys.exit(main())
