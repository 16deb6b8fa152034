"""Decoder models (Llama, Qwen2/2.5, Qwen3, Mistral: `families.py`) on Megatron-Core.

The presets import nothing heavy; the builder (which imports Megatron-Core) loads on first use.
"""

from megatron_rl.models.presets import PRESETS, ModelConfig, get_preset

__all__ = ["ModelConfig", "PRESETS", "get_preset", "build_gpt_model", "layer_spec", "transformer_config"]


def __getattr__(name):
    if name in ("build_gpt_model", "layer_spec", "transformer_config"):
        from megatron_rl.models import builder

        return getattr(builder, name)
    raise AttributeError(name)
