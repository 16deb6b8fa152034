"""Device memory of one rank, by what holds it.

Exact parts come from `RankModules` (modules built on the meta device, Megatron-Core's own buffers and optimizer
ranges): parameters, gradients, fp32 main weights, Adam moments, int8 weights, the generator's KV cache. The
rest is a stated model:

Trainer activations (`activation_bytes`): what autograd keeps for the backward pass of one micro-batch of
`b` sequences of `s` tokens, per transformer layer and token, with tensor parallelism t, no sequence parallelism
and no recomputation (the trainer enables neither); a is the compute dtype's size, h the hidden size, kv the
query groups x head dim, f the FFN size:

    norms (two)      fused (GPU: `FusedRMSNorm`): input and output, 2 a h each
                     unfused (CPU: torch's composite RMSNorm with an fp32 weight): an fp32 copy of the input, the
                     fp32 normalized tensor and the output, (8 + a) h each; plus one fp32 inverse RMS per token
    attention        the QKV output a (h + 2 kv) / t (V is a view of it), the rotated queries and keys
                     a (h + kv) / t, the output a h / t, fp32 log-sum-exp per head; no s x s scores (SDPA);
                     unfused, for sequences short enough that the CPU writes attention out
                     (`models.attention.WRITTEN_OUT_MAX_LEN`): also its fp32 probabilities and their copy in the
                     compute dtype, (4 + a) s per head and token
    MLP              fused (Megatron-Core's SwiGLU kernel): the first matmul's output and the second's input, 3 a f / t
                     unfused: those and two f-sized intermediates of SiLU and the product, 5 a f / t

The unfused variant is checked against the tensors autograd actually saves on this CPU (tests/test_plan.py); the
fused one is what the builder uses on GPUs (`fusions="auto"`, `bias_activation_fusion`), which a CPU
cannot check. Pipeline stage p of pp under 1F1B holds min(pp - p, micro-batches) micro-batches at once. The first stage
adds the embedding output, the last the final norm and the vocabulary-parallel logits (b s V/t in the compute
dtype). Left out: the fp32 temporaries of the chunked log-prob pass (one chunk at a time), the pipeline's
send/receive buffers, and the allocator's fragmentation.

Generator workspace (`prefill_workspace_bytes`): the prefill of every slot's prompt at once, which only fills
the cache (no logits): one layer's activations for those tokens and, with 8-bit weights, one dequantized layer's
largest weight; plus one decode step's vocabulary-parallel logits and their gathered fp32 copy for the slots.

DDMA staging: at most one bucket per rank and round (`TransportSettings.bucket_bytes`), on both executors.
`reserve_bytes`: CUDA context, communicators and allocator slack, a calibration number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.models.presets import ModelConfig


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by part. `parts` keeps the order in which the report lists them."""

    executor: str
    rank: str  # which rank this is, e.g. "pp 0, dp 0" (DP replicas differ only in optimizer shards)
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def margin(self, device_bytes: int) -> int:
        return device_bytes - self.total


def activation_bytes_per_token_layer(model: ModelConfig, tp: int, itemsize: int, fused: bool, seq: int = 0) -> int:
    """Bytes kept for the backward pass per token and transformer layer of sequences of `seq` tokens (module
    docstring; `seq` matters to the unfused CPU path only)."""
    h, f, t, a = model.hidden_size, model.ffn_hidden_size, tp, itemsize
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    norm = 2 * a * h if fused else 4 * h + 4 * h + a * h
    attention = a * ((q + 2 * kv) // t + (q + kv) // t + q // t) + 4 * (model.num_attention_heads // t)
    if not fused and 0 < seq <= _written_out_max_len(a):
        attention += (model.num_attention_heads // t) * seq * (4 + a)
    mlp = a * (3 if fused else 5) * f // t
    return 2 * (norm + 4) + attention + mlp


def _written_out_max_len(itemsize: int) -> int:
    """The longest sequence the CPU trainer writes attention out for, in a compute dtype of `itemsize` bytes."""
    import torch

    from megatron_rl.models.attention import WRITTEN_OUT_MAX_LEN

    return WRITTEN_OUT_MAX_LEN[torch.float32 if itemsize == 4 else torch.bfloat16]


def activation_bytes(model: ModelConfig, tp: int, pp: int, pp_rank: int, micro_batch: int, seq: int,
                     micro_batches: int, itemsize: int, fused: bool) -> int:
    """Activation bytes of pipeline stage `pp_rank` under 1F1B (module docstring)."""
    layers = model.num_layers // pp
    tokens = micro_batch * seq
    per_mb = layers * tokens * activation_bytes_per_token_layer(model, tp, itemsize, fused, seq)
    if pp_rank == 0:
        per_mb += tokens * model.hidden_size * itemsize  # embedding output
    if pp_rank == pp - 1:
        per_mb += tokens * model.hidden_size * itemsize * 2  # final norm input and output
        per_mb += tokens * (model.padded_vocab_size(tp) // tp) * itemsize  # logits
    in_flight = min(pp - pp_rank, max(micro_batches, 1))
    return in_flight * per_mb


def prefill_workspace_bytes(model: ModelConfig, tp: int, slots: int, prompt: int, itemsize: int,
                            quantized: bool) -> int:
    """Transient bytes of prefilling `slots` prompts of `prompt` tokens at once (module docstring)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    tokens = slots * prompt
    logits = slots * (model.padded_vocab_size(tp) // tp) * itemsize + slots * model.vocab_size * 4
    layer = tokens * itemsize * (2 * h + (q + 2 * kv) // tp + q // tp + 3 * f // tp)
    dequantized = (2 * f // tp) * h * itemsize if quantized else 0
    return logits + layer + dequantized
