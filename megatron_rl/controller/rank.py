"""What every rank of a job runs, whoever started it (`controller/train.py`: this machine, or torchrun/srun).

    rank_main(rank, world_size, cfg, model_cfg, run_dir)  build the rank's `Job`, run `loop.run` (with the rank's
                                                          heartbeat, where watched); rank 0 shows the progress bar
                                                          and writes metrics.jsonl as rows arrive
    rank_role(cfg, rank)                                  what a rank is in the job, for the lines that name it

`rank_main` returns what the summary needs (rank 0's rows, where the run started, its time, the compiled graphs)
and, when a stop signal ended the run, the stop (`stopped_by`, `stopped_after_step`, `checkpoint`).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Optional

from megatron_rl.config import JobConfig
from megatron_rl.launch import signals
from megatron_rl.launch.console import below_bar, job_log_lines
from megatron_rl.parallel.liveness import Heartbeat

# What every rank of a job imports (`rank_main`): the local launcher's fork server imports it once for all of them.
RANK_MODULES = ("megatron_rl.controller.rank", "megatron_rl.controller.loop", "megatron_rl.controller.job")


def rank_role(cfg: JobConfig, rank: int) -> str:
    if rank >= cfg.reward_first_rank:
        return "reward model"
    if cfg.generator.colocated:
        return "trainer and generator"
    return "trainer" if rank < cfg.trainer.layout.size else "generator"


def freeze_startup_objects() -> None:
    """Move every object alive now (imported modules, the models, optimizers and process groups of the job) out of
    the garbage collector's reach for the rest of the process.

    They live as long as the rank, so a full collection only re-reads them: Megatron-Core's distributed optimizer
    runs one (`gc.collect()`) each time it builds its checkpoint state, which on a CPU made up about half of a small
    model's checkpoint. Objects created later are collected as before; garbage among the frozen ones (cycles left
    by startup, or that become unreachable later) is never freed, a small amount of memory for the rank's life.
    """
    gc.freeze()


def _own_line(line: str) -> None:
    """A line of a rank without the progress bar, started on a line of its own (rank 0's bar may stand unfinished)."""
    print(below_bar(line), file=sys.stderr, flush=True)


def rank_main(rank: int, world_size: int, cfg: JobConfig, model_cfg, run_dir: str,
              heartbeat: Optional[Heartbeat] = None) -> dict:
    """One rank of the job (both launchers): build its executors, run the loop; rank 0 shows progress and writes
    metrics.jsonl as rows arrive. `heartbeat`: this rank's, where the launcher watches it; the loop names each
    action in it."""
    from tqdm import tqdm

    from megatron_rl.checkpointing import storage
    from megatron_rl.checkpointing.layout import CheckpointError
    from megatron_rl.controller import loop
    from megatron_rl.controller.job import Job
    from megatron_rl.controller.metrics import GapWatch, StuckWatch, open_metrics

    t0 = time.perf_counter()
    sft = cfg.trainer.sft_warmup_steps
    bar = tqdm(total=sft + cfg.run.steps, desc="megatron-rl", unit="step", file=sys.stderr,
               dynamic_ncols=True) if rank == 0 else None
    writer = None

    def progress(phase: str, done: int, total: int, text: str) -> None:
        if bar is not None:  # a resumed run's first step moves the bar past the steps done before
            bar.update((done if phase == "warm-start" else sft + done) - bar.n)
            if text:
                bar.set_postfix_str(text, refresh=False)

    def echo(text: str) -> None:
        if bar is not None:
            bar.write(text, file=sys.stderr)

    job_log_lines(echo if bar is not None else _own_line)  # the package's warnings, in the job's form

    watches = (GapWatch(cfg.rollout.effective_staleness, echo), StuckWatch(model_cfg.vocab_size, echo))

    def on_row(row: dict) -> None:
        nonlocal writer
        if writer is None:  # the first row's step is where this run starts: a resumed run drops later rows
            writer = open_metrics(cfg, Path(run_dir), row["step"], echo)
        writer.write(row)
        for watch in watches:
            watch.see(row)

    failing = False
    job = None
    try:
        job = Job(cfg, model_cfg, Path(run_dir), echo)
        freeze_startup_objects()
        rows = loop.run(job, progress, on_row=on_row, heartbeat=heartbeat)
    except OSError as e:  # the run directory refused a write (metrics, TensorBoard): a storage fault in one line
        failing = True
        problem = storage.diagnose(Path(run_dir), e)
        if problem is None:
            raise
        raise CheckpointError(storage.storage_fault_line(Path(run_dir), "a write failed", problem)) from e
    except BaseException:
        failing = True
        raise
    finally:
        if job is not None:
            job.close()
        if bar is not None:
            bar.close()
        if writer is not None:
            try:
                writer.close()
            except OSError:
                if not failing:
                    raise
    stopped = job.saved_version if job.stop_signal else cfg.run.steps
    result = {"rows": rows, "start_step": rows[0]["step"] if rows else stopped, "time_s": time.perf_counter() - t0,
              "compiled_graphs": compiled_graph_report()}
    if job.stop_signal:
        from megatron_rl.checkpointing.training import step_dir_name

        result["stopped"] = {"stopped_by": signals.name(job.stop_signal), "stopped_after_step": job.saved_version,
                             "checkpoint": step_dir_name(job.saved_version)}
    return result


def compiled_graph_report() -> dict:
    """This rank's compiled graphs per kernel (only those that compiled) and the specializations that fell back to
    eager, for summary.json: a recompiling kernel shows here, not only as a slow step."""
    from megatron_rl.compat.compiled import all_kernels, compiled_graph_counts

    report = {name: n for name, n in compiled_graph_counts().items() if n}
    fallbacks = {k.name: len(k.fallbacks) for k in all_kernels() if k.fallbacks}
    return {"graphs": report, "eager_fallbacks": fallbacks} if report or fallbacks else {}
