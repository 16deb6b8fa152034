"""Built-in synthetic task for the default job: two-number addition, no files needed.

Problems "a+b=" with the answer "a+b" then EOS, a and b drawn from [0, max_operand). The held-out set is a fixed
set of pairs that training never samples, so the held-out reward measures generalisation, not memorisation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class AdditionTask:
    def __init__(self, max_operand: int = 20, eval_size: int = 64, seed: int = 0):
        pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
        random.Random(seed).shuffle(pairs)
        if eval_size >= len(pairs):
            raise ValueError(f"eval_size={eval_size} leaves no training problems out of {len(pairs)}")
        self.eval_pairs = pairs[:eval_size]
        self.train_pairs = pairs[eval_size:]
        self.seed = seed

    @staticmethod
    def _problem(a: int, b: int) -> Problem:
        return Problem(f"{a}+{b}=", str(a + b))

    def train_batch(self, index: int, size: int) -> list[Problem]:
        """Batch `index` of the training stream: a pure function of (seed, index), so resumable."""
        rnd = random.Random(self.seed * 1_000_003 + index)
        return [self._problem(*rnd.choice(self.train_pairs)) for _ in range(size)]

    def eval_problems(self) -> list[Problem]:
        return [self._problem(a, b) for a, b in self.eval_pairs]

    @staticmethod
    def score(problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0
