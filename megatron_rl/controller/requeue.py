"""The end of a SLURM allocation: the one line a recipe prints when srun ends, and whether the job goes back in
the queue so that its next allocation resumes the run.

The recipes (`launch/slurm/*.sbatch`) are requeueable (`--requeue`) and ask SLURM for SIGUSR1 in the batch shell
5 minutes before the time limit (`--signal=B:USR1@300`). A cancel (`scancel`) sends SIGTERM to the job. Either
signal, trapped in the batch shell, is forwarded as SIGTERM to the job step (srun passes it to torchrun, torchrun to
the ranks), which stops the run at its next weight push with a checkpoint (`launch/signals.py`). Then:

| how srun ended | the line | requeued |
| --- | --- | --- |
| the run finished (exit 0) | none (rank 0's summary) | never |
| stopped with a checkpoint after the time-limit warning | the stop, and "requeued" | yes, unless `MEGATRON_RL_REQUEUE=0` |
| stopped with a checkpoint after a cancel | the stop, and "cancelled: not requeued" | never |
| failed, or stopped without a checkpoint | the failure (`srun_failure_line`) | never |

Only the ranks' own line in this allocation's log (`STOPPED_WITH_CHECKPOINT`) counts as a stop with a checkpoint,
so a run that fails after the warning is never requeued (it would fail again, allocation after allocation).
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Optional

from megatron_rl.config import load_config
from megatron_rl.controller.rank import rank_role
from megatron_rl.launch.failures import srun_failure_line
from megatron_rl.launch.signals import STOPPED_WITH_CHECKPOINT

REQUEUE_ENV = "MEGATRON_RL_REQUEUE"  # "0": a stop before the time limit is not requeued (read by the recipes)
REASONS = ("timelimit", "cancel")  # why the batch shell stopped the run: SLURM's warning signal, or a cancel
REQUEUE_EXIT = 3  # `failure-line`'s exit status when the recipe should requeue the job


def stop_in_log(torchrun_log: Path) -> Optional[str]:
    """The ranks' line for a stop with a checkpoint, as far as "saved", from the allocation's torchrun log; None
    when the run did not stop that way."""
    text = torchrun_log.read_text(errors="replace") if torchrun_log.is_file() else ""
    for line in re.split(r"[\r\n]", text):
        m = STOPPED_WITH_CHECKPOINT.match(line)
        if m:
            return m.group(0)
    return None


def _role(run_dir: Path, rank: int) -> str:
    """A rank's role in the run, from the config.yaml in its run directory (for the line; it may raise)."""
    return rank_role(load_config(run_dir / "config.yaml", []), rank)


def allocation_end(run_dir: Path, torchrun_log: Path, rc: int, stopped_for: Optional[str], requeue: bool,
                   job_id: str) -> tuple[str, bool]:
    """(the recipe's one line, whether to requeue the job) when srun ended with `rc` != 0, after the batch shell
    forwarded a stop for `stopped_for` (one of `REASONS`; None when it forwarded none)."""
    if stopped_for is not None and stopped_for not in REASONS:
        raise ValueError(f"--stopped-for {stopped_for!r} is not one of {', '.join(REASONS)}")
    stop = stop_in_log(Path(torchrun_log)) if stopped_for else None
    if stop is None:
        line = srun_failure_line(Path(run_dir), Path(torchrun_log), rc, partial(_role, Path(run_dir)))
        return line + ("; not requeued" if stopped_for == "timelimit" else ""), False
    if stopped_for == "cancel":
        return f"{stop}; cancelled: not requeued (submit the same command to resume)", False
    if not requeue:
        return (f"{stop}; the time limit is near and requeueing is off ({REQUEUE_ENV}=0): submit the same command "
                f"to resume"), False
    return f"{stop}; the time limit is near: job {job_id} requeued, its next allocation resumes the run", True
