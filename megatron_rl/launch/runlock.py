"""One job per run directory: an advisory lock file naming its holder.

`RUN_DIR/megatron-rl.lock` holds the holder's host, pid and start time as JSON, and the holder keeps an exclusive
`flock` on it while it runs. The kernel drops that lock when the holder ends in any way (SIGKILL included), so a
file left behind by a dead holder is stale: the next job takes it over with a warning. Where the file system has
no `flock` (some network mounts), a file whose holder runs on this host under a pid that no longer exists is stale;
a holder on another host is then trusted to be alive.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

LOCK_FILE = "megatron-rl.lock"


class RunDirLocked(RuntimeError):
    """Another job holds the run directory (the message is the one line the user sees)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = self._flock(fd)
                holder = self._read(fd)
                if locked is False or (locked is None and self._held_elsewhere(holder)):
                    raise RunDirLocked(f"{self.path.parent} is in use by another megatron-rl job: "
                                       f"{_describe(holder)}; wait for it to end, or use another run.name")
                if not self._same_file(fd):  # the holder removed the file while we opened it: start over
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            break
        if holder:
            self.warn(f"taking over the stale lock of {_describe(holder)}: that job is no longer running")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

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
    def _flock(fd: int) -> Optional[bool]:
        """True: we hold it; False: another process does; None: this file system cannot tell."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            return None

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
        return isinstance(holder.get("pid"), int) and _pid_alive(holder["pid"]) and holder["pid"] != os.getpid()

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
