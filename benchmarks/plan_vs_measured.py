"""The planner's step-time composition against real runs of our default CPU job (issue 15's second check).

    python benchmarks/plan_vs_measured.py                          # run the job twice (sync, async), then compare
    python benchmarks/plan_vs_measured.py --steps 60 --skip 10     # longer runs, more steady state
    python benchmarks/plan_vs_measured.py --runs SYNC_DIR ASYNC_DIR --weight-sync-s 0.004   # existing run dirs

1. Runs `megatron-rl train` (the default job: tiny model, trainer TP2 on ranks 0-1, generator TP1 on rank 2) with
   a short warm start, no checkpoints and no held-out evaluation (neither is part of an RL step), once with
   `rollout.mode=sync` and once with `rollout.mode=async`, each in a temporary checkpoint directory.
2. Per-executor rates from each run's metrics.jsonl, steps `--skip` on: generation `time/generation_s`, reward
   `time/reward_s` (both on the generator's clock), training `time/train_s` (the trainer's). The DDMA push is not
   in the rows; it is measured on its own by `benchmarks/ddma.py`'s CPU case for the job's layout pair (the tiny
   model, trainer tp=2 -> generator tp=1, separate processes, gloo), so no rate is derived from the step time
   it is compared with.
3. `planning.steptime.step_times_from_rates`: the planner's composition (sync = generation + reward + training +
   sync; async = max(generation + reward, training) + sync).
4. Measured step time: the wall-clock interval between consecutive rows arriving in metrics.jsonl (the script
   watches the file; rank 0 writes each row as its step ends), steps `--skip` on. For `--runs`, the arrival
   times this script saved next to the rows (`arrivals.json`), else the summary's wall time less the warm start
   over the steps (which also counts start-up: an upper bound).

Predictions are made twice for the asynchronous mode: from the async run's own rates (three processes share the
CPU's cores while generation and training overlap, which slows both), and from the sync run's rates (each executor
measured while the other waits: the planner's situation, rates of executors working alone). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

from megatron_rl.planning.steptime import ExecutorRates, step_times_from_rates  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOB_LAYOUT = ("tiny", "tp=2", "tp=1")  # the default job's model, trainer layout, generator layout


def rates_from_rows(rows: list[dict], weight_sync_s: float, skip: int) -> ExecutorRates:
    """Mean per-executor seconds over the rows of steps >= `skip`."""
    steady = [r for r in rows if r["step"] >= skip]
    if not steady:
        raise ValueError(f"no metrics rows at step >= {skip} (the run has {len(rows)})")
    mean = lambda key: statistics.fmean(r[key] for r in steady)  # noqa: E731
    return ExecutorRates(mean("time/generation_s"), mean("time/reward_s"), mean("time/train_s"), weight_sync_s)


def compare(sync_rows: list[dict], async_rows: list[dict], weight_sync_s: float, measured_sync_s: float,
            measured_async_s: float, skip: int) -> dict:
    """Predicted (from each run's rates) against measured mean step times; ratio = predicted / measured."""
    sync_rates = rates_from_rows(sync_rows, weight_sync_s, skip)
    async_rates = rates_from_rows(async_rows, weight_sync_s, skip)
    pred_sync = step_times_from_rates(sync_rates).sync_s
    pred_async = step_times_from_rates(async_rates).async_s
    pred_async_alone = step_times_from_rates(sync_rates).async_s
    return {
        "rates": {"sync_run": vars(sync_rates), "async_run": vars(async_rates)},
        "sync": {"predicted_s": pred_sync, "measured_s": measured_sync_s, "ratio": pred_sync / measured_sync_s},
        "async": {"predicted_s": pred_async, "measured_s": measured_async_s, "ratio": pred_async / measured_async_s},
        "async_from_sync_rates": {"predicted_s": pred_async_alone, "measured_s": measured_async_s,
                                  "ratio": pred_async_alone / measured_async_s},
        "speedup": {"predicted": pred_sync / pred_async, "measured": measured_sync_s / measured_async_s},
    }


def interval_step_s(arrivals: dict[int, float], skip: int) -> float:
    """Mean wall seconds per step from row arrival times (step -> seconds), steps `skip` .. last."""
    steps = sorted(s for s in arrivals if s >= skip - 1)
    if len(steps) < 2:
        raise ValueError(f"need rows of at least two steps from step {skip - 1} on to time a step")
    return (arrivals[steps[-1]] - arrivals[steps[0]]) / (steps[-1] - steps[0])


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_job(root: Path, mode: str, steps: int, warm_steps: int, overrides: list[str], poll_s: float) -> Path:
    """Run the default job in `mode` under `root`, timestamping each metrics row as it appears."""
    name = f"plan-vs-measured-{mode}"
    run_dir = root / name
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", f"rollout.mode={mode}", f"run.steps={steps}",
           f"trainer.sft_warmup_steps={warm_steps}", f"run.eval_interval={10 * steps}", "checkpoint.save_interval=0",
           f"checkpoint.dir={root}", f"run.name={name}", *overrides]
    metrics = run_dir / "metrics.jsonl"
    arrivals: dict[int, float] = {}
    seen = 0
    with open(root / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                lines = metrics.read_text().split("\n")[:-1]  # whole rows: each ends with its newline
                now = time.perf_counter()
                for line in lines[seen:]:
                    arrivals[json.loads(line)["step"]] = now
                seen = max(seen, len(lines))
            if done:
                break
            time.sleep(poll_s)
    if proc.returncode != 0:
        raise SystemExit(f"plan_vs_measured: `{' '.join(cmd)}` failed ({proc.returncode}); see {root / name}.log")
    (run_dir / "arrivals.json").write_text(json.dumps(arrivals))
    return run_dir


def measured_step_s(run_dir: Path, skip: int) -> tuple[float, str]:
    arrivals_file = run_dir / "arrivals.json"
    if arrivals_file.exists():
        arrivals = {int(k): v for k, v in json.loads(arrivals_file.read_text()).items()}
        return interval_step_s(arrivals, skip), "row arrival intervals"
    summary = json.loads((run_dir / "summary.json").read_text())
    return ((summary["wall_time_s"] - summary["warm_start_s"]) / summary["steps"],
            "summary: (wall - warm start) / steps, start-up included (upper bound)")


def measure_weight_sync(syncs: int) -> float:
    """The median DDMA push of the default job's layout pair, timed by benchmarks/ddma.py's CPU case."""
    from ddma import cpu_case

    preset, src, dst = JOB_LAYOUT
    return cpu_case(preset, src, dst, syncs, bucket_mb=64.0)["ddma_s"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--warm-steps", type=int, default=20, help="supervised warm-start steps (not timed)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of every mean")
    p.add_argument("--syncs", type=int, default=7, help="DDMA pushes timed for the weight-sync rate")
    p.add_argument("--weight-sync-s", type=float, default=None, help="use this push time instead of measuring it")
    p.add_argument("--runs", nargs=2, metavar=("SYNC_DIR", "ASYNC_DIR"), help="compare existing run directories")
    p.add_argument("--poll-s", type=float, default=0.02, help="how often the script looks for new rows")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories (printed)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for both runs (dotted key=value)")
    args = p.parse_args(argv)

    root = None
    if args.runs:
        sync_dir, async_dir = map(Path, args.runs)
    else:
        root = Path(tempfile.mkdtemp(prefix="plan-vs-measured-"))
        sync_dir = run_job(root, "sync", args.steps, args.warm_steps, args.overrides, args.poll_s)
        async_dir = run_job(root, "async", args.steps, args.warm_steps, args.overrides, args.poll_s)
    sync_s, how_sync = measured_step_s(sync_dir, args.skip)
    async_s, how_async = measured_step_s(async_dir, args.skip)
    weight_sync = args.weight_sync_s if args.weight_sync_s is not None else measure_weight_sync(args.syncs)
    result = compare(read_rows(sync_dir / "metrics.jsonl"), read_rows(async_dir / "metrics.jsonl"), weight_sync,
                     sync_s, async_s, args.skip)
    result.update({"steps": args.steps, "skip": args.skip, "measured_by": {"sync": how_sync, "async": how_async},
                   "weight_sync_s": weight_sync, "load_average_1min": os.getloadavg()[0],
                   "runs": {"sync": str(sync_dir), "async": str(async_dir)}})
    for mode in ("sync", "async", "async_from_sync_rates"):
        r = result[mode]
        print(f"{mode:>22}: predicted {r['predicted_s']:.3f} s, measured {r['measured_s']:.3f} s, "
              f"ratio {r['ratio']:.2f}")
    print(f"{'speed-up':>22}: predicted {result['speedup']['predicted']:.2f}x, "
          f"measured {result['speedup']['measured']:.2f}x (load average {result['load_average_1min']:.1f})")
    if root is not None and not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
