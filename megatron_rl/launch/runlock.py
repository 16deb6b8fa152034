"""One job per run directory: an advisory lock file naming its holder.

`RUN_DIR/megatron-rl.lock` holds the holder's host, pid and start time as JSON, and the holder keeps an exclusive
`flock` on it while it runs. Once the holder has started its job's processes (the local launcher's ranks), it
records them there too (`RunLock.record`: pid and start time of each). The kernel drops the flock when the holder
ends in any way (SIGKILL included), so a file left behind by a dead holder is stale, and the next job takes it
over, with a line saying what it checked, but only once no process the file names still runs on this host: ranks
end with their launcher (`launch/lifeline.py`), and a rank that has not ended yet (frozen, or in an uninterruptible
write) would otherwise write the same run directory as the new job. Where the file system has no `flock` (some
network mounts), a file whose holder on this host no longer runs (by pid and start time, `lifeline.Owner`: a reused
pid does not pass for it) is stale; a holder on another host is then trusted to be alive.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional, Sequence


from megatron_rl.launch.lifeline import Owner

LOCK_FILE = "megatron-rl.lock"


class RunDirLocked(RuntimeError):
    """Another job holds the run directory (the message is the one line the user sees)."""


def try_flock(fd: int, blocking: bool = False) -> Optional[bool]:
    """An exclusive `flock` on `fd`. True: this open file holds it; False: another open file does; None: this file
    system cannot tell (some network mounts). The kernel drops it when its holder ends in any way."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def _still_running(holder: dict) -> list[int]:
    """The pids of the processes that `holder` records (`RunLock.record`) that still run on this host, named by pid
    and start time so that a reused pid does not count (a zombie, ended but not reaped, does not either)."""
    if holder.get("host") != socket.gethostname():
        return []
    return [entry["pid"] for entry in holder.get("processes") or [] if isinstance(entry, dict) and "started" in entry
            and Owner.recorded_alive(entry.get("pid"), entry["started"])]


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
            f"(started {holder.get('started', '?')})")


class RunLock:
    """`with RunLock(run_dir, warn):` holds the run directory for this process; raises RunDirLocked when another
    job holds it. `warn(text)` prints the take-over of a stale lock."""

    def __init__(self, run_dir: Path, warn: Optional[Callable[[str], None]] = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.warn = warn or (lambda text: None)
        self._fd: Optional[int] = None
        self._me: dict = {}

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = try_flock(fd)
                holder = self._read(fd)
                if locked is False or (locked is None and self._held_elsewhere(holder)):
                    raise RunDirLocked(f"{self.path.parent} is in use by another megatron-rl job: "
                                       f"{_describe(holder)}; wait for it to end, or use another run.name")
                if not self._same_file(fd):  # the holder removed the file while we opened it: start over
                    os.close(fd)
                    continue
                running = _still_running(holder)
                if running:
                    pids = " ".join(map(str, running))
                    raise RunDirLocked(f"{self.path.parent} is still written by a megatron-rl job whose launcher has "
                                       f"ended: {_describe(holder)} left processes {pids} running; end them (kill "
                                       f"-9 {pids}) or wait for them, or use another run.name")
            except BaseException:
                os.close(fd)
                raise
            break
        if holder:
            self.warn(f"taking over the stale lock of {_describe(holder)}: {self._checked(holder)}")
        me = Owner.this_process()
        self._me = {"host": socket.gethostname(), "pid": me.pid, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "process_started": me.started}  # the process's identity with its pid (`Owner`)
        self._fd = fd
        self._write(self._me)

    def record(self, pids: Sequence[int]) -> None:
        """Name the job's processes (`pids`, on this host) in the lock file, beside its holder: a later job takes
        the lock over only once none of them runs. A process already gone is left out."""
        owners = [Owner.of(pid) for pid in pids]
        self._write({**self._me, "processes": [{"pid": o.pid, "started": o.started} for o in owners if o is not None]})

    def _write(self, holder: dict) -> None:
        assert self._fd is not None, "the lock is not held"
        text = (json.dumps(holder) + "\n").encode()
        os.pwrite(self._fd, text, 0)
        os.ftruncate(self._fd, len(text))
        os.fsync(self._fd)

    @staticmethod
    def _checked(holder: dict) -> str:
        """What was checked before a stale lock is taken over, for its line."""
        if holder.get("host") != socket.gethostname():
            return (f"it no longer holds the file's lock; its processes on host {holder.get('host', '?')} cannot be "
                    f"seen from here")
        n = len(holder.get("processes") or [])
        return (f"that job is no longer running (its launcher and the {n} process{'es' if n != 1 else ''} it "
                f"started have ended)" if n else "that job is no longer running")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if self._same_file(self._fd):
                self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            holder = json.loads(text) if text.strip() else {}
        except ValueError:
            holder = {"pid": "?", "host": "?", "started": "?"}
        return holder if isinstance(holder, dict) else {}

    @staticmethod
    def _held_elsewhere(holder: dict) -> bool:
        if not holder:
            return False
        if holder.get("host") != socket.gethostname():
            return True
        return holder.get("pid") != os.getpid() and Owner.recorded_alive(holder.get("pid"),
                                                                          holder.get("process_started"))

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
