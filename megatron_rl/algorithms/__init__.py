"""RL algorithms: AIPO and advantage estimators."""

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.aipo import AIPOSettings, aipo_token_loss, normalize

__all__ = ["AIPOSettings", "aipo_token_loss", "normalize", "compute_advantages"]
