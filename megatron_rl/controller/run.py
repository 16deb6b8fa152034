"""`megatron-rl train`: start the ranks of one machine, run the job, write metrics, a plot and a summary."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path


from megatron_rl.config import ConfigError, JobConfig, validate


def _job_worker(rank: int, world_size: int, cfg: JobConfig, run_dir: str) -> dict:
    from megatron_rl.controller.job import Job
    from megatron_rl.controller.metrics import open_metrics

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
            writer = open_metrics(cfg, Path(run_dir), job.start_step, echo)
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
    """Run the job on this machine with as many processes as its executors need; returns the summary.
    (`megatron_rl.controller.launcher` runs the same job in a world started by torchrun or srun.)"""
    from megatron_rl.checkpointing import initial
    from megatron_rl.controller.launcher import dist_timeout_s, prepare_run_dir, write_summary
    from megatron_rl.parallel.spawn import LaunchError, local_gpus, resolve_backend, run_local

    world = cfg.world_size_needed
    validate(cfg, world)
    try:  # before anything is written: a machine with too few GPUs fails in one line
        backend = resolve_backend(cfg.run.backend, world, local_gpus())
    except LaunchError as e:
        raise ConfigError(str(e)) from None
    run_dir = prepare_run_dir(cfg)
    cfg = initial.prepare(cfg, run_dir, log=lambda text: print(f"megatron-rl: {text}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    # No time limit on the whole job (a run takes as long as its steps); a dead or hung rank still ends it through
    # the process group's timeout.
    results = run_local(_job_worker, world, cfg, str(run_dir), backend=backend, timeout=None,
                        dist_timeout_s=dist_timeout_s())
    return write_summary(cfg, results[0], run_dir, time.perf_counter() - t0, {"backend": backend})


def config_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)
