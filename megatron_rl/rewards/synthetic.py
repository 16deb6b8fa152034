"""Reward for the synthetic arithmetic task: exact match of the integer the response starts with.

A tiny byte-level model keeps generating after its answer until it emits EOS or hits the token limit, so only the
leading integer counts: "19<eos>", "19\\n7+1=8" and " 19" all answer 19, while "190" and "1 9" do not.
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_rl.rewards.base import PerItemReward

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def leading_integer(response: str) -> Optional[int]:
    m = _LEADING_INT.match(response)
    return int(m.group(1)) if m else None


def synthetic_reward(response: str, reference: str) -> float:
    got = leading_integer(response)
    return 1.0 if got is not None and got == int(reference.strip()) else 0.0


class SyntheticReward(PerItemReward):
    name = "synthetic"

    def score_one(self, prompt: str, response: str, reference: Optional[str]) -> float:
        if reference is None:
            raise ValueError("the synthetic-task reward needs a reference answer")
        return synthetic_reward(response, reference)
