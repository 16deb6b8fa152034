"""Reward functions: GSM8K and MATH verifiers, the synthetic-task reward, and user functions in worker processes
(`sandbox.WorkerPool`).

Every scorer has `score(list of (prompt, response, reference)) -> list[float]`; `get_reward_fn` picks one by kind.
sympy is imported only inside worker processes (see `math_answer.py`), never by importing this package.
"""

from megatron_rl.rewards.base import PerItemReward, RewardFunction, RewardItem
from megatron_rl.rewards.function import FunctionReward
from megatron_rl.rewards.gsm8k import GSM8KReward, extract_gsm8k_answer, gsm8k_reward, parse_reference
from megatron_rl.rewards.latex import canonical, last_boxed, normalize_answer, quick_equal
from megatron_rl.rewards.math_answer import MathReward, reference_answer
from megatron_rl.rewards.registry import REWARD_KINDS, get_reward_fn, kind_for_dataset
from megatron_rl.rewards.synthetic import SyntheticReward, leading_integer, synthetic_reward

__all__ = [
    "REWARD_KINDS", "FunctionReward", "GSM8KReward", "MathReward", "PerItemReward", "RewardFunction", "RewardItem",
    "SyntheticReward", "canonical", "extract_gsm8k_answer", "get_reward_fn", "gsm8k_reward", "kind_for_dataset",
    "last_boxed", "leading_integer", "normalize_answer", "parse_reference", "quick_equal", "reference_answer",
    "synthetic_reward",
]
