"""Ending a command's process without the interpreter's teardown.

A process that imported torch (and, for the launcher's plot, matplotlib) spends 1.2-1.8 s after its last line
finalizing modules on this project's 2-core test machine: every `megatron-rl train`, `eval` or `convert` paid it
after its summary was printed, and the test suite runs about a hundred of them. `exit_without_teardown` does first
what a normal exit does that anyone could observe (non-daemon threads joined, atexit handlers run, among them
multiprocessing's finalizers, standard streams flushed) and then skips the rest with `os._exit`.

What it would lose is a file object left open with bytes in its buffer, which only the teardown's garbage collection
would flush. So only a process that runs no rank itself ends this way (the local launcher, eval's and convert's
parents, plan, inspect), not a rank of a torchrun/srun world, whose metrics and checkpoints are written in-process.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with `code` after joining non-daemon threads, running atexit handlers and flushing stdout/stderr."""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)
