"""How a job that ended without finishing is told: one line naming the rank that most likely caused it, and every
failed rank's cause and traceback in `failure.log` in the run directory.

    RankFailure        one rank that ended without a result: its cause in one line, and its traceback
    RanksFailed        the ranks of a `spawn.run_local` world that failed, the likely cause first
    JobFailed          the job's end as the user sees it: the one line, and the command's exit code
    ranks_failed       the local launcher's report, once every rank has ended
    rank_failed        the report of one rank of a torchrun/srun world, about itself
    srun_failure_line  the SLURM recipes' line when srun ended with an error (`launch/slurm/*.sbatch`)

The likely cause is a rank that ended without a word (killed, hung, its interpreter died), else the first to
report an error that is not a peer's failure: a rank whose peer failed gets a lost connection or a timeout, which
names the victim, not the cause. Each rank's role (trainer, generator, reward model) comes from the job's
configuration, which sits above this package: the callers pass it in as `role(rank)`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_rl.launch import signals

FAILURE_LOG = "failure.log"

# Errors a rank gets because a peer failed: they name the victim, not the cause.
_PEER_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "Timed out", "NCCL",
                # torch's checkpoint save failed, and the rank could not say why: the rank that found the cause (a
                # full disk: `checkpointing/storage.py`) raises CheckpointError, and it names the fault
                "CheckpointException ranks:")

KILLED_AFTER = "killed by the launcher after another rank failed"
HUNG = "hung: still running when the other ranks gave up waiting for it"


class JobFailed(RuntimeError):
    """The job ended without finishing: `str(e)` is the one line the user sees, `exit_code` the command's."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line)
        self.exit_code = exit_code


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended without a result: `cause` in one line ("ValueError: ...", "died with signal 9"), and
    `report`, its full traceback (or the cause)."""

    rank: int
    cause: str
    report: str


class RanksFailed(RuntimeError):
    """Ranks of a `run_local` world ended without a result. `failures`: the likely cause first (a rank that died
    without a word, else the first to report an error that is not a peer's failure), then the others in the order
    they were found. `signal`: the stop signal the launcher had forwarded (0 for none); `killed`: why the launcher
    killed the ranks ("grace": the grace time was over; "twice": a second SIGINT), "" when it did not."""

    def __init__(self, failures: list[RankFailure], world_size: int, signal: int = 0, killed: str = ""):
        self.failures, self.world_size, self.signal, self.killed = failures, world_size, signal, killed
        text = "\n".join(f"--- rank {f.rank} ---\n{f.report}" for f in sorted(failures, key=lambda f: f.rank))
        super().__init__(f"{len(failures)} of {world_size} ranks failed:\n{text}")

    @property
    def first(self) -> RankFailure:
        return self.failures[0]


def cause_of(exc: BaseException) -> str:
    """One line for an exception: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def death(exitcode: Optional[int]) -> str:
    """The cause of a rank whose process ended (`exitcode`, multiprocessing's) without reporting."""
    if exitcode is not None and exitcode < 0:
        return f"died with signal {-exitcode} ({signal.Signals(-exitcode).name})" \
            if -exitcode in signal.valid_signals() else f"died with signal {-exitcode}"
    return f"exited with code {exitcode} without a result"


def is_peer_error(cause: str) -> bool:
    return any(marker in cause for marker in _PEER_ERRORS)


def likely_cause_first(failures: list[RankFailure]) -> list[RankFailure]:
    """`failures` ordered by how likely each caused the others: a rank that ended without reporting, then one that
    reported its own error, then one that reported a peer's failure, then one the launcher killed afterwards."""
    def rank_of(f: RankFailure) -> int:
        if f.cause == KILLED_AFTER:  # the launcher ended it because another rank had failed
            return 3
        if f.report == f.cause:  # ended without reporting: killed, hung, or the interpreter died
            return 0
        return 2 if is_peer_error(f.cause) else 1

    return sorted(failures, key=rank_of)  # stable: the order found within each class


def write_failure_log(run_dir: Path, text: str, append: bool = False) -> str:
    """Write failure.log in the run directory; where that cannot be written (a full disk, a read-only or vanished
    directory), in the system's temporary directory. Returns the words for the failure line: "every rank's
    traceback: PATH", saying so when the run directory refused it."""
    import tempfile

    log = run_dir / FAILURE_LOG
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(log, "a" if append else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return f"every rank's traceback: {log}"
    except OSError as e:
        fd, spare = tempfile.mkstemp(prefix="megatron-rl-failure-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return f"every rank's traceback: {spare} ({log} could not be written: {os.strerror(e.errno or 0)})"


def _blocks(failures: list[RankFailure], role: Callable[[int], str]) -> str:
    """failure.log's part for `failures`: each rank's role, cause and traceback."""
    return "".join(f"\n--- rank {f.rank} ({role(f.rank)}): {f.cause} ---\n{f.report}\n" for f in failures)


def _line(failure: RankFailure, role: Callable[[int], str]) -> str:
    what = failure.cause if failure.cause.startswith(("died", "exited", "hung")) else f"failed: {failure.cause}"
    return f"megatron-rl: rank {failure.rank} ({role(failure.rank)}) {what}"


def _stamp() -> str:
    return time.strftime('%Y-%m-%dT%H:%M:%S%z')


def ranks_failed(e: RanksFailed, run_dir: Path, role: Callable[[int], str], stop_grace_s: float,
                 latest: str) -> JobFailed:
    """The local launcher's report, once every rank has ended (`e` holds them all, likely cause first): failure.log
    holds every failed rank's cause and traceback, and the line names the rank that most likely caused the failure
    and where the tracebacks are. A forwarded stop whose ranks had to be killed says so instead, with `latest` (the
    newest checkpoint, in words: "latest checkpoint step_...", "no checkpoint saved")."""
    stamp = _stamp()
    line = _line(e.first, role) if e.failures else ""
    where = write_failure_log(run_dir, f"megatron-rl train, {stamp}: {len(e.failures)} of {e.world_size} ranks "
                                       f"ended without a result (likely cause first)\n{_blocks(e.failures, role)}")
    if e.killed:
        how = "at a second SIGINT" if e.killed == "twice" else f"run.stop_grace_s={stop_grace_s:g} s after it"
        return JobFailed(f"megatron-rl: stopped by {signals.name(e.signal)}: ranks killed {how}; "
                         f"{latest}; relaunch to resume", signals.exit_code(e.signal))
    line = f"{line}; {where}"
    if e.signal:
        line = f"megatron-rl: stopped by {signals.name(e.signal)}: {line.removeprefix('megatron-rl: ')}"
    return JobFailed(line, signals.exit_code(e.signal) if e.signal else 1)


def rank_failed(failure: RankFailure, world_size: int, run_dir: Path, role: Callable[[int], str]) -> JobFailed:
    """The report of one rank of a launched world, about itself only: it appends to the failure.log its failing
    peers share, its line first (the SLURM recipe prints the first such line: `srun_failure_line`). The line is
    empty when its error only reports a failed peer, whose own report says the cause."""
    line = "" if is_peer_error(failure.cause) else _line(failure, role)
    where = write_failure_log(run_dir, (f"{line}\n" if line else "") + f"megatron-rl train, {_stamp()}: rank "
                              f"{failure.rank} of {world_size} ended without a result\n{_blocks([failure], role)}",
                              append=True)
    return JobFailed(f"{line}; {where}" if line else "", 1)


# A rank's end in torchrun's own log ("rank      : 1 (local_rank: 1)" then "exitcode  : -9").
_TORCHRUN_RANK_END = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)")


def srun_failure_line(run_dir: Path, torchrun_log: Path, rc: int, role: Callable[[int], str]) -> str:
    """The one line a SLURM recipe prints when srun ended with `rc` != 0 (`launch/slurm/*.sbatch`): the failing
    rank's own line (the first `megatron-rl:` line in failure.log: a rank that raised, or the watcher of a hung
    rank), else a stop's line from the ranks' output, else the rank torchrun found dead (a signal before an exit
    code, with its `role` where that can be told), else srun's exit code; with where the reports are."""
    log_words = f"torchrun's report: {torchrun_log}"
    failure = run_dir / FAILURE_LOG
    if failure.is_file():
        for line in failure.read_text(errors="replace").splitlines():
            if line.startswith("megatron-rl: "):
                return f"{line}; every rank's traceback: {failure}; {log_words}"
    text = torchrun_log.read_text(errors="replace") if torchrun_log.is_file() else ""
    for line in re.split(r"[\r\n]", text):
        if line.startswith("megatron-rl: stopped by "):
            return line
    causes = [(int(code), int(rank)) for rank, code in _TORCHRUN_RANK_END.findall(text)]
    if causes:
        code, rank = min(causes, key=lambda c: (c[0] >= 0, causes.index(c)))  # a signal death first
        try:
            role_words = f" ({role(rank)})"
        except Exception:  # noqa: BLE001 - the role only adds to the line
            role_words = ""
        what = (f"died with signal {-code} ({signal.Signals(-code).name})" if code < 0
                else f"exited with code {code}")
        return f"megatron-rl: rank {rank}{role_words} {what}; {log_words}"
    return f"megatron-rl: srun exited with code {rc} before any rank reported; {log_words}"
