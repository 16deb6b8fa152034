"""Generator executor: batched sampling with a KV cache and behaviour log-probs. The settings import nothing
heavy; the generator (Megatron-Core) loads on first use."""

from megatron_rl.inference.settings import GeneratorSettings, RolloutSettings

__all__ = ["Generator", "GenerationRequest", "SampledResponse", "GeneratorSettings", "RolloutSettings",
           "SamplingParams"]


def __getattr__(name):
    if name in ("Generator", "GenerationRequest", "SampledResponse"):
        from megatron_rl.inference import generator

        return getattr(generator, name)
    if name == "SamplingParams":
        from megatron_rl.inference.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
