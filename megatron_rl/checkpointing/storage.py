"""The checkpoint directory's filesystem: what to say when it refuses a save, and whether the saves will fit.

A save can fail for the machine's reasons, not the job's: the disk or quota is full, the filesystem went read-only,
permissions changed, the directory was unmounted or deleted. Megatron-Core's writers report such an error from their
own processes, as a log record and a `CheckpointException` whose message holds no cause. `diagnose` finds the cause
(an OSError in the exception's chain, else a small probe write into the directory) and words it in one line with
what to do; `storage_fault_line` makes that the one line the job ends with, naming the checkpoint kept. (The
`step_*.tmp` directories of saves that did not finish, which would otherwise hold the space the next save needs, are
removed by `layout.remove_unfinished`.) `space_warning` compares a checkpoint's estimated size with the free space
before the first save. `human_bytes` is the package's one way to print a size.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

from megatron_rl.checkpointing.layout import read_latest

_WHAT_TO_DO = {
    errno.ENOSPC: "no space left on the device{free}: free space there, or set checkpoint.dir to a larger "
                  "filesystem, then relaunch to resume",
    errno.EDQUOT: "disk quota exceeded{free}: free space within the quota, or set checkpoint.dir elsewhere, then "
                  "relaunch to resume",
    errno.EROFS: "the filesystem is read-only: remount it writable, or set checkpoint.dir to a writable one",
    errno.EACCES: "permission denied: make it writable for this user, or set checkpoint.dir elsewhere",
    errno.EPERM: "operation not permitted: make it writable for this user, or set checkpoint.dir elsewhere",
    errno.ENOENT: "the directory vanished during the save (deleted or unmounted?): restore it, or set "
                  "checkpoint.dir elsewhere",
}


def human_bytes(n: float) -> str:
    """`n` bytes for a person: "512 B", "1.5 KiB", ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _errno_in(exc: BaseException) -> Optional[int]:
    """The first storage errno in `exc`, its causes and context, and (torch's CheckpointException) its per-rank
    failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _WHAT_TO_DO:
            return e.errno
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch's: rank -> (exception, stack summary)
            for f in failures.values():
                todo.extend(x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException))
        todo.extend([e.__cause__, e.__context__])
    return None


def _probe(root: Path) -> Optional[int]:
    """Write and remove a 64 KiB file in `root` (or find it gone): the errno the filesystem answers, None if it
    took the write."""
    if not root.is_dir():
        return errno.ENOENT
    probe = root / f".megatron-rl-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e.errno
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def diagnose(root: Path, exc: BaseException) -> Optional[str]:
    """The storage fault behind a failed save into `root`, in words with what to do; None when the filesystem is
    not the cause."""
    code = _errno_in(exc)
    if code is None and (isinstance(exc, (OSError, RuntimeError)) or "Checkpoint" in type(exc).__name__):
        # No errno in the error (a writer process's, a C++ stream's): ask the filesystem. Only for errors that a
        # write can raise: a bug before the first write is not a storage fault (the root may not exist yet).
        code = _probe(root)
    if code not in _WHAT_TO_DO:
        return None
    free = ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({human_bytes(shutil.disk_usage(root).free)} free)"
        except OSError:
            pass
    return _WHAT_TO_DO[code].format(free=free)


def storage_fault_line(root: Path, what: str, problem: str) -> str:
    """The one line for a storage fault under a run's checkpoint root: what failed, the diagnosis (`diagnose`),
    and the checkpoint a relaunch resumes from."""
    latest = read_latest(Path(root))
    kept = f"the last complete checkpoint, {latest.name}, is kept" if latest else "no checkpoint was saved"
    return f"{root}: {what}: {problem}; {kept}"


def estimate_checkpoint_bytes(num_params: int, param_bytes: int, with_reference: bool) -> int:
    """A training checkpoint's size: the weights in their dtype, then the optimizer's state as the distributed
    optimizer saves it, Adam's two fp32 moments and an fp32 copy of the weights (saved with fp32 weights too); the KL
    reference model's weights when the run has one."""
    return num_params * (param_bytes + 12 + (param_bytes if with_reference else 0))


def space_warning(root: Path, checkpoint_bytes: int, keep_last: int, present: int) -> Optional[str]:
    """A warning when `root`'s free space cannot hold the next save next to the `keep_last` checkpoints kept (the
    oldest is only deleted after the next one is complete), counting the `present` complete ones already there.
    None when it fits (or the directory cannot be measured)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    need = checkpoint_bytes * max(keep_last + 1 - present, 1)
    if free >= need:
        return None
    return (f"{root} has {human_bytes(free)} free, but a checkpoint takes about {human_bytes(checkpoint_bytes)} and "
            f"checkpoint.keep_last={keep_last} keeps {keep_last} next to the one being written: about "
            f"{human_bytes(need)} more is needed; a save will fail when the disk is full")
