"""The `algorithm` section: AIPO's loss (`algorithms/aipo.py`) and the advantage estimator (`advantages.py`).
Imports nothing heavy, so that a configuration is checked without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from megatron_rl.settings import Section, ranged


@dataclass
class AIPOSettings(Section):
    """rho truncates the importance weight; `ppo_clip` switches to PPO's clipped surrogate of the same ratio;
    `kl_coef` and `entropy_coef` add a KL penalty to a frozen reference and an entropy bonus (`aipo.py`)."""

    SECTION: ClassVar[str] = "algorithm"
    name: Literal["aipo"] = "aipo"
    rho: float = ranged(4.0, ">= 1", "(importance weights are truncated at rho)")
    advantage: Literal["group_mean", "rloo", "grpo"] = "group_mean"
    normalization: Literal["token", "sequence"] = "token"
    ppo_clip: Optional[float] = ranged(None, "> 0")
    kl_coef: float = ranged(0.0, ">= 0")
    entropy_coef: float = 0.0  # either sign
    # false: ignore the behaviour policy (weights of 1, as if every sample were on-policy): the uncorrected
    # baseline of the staleness study, not a setting to train with.
    importance_weights: bool = True

    def rules(self, path: str) -> list[str]:
        if self.ppo_clip is not None and not self.importance_weights:
            return [f"{path}.ppo_clip needs {path}.importance_weights=true (its ratio is pi / mu)"]
        return []
