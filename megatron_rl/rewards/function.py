"""User reward functions, given as `module:function` (or `path/to/file.py:function`).

The function has the signature `fn(prompt: str, response: str, reference: str | None) -> float`, or takes a fourth
argument, `record`: every field of the prompt record (`PromptRecord.as_dict`: a JSONL record's other fields, such as
test cases, with id, prompt and reference), which it then gets. It runs in a pool
of worker processes, never in the controller, a batch's responses on all workers at once: a call that hangs past
`timeout_s` (or past the batch's `batch_timeout_s`), raises, kills its process or returns something that is not a
finite number is a failure: it scores 0.0, is logged and counted (`failures`, per batch), and the run goes on. A
function that fails on more than half of a batch's responses in MAX_FAILING_BATCHES batches in a row is broken, not
unlucky: `score` raises RewardFailureError, one line, and the run stops. A spec that cannot be imported fails at
construction with one clear line (`sandbox.SpecError`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Optional, Sequence

from megatron_rl.rewards.base import RewardFunction, RewardItem
from megatron_rl.sandbox import MAX_FAILING_BATCHES, FORM, SpecError, WorkerPool, failing_batches, resolve

log = logging.getLogger(__name__)


class RewardFailureError(RuntimeError):
    """The reward function failed on most responses, batch after batch; the message is one line."""


def _as_float(value) -> Optional[float]:
    """A finite float from a number-like result (int, float, bool, numpy or torch scalar); None otherwise."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


def takes_record(fn) -> bool:
    """Does a reward function take the record: a fourth positional parameter, one named `record`, or *args?"""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (len(positional) >= 4 or any(p.name == "record" for p in params)
            or any(p.kind == p.VAR_POSITIONAL for p in params))


class _WithRecord:
    """A user's function called with the record where it takes it, without it where it does not."""

    def __init__(self, fn):
        self.fn, self.takes = fn, takes_record(fn)

    def __call__(self, prompt: str, response: str, reference: Optional[str], record: Optional[dict]):
        return self.fn(prompt, response, reference, record) if self.takes else self.fn(prompt, response, reference)


def with_record(spec: str) -> _WithRecord:
    """What each reward worker runs (`WorkerPool`'s target, with the user's spec): the user's function, imported
    in the worker, called with the record where it takes it. The controller never imports it."""
    return _WithRecord(resolve(spec, "reward function"))


class FunctionReward(RewardFunction):
    name = "function"

    def __init__(self, spec: str, timeout_s: float = 5.0, num_workers: int = 1, start_method: Optional[str] = None,
                 batch_timeout_s: Optional[float] = None, log_path: Optional[str] = None):
        self.spec = spec
        self.log_path = log_path  # where the workers write (`WorkerPool`), named in the failure lines
        if not isinstance(spec, str) or ":" not in spec:  # before any process starts
            raise SpecError.of("reward function", spec, FORM)
        self._pool = WorkerPool(functools.partial(with_record, spec), num_workers=num_workers,
                                timeout_s=timeout_s, start_method=start_method, batch_timeout_s=batch_timeout_s,
                                label=f"reward function {spec!r}", log_path=log_path)
        self.failures = 0  # responses of the last `score` call that failed (scored 0.0)
        self.failing_batches = 0  # batches in a row in which more than half of the responses failed

    @property
    def stats(self) -> dict:
        """Counts of calls, errors, timeouts, crashes and worker restarts (for metrics)."""
        return dict(self._pool.stats)

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        outcomes = self._pool.map([(p, r, ref, rest[0] if rest else None) for p, r, ref, *rest in items])
        scores, errors = [], []
        for outcome in outcomes:
            value = _as_float(outcome.value) if outcome.ok else None
            if value is None:
                error = outcome.error if not outcome.ok else f"returned {outcome.value!r:.100}, not a finite number"
                errors.append((error.splitlines() or [""])[0][:300])
            scores.append(0.0 if value is None else value)
        self.failures = len(errors)
        where = f" (tracebacks and output: {self.log_path})" if self.log_path else ""
        self.failing_batches = failing_batches(
            errors, len(items), self.failing_batches,
            lambda text: log.warning("reward function %s failed on %d of %d responses, scored 0.0%s: %s", self.spec,
                                     len(errors), len(items), where, text))
        if self.failing_batches >= MAX_FAILING_BATCHES:
            raise RewardFailureError(
                f"reward function {self.spec!r} failed on {len(errors)} of {len(items)} responses, and on more than "
                f"half in each of the last {self.failing_batches} batches (last error: {errors[-1]}); stopping: fix "
                f"the function{where}, or raise reward.timeout_s / reward.num_workers")
        return scores

    def close(self) -> None:
        self._pool.close()
