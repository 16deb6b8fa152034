"""`megatron-rl train`: start the ranks of one machine, run the job, write metrics, a plot and a summary."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import yaml

from megatron_rl.config import JobConfig, validate


def _job_worker(rank: int, world_size: int, cfg: JobConfig, run_dir: str) -> dict:
    from megatron_rl.controller.job import Job
    from megatron_rl.controller.metrics import MetricsWriter

    job = Job(cfg, Path(run_dir))
    t0 = time.perf_counter()
    bar, writer = None, None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.trainer.warmup_steps_sft + cfg.run.steps, desc="megatron-rl", unit="step",
                   file=sys.stderr, dynamic_ncols=True)

    def progress(step, total, text):
        if bar is not None:
            bar.update(1)
            if text:
                bar.set_postfix_str(text, refresh=False)

    def echo(text):
        if bar is not None:
            if job.start_step and bar.n < cfg.trainer.warmup_steps_sft + job.start_step:
                bar.update(cfg.trainer.warmup_steps_sft + job.start_step - bar.n)
            bar.write(text, file=sys.stderr)

    def on_row(row):
        nonlocal writer
        if writer is None:  # the first row: the start step is known (a resumed run drops later rows)
            writer = MetricsWriter(Path(run_dir), start_step=job.start_step)
        writer.write(row)

    try:
        rows = job.run(progress, on_row=on_row if rank == 0 else None, echo=echo)
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
    return {"rows": rows, "start_step": job.start_step, "time_s": time.perf_counter() - t0}


def train(cfg: JobConfig) -> dict:
    """Run the job on this machine with as many processes as its executors need; returns the summary."""
    from megatron_rl.controller.metrics import plot_run
    from megatron_rl.parallel.spawn import run_local

    world = cfg.world_size_needed
    validate(cfg, world)
    if cfg.data.dataset != "synthetic-arithmetic":
        from megatron_rl.config import ConfigError

        raise ConfigError(f"data.dataset={cfg.data.dataset!r} is not yet available to the job: it runs the built-in "
                          f"'synthetic-arithmetic' task with the byte tokenizer (GSM8K/MATH jobs need checkpoint "
                          f"loading and the tokenizer of the model, not wired yet)")
    run_dir = Path(cfg.checkpoint.dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    t0 = time.perf_counter()
    results = run_local(_job_worker, world, cfg, str(run_dir), timeout=3600)
    wall = time.perf_counter() - t0
    from megatron_rl.controller.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else []
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    summary = {
        "run_dir": str(run_dir), "steps": len(rows), "resumed_from_step": results[0]["start_step"],
        "wall_time_s": round(wall, 1),
        "warm_start_s": round(rows[0]["warm_start_s"], 1) if rows else None,
        "eval_reward_start": evals[0] if evals else None, "eval_reward_end": evals[-1] if evals else None,
        "eval_reward_gain": (evals[-1] - evals[0]) if len(evals) > 1 else None,
        "mean_step_s": sum(r["time/total_s"] for r in rows) / max(len(rows), 1),
        "mode": cfg.rollout.mode, "staleness": cfg.rollout.staleness if cfg.rollout.mode == "async" else 0,
    }
    plot = plot_run(rows, run_dir / "metrics.png",
                    title=f"{cfg.model.preset}: {cfg.rollout.mode} AIPO, trainer tp={cfg.trainer.tp}, "
                          f"generator tp={cfg.generator.tp} dp={cfg.generator.dp}")
    summary["plot"] = str(plot) if plot else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def config_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)
