"""Arithmetic word problems, generated: "Mia has 7 shells. Then Mia finds 4 shells. How many shells does Mia have
now?" -> 11.

Made for the real-model recipe (`configs/smollm2-arithmetic.yaml`): a task a small instruction-tuned LLM reads
without help, whose answer is one number checked exactly (the GSM8K verifier), and that SmolLM2-135M-Instruct
mostly fails at first (it explains instead of answering and slips on the arithmetic), so that RL has room to work
in a few dozen steps on a CPU. Each problem starts with a quantity and applies between `min_steps` and `max_steps`
changes (gains and losses; losses never go below zero), drawn from small fixed vocabularies of names, objects and
phrasings. The job's `word-problems` dataset uses one change: with two, the published model solves 3-8% and RL on a
CPU had too little signal to move it in 50 steps (docs/benchmarks.md).

Determinism and the held-out split: problem `i` of a split is a pure function of (seed, split, i). A problem is
held out when a keyed hash of its text says so, and training skips those texts, so held-out problems are never
trained on and the split needs no stored list.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from megatron_rl.data.records import PromptRecord

_NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ava", "Noah", "Ella",
          "Omar", "Ruth")
_OBJECTS = ("apples", "marbles", "stickers", "books", "cookies", "pencils", "cards", "coins", "shells", "toys",
            "stamps", "balloons")
_GAINS = ("{n} buys {y} more {o}.", "Then {n} finds {y} {o}.", "A friend gives {n} {y} {o}.",
          "{n} gets {y} more {o}.")
_LOSSES = ("{n} gives {y} {o} to a friend.", "Then {n} loses {y} {o}.", "{n} uses {y} {o}.",
           "{n} sells {y} {o}.")


# The built-in tool-use task's problems (`data.dataset=calculator`, with `environments/calculator.py`): two or three
# changes with numbers up to 50, beyond a small model's mental arithmetic, not beyond a calculator.
CALCULATOR_PROBLEMS = dict(min_steps=2, max_steps=3, max_number=50)


@dataclass(frozen=True)
class WordProblems:
    """min_steps / max_steps: changes per problem (inclusive range); max_number: the largest starting quantity and
    change; heldout_share: the share of problem texts kept for evaluation."""

    seed: int = 0
    min_steps: int = 1
    max_steps: int = 1
    max_number: int = 10
    heldout_share: float = 0.1

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"steps must satisfy 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_number < 2:
            raise ValueError(f"max_number={self.max_number} must be >= 2")
        if not 0 < self.heldout_share < 1:
            raise ValueError(f"heldout_share={self.heldout_share} must be in (0, 1)")

    def _problem(self, rng: random.Random) -> tuple[str, int, str]:
        """(text, answer, the arithmetic that solves it: "7+4-2")."""
        name, obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
        x = rng.randint(2, self.max_number)
        parts, expression = [f"{name} has {x} {obj}."], str(x)
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            if x > 1 and rng.random() < 0.5:
                y = rng.randint(1, min(x - 1, self.max_number))
                x -= y
                expression += f"-{y}"
                parts.append(rng.choice(_LOSSES).format(n=name, y=y, o=obj))
            else:
                y = rng.randint(1, self.max_number)
                x += y
                expression += f"+{y}"
                parts.append(rng.choice(_GAINS).format(n=name, y=y, o=obj))
        parts.append(f"How many {obj} does {name} have now?")
        return " ".join(parts), x, expression

    def is_heldout(self, text: str) -> bool:
        digest = hashlib.blake2b(text.encode(), key=f"word-problems:{self.seed}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.heldout_share

    def records(self, split: str, count: int) -> list[PromptRecord]:
        """The first `count` distinct problems of a split ("train" or "eval"), in a fixed order."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        want_heldout = split == "eval"
        rng = random.Random(f"word-problems:{self.seed}:{split}")
        seen: set[str] = set()
        out: list[PromptRecord] = []
        for _ in range(200 * count + 1000):
            text, answer, expression = self._problem(rng)
            if text in seen or self.is_heldout(text) != want_heldout:
                continue
            seen.add(text)
            out.append(PromptRecord(id=f"{split}-{len(out)}", prompt=text, reference=str(answer),
                                    metadata={"expression": expression}))
            if len(out) == count:
                return out
        raise ValueError(f"could not draw {count} distinct {split} problems (max_number={self.max_number}, "
                         f"steps {self.min_steps}-{self.max_steps}): the problem space is too small")
