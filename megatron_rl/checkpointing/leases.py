"""Readers of a run's checkpoints and its retention: a step is not removed while another process reads it.

A reader (`eval`, `inspect`, `convert --to hf`, `plan --checkpoint`, a job whose `model.checkpoint` is another run's)
takes a lease on the step it reads: a file `ROOT/.readers/<step>.<host>.<pid>.<random>` naming the step, its host, pid
and start time, on which it holds an exclusive `flock` for as long as it reads. Retention
(`TrainCheckpointer._prune`) keeps a step with a live lease and removes it at a later prune, once the lease is gone.

A lease is live while its flock is held. The kernel drops the flock when the reader ends in any way (SIGKILL
included), so a lease whose flock retention can take is stale, and is removed. Where the file system has no `flock`
(some network mounts), a lease is stale when its reader ran on this host and no longer runs, by pid and start time (a
reused pid does not pass for it: `launch/lifeline.py: Owner`); a reader on another host is then trusted to be alive
(the rules and the process identity of the run lock, `launch/runlock.py`).

A save that repeats a step (a resume from an older checkpoint) replaces that step's directory only when no lease
holds it (`unread`): it waits for the reader, as retention does, but cannot go on without the replacement.

Resolving a step (`latest`) and taking its lease is one step for retention: both sides hold a short exclusive flock
on `ROOT/.readers.lock`, the reader while it resolves the step and creates its lease, retention while it reads the
leases and renames the steps it removes to hidden names (`layout.retire`; the files are deleted after the lock is
released). A reader that cannot create its lease (a read-only directory, no permission) reads without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from megatron_rl.launch.lifeline import Owner
from megatron_rl.launch.runlock import try_flock

READERS_DIR = ".readers"
READERS_LOCK = ".readers.lock"


@contextlib.contextmanager
def readers_lock(root: Path) -> Iterator[None]:
    """Hold `ROOT/.readers.lock` (exclusive, blocking; held for milliseconds by either side). Without one (a
    read-only directory, a file system without flock) the body runs unlocked."""
    try:
        fd = os.open(Path(root) / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # read-only, no permission, full
        yield
        return
    try:
        try_flock(fd, blocking=True)
        yield
    finally:
        os.close(fd)  # drops the flock


class Lease:
    """A reader's lease on checkpoint directory `path` (`with lease as path:` reads it; leaving releases it).
    `file` is None where none could be taken (a checkpoint outside a run, or a directory this reader cannot write)."""

    def __init__(self, path: Path, file: Optional[Path] = None, fd: Optional[int] = None):
        self.path, self.file, self._fd = Path(path), file, fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.unlink()
        os.close(self._fd)  # drops the flock
        self._fd = None

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        self.release()


def take(root: Path, resolve: Callable[[], Path]) -> Lease:
    """Under the readers' lock: `resolve()` the step of run `root` to read (it raises what it raises), then create
    and flock its lease. Returns the held Lease (without a file where this process cannot write one)."""
    root = Path(root)
    with readers_lock(root):
        step = Path(resolve())
        owner = Owner.this_process()
        me = {"step": step.name, "host": socket.gethostname(), "pid": owner.pid, "started": owner.started}
        file = root / READERS_DIR / f"{step.name}.{me['host']}.{me['pid']}.{secrets.token_hex(4)}"
        try:
            file.parent.mkdir(exist_ok=True)
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:  # read-only, no permission, full: read without a lease
            return Lease(step)
        try:
            try_flock(fd)  # a new file: ours, or no flock here (then host and pid decide)
            os.write(fd, (json.dumps(me) + "\n").encode())
        except BaseException:
            os.close(fd)
            raise
        return Lease(step, file, fd)


def _stale(fd: int, holder: dict) -> bool:
    locked = try_flock(fd)
    if locked is not None:
        return locked  # we could take the flock: its reader has ended
    if holder.get("host") != socket.gethostname():
        return False
    return not Owner.recorded_alive(holder.get("pid"), holder.get("started"))


def leased_steps(root: Path) -> set[str]:
    """The names of the steps of run `root` that live leases hold; stale leases are removed. Call it under
    `readers_lock(root)`, so that no lease is being created meanwhile."""
    leased = set()
    for file in sorted((Path(root) / READERS_DIR).glob("*")):
        try:
            fd = os.open(file, os.O_RDWR)
        except OSError:
            continue  # released meanwhile
        try:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode(errors="replace") or "{}")
            except ValueError:
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            if _stale(fd, holder):
                with contextlib.suppress(OSError):
                    file.unlink()
            else:
                leased.add(holder.get("step") or file.name.split(".")[0])
        finally:
            os.close(fd)
    return leased


@contextlib.contextmanager
def unread(root: Path, step: str, waiting: Optional[Callable[[], None]] = None,
           poll_s: float = 0.5) -> Iterator[None]:
    """Hold `readers_lock(root)` at a moment when no live lease holds step `step` (a step directory's name): the
    body may replace or remove that step, and no reader takes a lease on it meanwhile. While a reader holds one,
    wait with the lock released, polling every `poll_s` seconds (`waiting()` called once, when the wait begins): a
    reader that resolved the step opens its files by path, and would mix two saves' files if the step were replaced
    under it."""
    told = False
    while True:
        with readers_lock(root):
            if step not in leased_steps(root):
                yield
                return
        if not told and waiting is not None:
            waiting()
            told = True
        time.sleep(poll_s)
