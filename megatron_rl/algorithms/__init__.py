"""RL algorithms: AIPO and advantage estimators. The settings (`AIPOSettings`) import nothing heavy; the losses
(torch) load on first use."""

from megatron_rl.algorithms.settings import AIPOSettings

__all__ = ["AIPOSettings", "aipo_token_loss", "normalize", "compute_advantages"]


def __getattr__(name):
    if name in ("aipo_token_loss", "normalize"):
        from megatron_rl.algorithms import aipo

        return getattr(aipo, name)
    if name == "compute_advantages":
        from megatron_rl.algorithms.advantages import compute_advantages

        return compute_advantages
    raise AttributeError(name)
