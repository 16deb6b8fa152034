"""Model presets (Llama, Qwen2.5, Qwen3, Mistral, Qwen3-MoE, Mixtral) with their published shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_rl.models.families import family
from megatron_rl.models.param_spec import model_params


def pad_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of `divisible_by * tp` (so it depends on TP)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass
class ModelConfig:
    """Shape of a decoder of one of the families of `megatron_rl.models.families`. Field names follow
    Megatron-Core's TransformerConfig where one exists; the family decides the QKV bias and the q/k norms."""

    name: str = "tiny"
    # The Hugging Face model type (`families.FAMILIES`): it decides the QKV bias and the q/k norms.
    family: str = "llama"
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 300
    max_position_embeddings: int = 512
    rotary_base: float = 10000.0
    # Llama 3.1 RoPE scaling (factor 8, low/high frequency factors 1/4, original context 8192).
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    # Vocabulary is padded to a multiple of this times the tensor-parallel size (Megatron's convention).
    make_vocab_size_divisible_by: int = 128
    # The size of one attention head when it is not hidden_size / num_attention_heads (Qwen3).
    head_dim: Optional[int] = None
    # Mixture of experts (the families `qwen3_moe` and `mixtral`): every layer's MLP is `num_moe_experts` SwiGLU
    # experts of width `moe_ffn_hidden_size`, of which a router picks `moe_router_topk` per token, weighted by a
    # softmax over the chosen ones' logits, or (`moe_router_pre_softmax`) by the top-k of the softmax over all
    # experts, unnormalized. None: a dense model (`ffn_hidden_size` is then its MLP's width).
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False

    def __post_init__(self):
        # One spelling per shape: a head size equal to hidden_size / num_attention_heads is the default's.
        if self.head_dim is not None and self.head_dim * self.num_attention_heads == self.hidden_size:
            self.head_dim = None
        # Experts as wide as the dense MLP unless given (Mixtral's); `section.model_problems` holds the rules.
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def add_qkv_bias(self) -> bool:
        return family(self.family).qkv_bias

    @property
    def qk_layernorm(self) -> bool:
        return family(self.family).qk_norm

    def padded_vocab_size(self, tp: int) -> int:
        return pad_vocab(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def num_parameters(self, tp: int = 1) -> int:
        """Parameters of the unsharded model (`param_spec.model_params`), vocabulary padded at the given TP."""
        pad = (self.padded_vocab_size(tp) - self.vocab_size) * self.hidden_size
        return sum(p.numel + pad * p.is_vocab for p in model_params(self))

    def num_active_parameters(self) -> int:
        """Parameters one token runs through (vocabulary unpadded): all of a dense model's; of a mixture of
        experts, `moe_router_topk` of each layer's experts (the FLOPs per token follow these)."""
        return sum(p.numel for p in model_params(self) if p.expert is None or p.expert < self.moe_router_topk)


PRESETS: dict[str, ModelConfig] = {
    # For tests and the default job: small enough for a 2-core CPU, with GQA and a vocabulary whose padding
    # differs with TP (300 -> 384 at TP=1, 512 at TP=2).
    "tiny": ModelConfig(),
    # A ~1.1B Llama shape, used by the benchmarks.
    "llama-1b": ModelConfig(
        name="llama-1b", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rotary_base=500000.0,
        rope_scaling=True, tie_word_embeddings=True,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
        num_query_groups=3, vocab_size=49152, max_position_embeddings=8192, rotary_base=100000.0,
        tie_word_embeddings=True, init_method_std=0.041666666666666664,
    ),
    # Llama 3.1 8B / 70B / 405B
    "llama3-8b": ModelConfig(
        name="llama3-8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rotary_base=500000.0,
        rope_scaling=True,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rotary_base=500000.0,
        rope_scaling=True,
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rotary_base=500000.0,
        rope_scaling=True,
    ),
    # Qwen/Qwen2.5-{0.5B,1.5B,7B}(-Instruct): QKV biases; the small two tie their embeddings.
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", family="qwen2", num_layers=24, hidden_size=896, ffn_hidden_size=4864,
        num_attention_heads=14, num_query_groups=2, vocab_size=151936, max_position_embeddings=32768,
        rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        name="qwen2.5-1.5b", family="qwen2", num_layers=28, hidden_size=1536, ffn_hidden_size=8960,
        num_attention_heads=12, num_query_groups=2, vocab_size=151936, max_position_embeddings=32768,
        rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
        num_attention_heads=28, num_query_groups=4, vocab_size=152064, max_position_embeddings=32768,
        rotary_base=1000000.0, norm_epsilon=1e-6,
    ),
    # Qwen/Qwen3-{0.6B,1.7B,8B}: per-head q/k RMSNorm, 128-wide heads whatever the hidden size.
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", family="qwen3", num_layers=28, hidden_size=1024, ffn_hidden_size=3072,
        num_attention_heads=16, num_query_groups=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True,
    ),
    "qwen3-1.7b": ModelConfig(
        name="qwen3-1.7b", family="qwen3", num_layers=28, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=16, num_query_groups=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", family="qwen3", num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
        num_attention_heads=32, num_query_groups=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1000000.0, norm_epsilon=1e-6,
    ),
    # mistralai/Mistral-7B-v0.3 (no sliding window) and v0.1 (a 4096-token window: converted with
    # max_position_embeddings at most 4096, where full attention is the same).
    "mistral-7b": ModelConfig(
        name="mistral-7b", family="mistral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=32768, max_position_embeddings=32768,
        rotary_base=1000000.0,
    ),
    "mistral-7b-v0.1": ModelConfig(
        name="mistral-7b-v0.1", family="mistral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=32000, max_position_embeddings=4096,
    ),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, 8 per token, probabilities renormalized over them.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", family="qwen3_moe", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=32, num_query_groups=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1000000.0, norm_epsilon=1e-6, num_moe_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
    ),
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", family="qwen3_moe", num_layers=94, hidden_size=4096, ffn_hidden_size=12288,
        num_attention_heads=64, num_query_groups=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1000000.0, norm_epsilon=1e-6, num_moe_experts=128, moe_ffn_hidden_size=1536, moe_router_topk=8,
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", family="mixtral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=32000, max_position_embeddings=32768,
        rotary_base=1000000.0, num_moe_experts=8, moe_ffn_hidden_size=14336, moe_router_topk=2,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A copy of the named preset, with field overrides."""
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model preset {name!r}{hint}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
