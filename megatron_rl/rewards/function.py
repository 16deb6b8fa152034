"""User reward functions, given as `module:function` (or `path/to/file.py:function`).

The function has the signature `fn(prompt: str, response: str, reference: str | None) -> float`. It runs in a pool
of worker processes, never in the controller: a call that hangs past `timeout_s`, raises, kills its process or
returns something that is not a finite number scores 0.0 and is logged, and the run goes on. A spec that cannot be
imported fails at construction with one clear line (RewardFunctionError).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

from megatron_rl.rewards.base import RewardFunction, RewardItem
from megatron_rl.rewards.workers import WorkerPool

log = logging.getLogger(__name__)


def _as_float(value) -> Optional[float]:
    """A finite float from a number-like result (int, float, bool, numpy or torch scalar); None otherwise."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


class FunctionReward(RewardFunction):
    name = "function"

    def __init__(self, spec: str, timeout_s: float = 5.0, num_workers: int = 1, start_method: Optional[str] = None):
        self.spec = spec
        self._pool = WorkerPool(spec, num_workers=num_workers, timeout_s=timeout_s, start_method=start_method)

    @property
    def stats(self) -> dict:
        """Counts of calls, errors, timeouts, crashes and worker restarts (for metrics)."""
        return dict(self._pool.stats)

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        outcomes = self._pool.map([(p, r, ref) for p, r, ref in items])
        scores = []
        for k, outcome in enumerate(outcomes):
            if not outcome.ok:
                log.warning("reward function %s failed on item %d (%s); scored 0.0", self.spec, k, outcome.error)
                scores.append(0.0)
                continue
            value = _as_float(outcome.value)
            if value is not None:
                scores.append(value)
            else:
                log.warning("reward function %s returned %.100r on item %d, not a finite number; scored 0.0",
                            self.spec, outcome.value, k)
                scores.append(0.0)
        return scores

    def close(self) -> None:
        self._pool.close()
