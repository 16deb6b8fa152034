"""Pick a reward function by kind (the `reward.kind` config value), or by dataset name with kind "auto"."""

from __future__ import annotations

import difflib
from typing import Optional

from megatron_rl.data.registry import UnknownDatasetError, resolve_dataset
from megatron_rl.rewards.base import RewardFunction
from megatron_rl.rewards.function import FunctionReward
from megatron_rl.rewards.kinds import REWARD_KINDS, kinds_text
from megatron_rl.rewards.gsm8k import GSM8KReward
from megatron_rl.rewards.math_answer import MathReward
from megatron_rl.rewards.synthetic import SyntheticReward



def kind_for_dataset(dataset: Optional[str]) -> str:
    """The verifier kind that "auto" means for a dataset name (`megatron_rl.data.registry`); a clear error when the
    name does not say."""
    if dataset is None:
        raise ValueError("reward.kind='auto' needs a dataset name to choose a verifier")
    try:
        kind = resolve_dataset(dataset).verifier
    except UnknownDatasetError:
        kind = None
    if kind is None:
        raise ValueError(f"reward.kind='auto' cannot choose a verifier for dataset {dataset!r}; "
                         f"set reward.kind to one of {kinds_text()}")
    return kind


def get_reward_fn(kind: str, function: Optional[str] = None, timeout_s: float = 5.0, num_workers: int = 1,
                  dataset: Optional[str] = None, start_method: Optional[str] = None,
                  model: Optional[str] = None, batch_timeout_s: Optional[float] = None,
                  log_path: Optional[str] = None) -> RewardFunction:
    """A ready reward function. Call `close()` on it (or use `with`) to stop its worker processes, if any.

    kind: "gsm8k", "math", "synthetic", "function" (needs `function="module:function"`), "reward-model" (needs
    `model`, a Hugging Face sequence-classification directory), "auto" (by `dataset`). `log_path`: where the worker
    processes of "function" and "math" write (`sandbox.WorkerPool`).
    """
    if kind not in REWARD_KINDS:
        close = difflib.get_close_matches(str(kind), REWARD_KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown reward kind {kind!r}{hint}; expected one of {kinds_text(REWARD_KINDS)}")
    if kind == "auto":
        kind = kind_for_dataset(dataset)
    if function is not None and kind != "function":
        raise ValueError(f"reward function {function!r} is given but reward kind is {kind!r}; use kind 'function'")
    if kind == "gsm8k":
        return GSM8KReward()
    if kind == "synthetic":
        return SyntheticReward()
    if kind == "math":
        return MathReward(timeout_s=timeout_s, num_workers=num_workers, start_method=start_method, log_path=log_path)
    if kind == "function":
        if not function:
            raise ValueError("reward kind 'function' needs function='module:function'")
        return FunctionReward(function, timeout_s=timeout_s, num_workers=num_workers, start_method=start_method,
                              batch_timeout_s=batch_timeout_s, log_path=log_path)
    if not model:
        raise ValueError("reward kind 'reward-model' needs model=DIR (a sequence-classification model)")
    from megatron_rl.rewards.reward_model import RewardModelReward

    return RewardModelReward(model)
