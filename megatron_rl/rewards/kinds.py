"""The reward kinds (`reward.kind`): one table that the settings' choices, the registry and every message derive
from. Imports nothing: the settings read it without importing a verifier."""

from __future__ import annotations

import typing
from typing import Literal

# "auto": the verifier the dataset names (`data.registry`); a verifier ("gsm8k", "math", "synthetic": an exact
# match of the reference); "function": the user's `reward.function`; "reward-model": `reward.model`'s score alone.
RewardKind = Literal["auto", "gsm8k", "math", "synthetic", "function", "reward-model"]
REWARD_KINDS: tuple[str, ...] = typing.get_args(RewardKind)
EXPLICIT_KINDS: tuple[str, ...] = tuple(k for k in REWARD_KINDS if k != "auto")  # what "auto" may be replaced by


def kinds_text(kinds: tuple[str, ...] = EXPLICIT_KINDS) -> str:
    """The kinds as a message lists them: 'gsm8k', 'math', ..."""
    return ", ".join(map(repr, kinds))
