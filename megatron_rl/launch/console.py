"""Standard output and error that outlive the terminal they were written to.

A job started from a terminal keeps writing to it (the banner, rank 0's progress bar, the stop line). When the
terminal goes away (a closed window, a dropped ssh connection), every later write to it fails with EIO; a pipe
whose reader has gone (`megatron-rl train | tail`) fails with EPIPE. A job that stops because of the hang-up
(SIGHUP, `launch/signals.py`) must still reach its checkpoint, so a failed write must not raise in the launcher or
in a rank. `survive_hangup()` wraps this process's `sys.stdout` and `sys.stderr`: the first write or flush that
fails that way points the stream's file descriptor at /dev/null, and from then on what is written, by Python or by
the libraries' C code, is dropped instead of failing. Any other error is raised as before.

`job_log_lines` shows the package's log records in the job's own form (`megatron-rl: ...`); `below_bar` starts a line
where rank 0's progress bar may stand unfinished.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Callable

GONE = (errno.EIO, errno.EPIPE)  # a terminal that hung up; a pipe whose reader ended


class _Survivor:
    """A text stream whose writes survive the end of what it writes to (see the module docstring); everything
    else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._drop_if_gone(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._drop_if_gone(e)

    def _drop_if_gone(self, e: OSError) -> None:
        if e.errno not in GONE:
            raise e
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:
            self._stream.flush()  # what the buffer still holds goes to /dev/null now
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_hangup() -> None:
    """Make this process's standard output and error survive a hung-up terminal or a closed pipe (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Survivor):
            setattr(sys, name, _Survivor(stream))


def below_bar(line: str) -> str:
    """A line printed while rank 0's progress bar may stand unfinished on the console: it replaces the bar on a
    terminal (the bar is drawn again below it) and starts a line of its own in a log."""
    return ("\r\033[K" if sys.stderr.isatty() else "\n") + line


class _JobLines(logging.Handler):
    """The package's log records as the job's own lines: `megatron-rl: <message>`, through `write` (rank 0's
    progress bar, or this process's standard error)."""

    def __init__(self, write: Callable[[str], None]):
        super().__init__(logging.INFO)
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(f"megatron-rl: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a log line never stops the job
            self.handleError(record)


def job_log_lines(write: Callable[[str], None]) -> None:
    """Show the `megatron_rl` loggers' records (warnings of reward functions and environments, ...) as the job's
    own lines, through `write`, instead of Python's bare `WARNING:module:` form or whatever format a library set on
    the root logger (idempotent: the last `write` wins)."""
    logger = logging.getLogger("megatron_rl")
    for h in [h for h in logger.handlers if isinstance(h, _JobLines)]:
        logger.removeHandler(h)
    logger.addHandler(_JobLines(write))
    logger.setLevel(logging.INFO)
    logger.propagate = False
