"""Progress of a long check on stderr: a line per stage of the work, and at most every few seconds within one."""

from __future__ import annotations

import sys
import time

PROGRESS_EVERY_S = 5.0


class Progress:
    """A line on stderr per stage of the work, and at most every few seconds within one."""

    def __init__(self, prog: str, out=None):
        self.prog, self.out = prog, out if out is not None else sys.stderr
        self.start = time.perf_counter()
        self.what, self.total, self.done, self.last = "", 0, 0, 0.0

    def begin(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self._say(f"{what} ({total} stage{'s' if total != 1 else ''})")

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self._say(f"{self.what}: {self.done}/{self.total}")

    def _say(self, text: str) -> None:
        self.last = time.perf_counter()
        print(f"{self.prog}: {text} [{self.last - self.start:.0f} s]", file=self.out, flush=True)
