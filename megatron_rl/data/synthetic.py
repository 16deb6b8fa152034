"""Synthetic arithmetic: problems like "12+7=" with answer "19", generated, never read from files.

Made for the default job, where a tiny byte-level model (vocab 259) must learn something within minutes on a CPU:
prompts are short plain ASCII (at most a dozen bytes) with no instruction and no chat template, and the reward is
exact match of the integer the response starts with (`megatron_rl.rewards.synthetic`).

Difficulty: a level in [0, 1] sets the number of digits per operand and the number of operands; both grow with the
level in equal steps, from (min_digits, min_operands) at 0 to (max_digits, max_operands) at 1. A schedule maps
training steps to levels (`LinearCurriculum`), or the controller can pick levels itself.

Determinism and the held-out split: training problem `index` is a pure function of (seed, index, level), so a run
resumes by remembering an integer. Whether a problem is held out is a pure function of (seed, prompt text) (a
keyed hash), so held-out problems are never trained on, at any level, and the split needs no stored list.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Optional

from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.synthetic import synthetic_reward

_ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are listed exactly when building the held-out set


def evaluate(operands: list[int], operators: list[str]) -> int:
    """The value of o0 op0 o1 op1 o2 ... with the usual precedence (* before + and -)."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _check_level(level: float) -> float:
    level = float(level)
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"difficulty level {level} must be in [0, 1]")
    return level


@dataclass(frozen=True)
class ArithmeticTask:
    """Arithmetic problems "a+b=" -> "a+b" with a difficulty curriculum and a disjoint held-out split.

    operators: the operators to draw from, a subset of "+-*" ("-" can make answers negative).
    heldout_fraction: the share of all problems (at every level) that is reserved for evaluation.
    """

    seed: int = 0
    min_digits: int = 1
    max_digits: int = 3
    min_operands: int = 2
    max_operands: int = 3
    operators: str = "+"
    heldout_fraction: float = 0.1

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators {self.operators!r} must be a non-empty subset of '+-*'")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")

    # ---- difficulty

    def shape(self, level: float) -> tuple[int, int]:
        """(digits per operand, number of operands) at a difficulty level."""
        level = _check_level(level)
        dd = self.max_digits - self.min_digits
        do = self.max_operands - self.min_operands
        return (self.min_digits + min(int(level * (dd + 1)), dd),
                self.min_operands + min(int(level * (do + 1)), do))

    def space_size(self, level: float) -> int:
        """How many distinct problems exist at a level (before the held-out split)."""
        digits, n = self.shape(level)
        return (10 ** digits) ** n * len(self.operators) ** (n - 1)

    # ---- problems

    def _format(self, operands: list[int], ops: list[str]) -> tuple[str, str]:
        text = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:]))
        return text + "=", str(evaluate(operands, ops))

    def _draw(self, rng: random.Random, level: float) -> tuple[str, str]:
        digits, n = self.shape(level)
        operands = [rng.randrange(10 ** digits) for _ in range(n)]
        ops = [rng.choice(self.operators) for _ in range(n - 1)]
        return self._format(operands, ops)

    def is_heldout(self, prompt: str) -> bool:
        """Held out or not, from the problem text alone (keyed by the seed): stable across levels and runs."""
        h = hashlib.blake2b(prompt.encode(), key=str(self.seed).encode()[:64], digest_size=8).digest()
        return int.from_bytes(h, "big") / 2 ** 64 < self.heldout_fraction

    def _record(self, rid: str, prompt: str, answer: str, level: float) -> PromptRecord:
        digits, n = self.shape(level)
        return PromptRecord(id=rid, prompt=prompt, reference=answer,
                            metadata={"task": "arithmetic", "level": level, "digits": digits, "operands": n})

    def train_record(self, index: int, level: float) -> PromptRecord:
        """Training problem number `index` at `level`: a pure function of (seed, index, level), never held out."""
        level = _check_level(level)
        rng = random.Random(f"arithmetic:{self.seed}:{index}")
        for _ in range(10_000):
            prompt, answer = self._draw(rng, level)
            if not self.is_heldout(prompt):
                return self._record(f"arithmetic/train/{index}", prompt, answer, level)
        raise RuntimeError(f"no training problem found at level {level}: heldout_fraction is too high")

    def train_batch(self, start: int, size: int, level: float) -> list[PromptRecord]:
        """Training problems start, ..., start + size - 1 (a run's data position is just `start`)."""
        return [self.train_record(start + k, level) for k in range(size)]

    def heldout(self, size: int, level: float = 1.0) -> list[PromptRecord]:
        """`size` distinct held-out problems at `level`, the same ones for the same seed, none ever trained on.

        Raises ValueError when the level has fewer held-out problems than asked for (e.g. 1-digit sums).
        """
        level = _check_level(level)
        if size < 1:
            raise ValueError(f"held-out size {size} must be >= 1")
        digits, n = self.shape(level)
        rng = random.Random(f"arithmetic-heldout:{self.seed}:{level}")
        if self.space_size(level) <= _ENUMERATE_LIMIT:
            pool = [p for p in (self._format(list(xs), list(ops))
                                for xs in itertools.product(range(10 ** digits), repeat=n)
                                for ops in itertools.product(self.operators, repeat=n - 1))
                    if self.is_heldout(p[0])]
            if len(pool) < size:
                raise ValueError(f"level {level} has only {len(pool)} held-out problems ({digits}-digit, {n} "
                                 f"operands), fewer than the {size} asked for; raise the level or heldout_fraction")
            chosen = rng.sample(pool, size)
        else:
            seen: dict[str, str] = {}
            for _ in range(1000 * size):
                prompt, answer = self._draw(rng, level)
                if prompt not in seen and self.is_heldout(prompt):
                    seen[prompt] = answer
                    if len(seen) == size:
                        break
            if len(seen) < size:
                raise ValueError(f"could not find {size} distinct held-out problems at level {level}")
            chosen = list(seen.items())
        return [self._record(f"arithmetic/heldout/{k}", p, a, level) for k, (p, a) in enumerate(chosen)]

    @staticmethod
    def score(record: PromptRecord, response: str) -> float:
        """1.0 if the response starts with the right integer."""
        return synthetic_reward(response, record.reference)


@dataclass(frozen=True)
class LinearCurriculum:
    """Difficulty level by training step: `start` until `warmup_steps`, then linear to `end` at `ramp_end_step`."""

    start: float = 0.0
    end: float = 1.0
    ramp_end_step: int = 1000
    warmup_steps: int = 0

    def __post_init__(self):
        _check_level(self.start)
        _check_level(self.end)
        if not 0 <= self.warmup_steps < self.ramp_end_step:
            raise ValueError(f"need 0 <= warmup_steps < ramp_end_step, got {self.warmup_steps}, {self.ramp_end_step}")

    def level(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.start
        frac = min(1.0, (step - self.warmup_steps) / (self.ramp_end_step - self.warmup_steps))
        return self.start + (self.end - self.start) * frac


def arithmetic_task_from_name(name: str, seed: int = 0, **overrides) -> Optional[ArithmeticTask]:
    """The task a `data.dataset` name such as "synthetic-arithmetic" means; None for other names."""
    if name.lower() in ("synthetic-arithmetic", "synthetic", "arithmetic"):
        return ArithmeticTask(seed=seed, **overrides)
    return None
