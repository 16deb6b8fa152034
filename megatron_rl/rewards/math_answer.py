"""MATH verifier: the last `\\boxed{}` of a response against the reference answer.

Two stages, so that sympy never runs in the controller process:
1. here, in plain Python: normalise both answers and compare them as strings, or as exact numbers when both are
   plain numbers (`0.15` vs `\\frac{3}{20}`). This decides most responses, right or wrong;
2. the rest (`3\\sqrt{13}` vs `\\sqrt{117}`, tuples, intervals, polynomials) goes to
   `symbolic.answers_equivalent` in a worker pool, each check under `timeout_s`. A check that times out or fails
   scores 0.0 and is logged; the worker is replaced and the run goes on.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from megatron_rl.rewards.base import RewardFunction, RewardItem
from megatron_rl.rewards.latex import canonical, last_boxed, quick_equal
from megatron_rl.sandbox import WorkerPool

log = logging.getLogger(__name__)

SYMBOLIC_SPEC = "megatron_rl.rewards.symbolic:answers_equivalent"


def reference_answer(reference: str) -> str:
    """The answer part of a reference: its last boxed content if it is a full solution, else the text itself."""
    boxed = last_boxed(reference)
    return boxed if boxed is not None else reference


class MathReward(RewardFunction):
    """1.0 if the response's last boxed answer is equivalent to the reference, else 0.0.

    The worker pool starts on the first answer that needs sympy (a second or so: workers import sympy), and lives
    until `close()`. With `symbolic=False` only stage 1 runs (no processes at all). `checker` replaces the
    stage-2 function (`module:function` taking two answer strings, returning a bool), e.g. to use another library.
    """

    name = "math"

    def __init__(self, timeout_s: float = 5.0, num_workers: int = 1, symbolic: bool = True,
                 start_method: Optional[str] = None, checker: str = SYMBOLIC_SPEC, log_path: Optional[str] = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.symbolic = symbolic
        self.start_method = start_method
        self.checker = checker
        self.log_path = log_path  # where the checker's workers write (`WorkerPool`)
        self._pool: Optional[WorkerPool] = None

    def _workers(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool(self.checker, num_workers=self.num_workers, timeout_s=self.timeout_s,
                                    start_method=self.start_method, log_path=self.log_path,
                                    label=f"math checker {self.checker!r}")
        return self._pool

    def equivalent(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Are these (answer, reference answer) pairs equivalent? Answers are boxed contents, not responses."""
        out: list[Optional[bool]] = [quick_equal(p, r) for p, r in pairs]
        undecided: dict[tuple[str, str], list[int]] = {}
        for k, (decided, (p, r)) in enumerate(zip(out, pairs)):
            if decided is None:
                undecided.setdefault((canonical(p), canonical(r)), []).append(k)
        if undecided and self.symbolic:
            # One check per distinct pair: samples of one prompt often repeat the same answer.
            keys = list(undecided)
            first = [undecided[key][0] for key in keys]
            outcomes = self._workers().map([pairs[k] for k in first])
            for key, outcome in zip(keys, outcomes):
                if outcome.ok:
                    value = outcome.value is True
                else:
                    p, r = pairs[undecided[key][0]]
                    log.warning("MATH symbolic check of %.200r against %.200r failed (%s); scored 0.0",
                                p, r, outcome.error)
                    value = False
                for k in undecided[key]:
                    out[k] = value
        return [bool(v) for v in out]

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        scores = [0.0] * len(items)
        pairs, where = [], []
        for k, (_, response, reference, *_) in enumerate(items):
            if reference is None:
                log.warning("MATH verifier got no reference answer; scored 0.0")
                continue
            pred = last_boxed(response)
            if pred is None:
                continue
            pairs.append((pred, reference_answer(reference)))
            where.append(k)
        for k, ok in zip(where, self.equivalent(pairs)):
            scores[k] = 1.0 if ok else 0.0
        return scores

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
