"""The rule that tells a broken piece of user code from an unlucky one, shared by the sandbox's callers (reward
functions, environments, agents): a batch in which more than half of the calls failed counts, and
MAX_FAILING_BATCHES such batches in a row stop the run with one line."""

from __future__ import annotations

import collections
from typing import Callable

MAX_FAILING_BATCHES = 3  # batches in a row with more than half of their calls failing stop the run


def failing_batches(errors: list[str], calls: int, streak: int, warn: Callable[[str], None]) -> int:
    """One batch of `calls` calls, `errors` of which failed (one line each): the failures logged in one line, each
    distinct error once (`warn(text)`), and the new count of batches in a row in which more than half the calls
    failed (`streak` before this one); the caller stops at MAX_FAILING_BATCHES."""
    if errors:
        counts = collections.Counter(errors)
        warn("; ".join(f"{e} (x{n})" if n > 1 else e for e, n in counts.items()))
    return streak + 1 if 2 * len(errors) > calls else 0
