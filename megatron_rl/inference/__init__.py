"""Generator executor: batched sampling with a KV cache and behaviour log-probs."""

from megatron_rl.inference.generator import GenerationOutput, GenerationRequest, Generator
from megatron_rl.inference.sampling import SamplingParams

__all__ = ["Generator", "GenerationRequest", "GenerationOutput", "SamplingParams"]
