"""The log file that a pool's worker processes write to (a job's `workers.log` in its run directory): each worker's
standard output and error pointed at it (`write_to_log`), and the file kept bounded (`bound_log`)."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

LOG_MAX_BYTES = 256 << 20  # a workers' log past this is emptied before the next batch (`WorkerPool.log_max_bytes`)


def bound_log(path: Optional[str], max_bytes: int) -> None:
    """Keep a workers' log (appended to by every worker of every pool that shares it) under about `max_bytes` plus a
    batch's output: past it, the file is emptied, and a line says so. Its writers append (O_APPEND), so they go on
    at the new end. A function that prints on every call would otherwise fill the run's disk."""
    if path is None:
        return
    try:
        if os.path.getsize(path) <= max_bytes:
            return
        with open(path, "r+") as f:
            f.truncate(0)
            f.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} emptied: over {max_bytes} bytes of the workers' "
                    f"output (the newest follows)\n")
    except OSError:
        return


def write_to_log(path: str, label: str) -> None:
    """Point this process's standard output and error (file descriptors 1 and 2, so the C libraries' writes too) at
    `path`, appended, one line at a time, after a line naming the process: a worker's prints, warnings and
    tracebacks go to the run's log, not the job's console."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)  # a line in one write: workers share it
    print(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} worker {os.getpid()} of {label} started", flush=True)
