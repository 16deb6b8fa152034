"""A rank ends when the process that owns it ends, however that process ends (SIGKILL included).

The owner is the process that started the world: the local launcher (`spawn.run_local`'s caller), or, in a world
that torchrun or srun started, the rank's parent (torchrun's agent, srun's step daemon). When the owner is gone
nobody can stop the rank, report its failure or free its run directory, so the rank ends at once, with everything
it started: it leads a process group of its own (the local launcher's ranks, torchrun's), which is killed whole,
or else its descendants are found and killed one by one before it kills itself.

Why the parent-death signal (PR_SET_PDEATHSIG) is not enough: it fires when the rank's *parent* dies, and a local
launcher's ranks are the children of Python's fork server, not of the launcher. The fork server lives until every
process holding its liveness pipe has ended, and each rank holds one, so a launcher killed by SIGKILL or a closed
terminal left its ranks training to the end of the job, unattended, into the same run directory (issue 53). The
signal stays where the parent is the owner (spawned ranks, `spawn._lead_own_group`): it is immediate.

How the owner is watched: a daemon thread blocks on a pidfd of the owner (Linux 5.3 and later), which wakes it the
moment the owner exits, or polls every `POLL_S` where there is none. The owner is named by pid and start time
(`Owner`), so a pid the system reuses is not mistaken for it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil

POLL_S = 0.2  # where there is no pidfd: how often the owner is looked for


@dataclass(frozen=True)
class Owner:
    """A process, named so that a reused pid does not pass for it: its pid and its start time (psutil's
    `create_time`, seconds since the epoch)."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> Optional["Owner"]:
        """The process `pid` now, or None when there is none."""
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    @classmethod
    def this_process(cls) -> "Owner":
        owner = cls.of(os.getpid())
        assert owner is not None
        return owner

    def alive(self) -> bool:
        """Whether this process still runs (a zombie, ended but not yet reaped by its parent, does not)."""
        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self.started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    @classmethod
    def recorded_alive(cls, pid, started) -> bool:
        """Whether the process a file on this host names (the run lock's holder and processes, a reader's lease)
        still runs: by pid and start time, so that a reused pid does not pass for a dead process; a record written
        without its start time (by an older version) by pid alone."""
        if not isinstance(pid, int) or isinstance(pid, bool):
            return False
        try:
            started = float(started)
        except (TypeError, ValueError):
            return pid_alive(pid)
        return cls(pid, started).alive()


def pid_alive(pid: int) -> bool:
    """Does a process `pid` exist on this host (one we may not signal counts)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(owner: Owner, on_gone: Callable[[], None]) -> threading.Thread:
    """Call `on_gone()` from a daemon thread as soon as `owner` has ended (at once when it already has). Started
    before the rank starts threads or processes of its own."""
    thread = threading.Thread(target=_wait_then, args=(owner, on_gone), name="megatron-rl-lifeline", daemon=True)
    thread.start()
    return thread


def watch_parent(on_gone: Callable[[], None]) -> threading.Thread:
    """`watch` this process's parent: a launched rank's owner (torchrun's agent, srun's step daemon)."""
    parent = Owner.of(os.getppid())
    return watch(parent if parent is not None else Owner(os.getppid(), -1.0), on_gone)  # (-1: gone already)


def _wait_then(owner: Owner, on_gone: Callable[[], None]) -> None:
    fd = _pidfd(owner)
    if fd is not None:
        select.select([fd], [], [])  # readable once the owner has exited; blocks without holding the GIL
    else:
        while owner.alive():
            time.sleep(POLL_S)
    on_gone()


def _pidfd(owner: Owner) -> Optional[int]:
    """A pidfd of `owner`, or None where the platform has none or the owner has already gone (the caller then
    finds it gone at its first look)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(owner.pid)
    except OSError:  # ProcessLookupError: gone already; ENOSYS and the like: no pidfds here
        return None
    if not owner.alive():  # the pid was the owner's when we were started; checked again now that it is held
        os.close(fd)
        return None
    return fd


def end_this_rank(line: str = "") -> None:
    """End this process and every process it started, with SIGKILL: its whole process group where it leads one
    (the local launcher's ranks and torchrun's do), else its descendants and then itself. `line`, where given,
    is printed first (an output that is gone with the owner is no reason not to end)."""
    if line:
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        descendants = []
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
