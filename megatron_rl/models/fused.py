"""Fused RMSNorm and RoPE for GPU runs, without transformer-engine or apex.

Megatron-Core's fused kernels for these come from outside it: `FusedLayerNorm` (apex; LayerNorm only, and
`persist_layer_norm` is apex's LayerNorm kernel), `TENorm` and `fused_apply_rotary_pos_emb` (transformer-engine).
Without them the local spec's norm is `torch.nn.RMSNorm` (via `WrappedTorchNorm`) and RoPE is
`_apply_rotary_pos_emb_bshd`, both chains of separate elementwise kernels.

RMSNorm. Megatron-Core creates the norm weights in fp32 while the activations are bf16. torch has a fused CUDA
RMSNorm (`aten._fused_rms_norm`), but `F.rms_norm` takes it only when input and weight share a dtype, so every norm
of a bf16 model runs torch's composite path: about nine kernels forward and twenty backward, with fp32 copies of the
activations saved for the backward pass. `FusedRMSNorm` runs the same arithmetic,
``(x_fp32 * rsqrt(mean(x_fp32^2) + eps) * weight_fp32).to(x.dtype)`` (exactly torch's composite for an fp32 weight),
`torch.compile`d: one Triton kernel forward and a few backward (the weight gradient is a reduction over all tokens),
with the fp32 weight and fp32 weight gradient kept. The alternative, casting the weight to bf16 to reach torch's
own kernel (`rms_norm(..., impl="torch")`), is faster in isolation (`benchmarks/fused_kernels.py`), but the whole RL
step was slower with it (docs/benchmarks.md) and it rounds the weight and its gradient to bf16, so the compiled
arithmetic is the default.

RoPE. ``t * cos(f) + rotate_half(t) * sin(f)`` with cos and sin rounded to t's dtype, as Megatron's
`_apply_rotary_pos_emb_bshd` (non-interleaved; interleaved rotations fall back to Megatron's function), written once
and `torch.compile`d for CUDA tensors: one Triton kernel forward instead of about eight, and likewise backward.
The compiled kernel keeps the products in fp32 and rounds once, so in bf16 it may differ from the unfused chain
(which rounds after every operation) by one unit in the last place; in fp32 the two agree to rounding.

CPU tensors always take the plain arithmetic, bit-identical to torch's and Megatron's unfused functions (compiling
costs more than it saves on a CPU, and the test suite compares CPU runs against references at 1e-5), except in the
CUDA-rules test mode (`compat/cuda_rules.py`), read once when the norm is built or the RoPE slot filled;
`build_gpt_model` enables these only on GPUs (or in that mode) unless asked to.

How they are wired in (`megatron_rl.models.builder`):

* RMSNorm: `FusedRMSNorm` (a `torch.nn.RMSNorm` subclass, so parameter names, dtypes, initialization and
  checkpoints are unchanged) replaces the layer spec's `input_layernorm` / `pre_mlp_layernorm` and the block's final
  norm. (Megatron-Core has no RMSNorm hook of its own without TE: `normalization="RMSNorm"` picks torch's norm,
  `persist_layer_norm` and `FusedLayerNorm` are apex LayerNorm only.)
* RoPE: Megatron-Core's own switch, `TransformerConfig.apply_rope_fusion`, routes `apply_rotary_pos_emb` to
  `rope_utils.fused_apply_rotary_pos_emb`, which Megatron imports from transformer-engine and leaves `None`
  without it (and then refuses the flag). `register_rope_fusion` fills that slot with `fused_apply_rotary_pos_emb`
  below (bound to the CUDA-rules mode of the model being built) when it is empty or holds ours; models built
  without the flag are unaffected.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F

from megatron_rl.compat import cuda_rules
from megatron_rl.compat.compiled import CompiledKernel

FUSIONS = ("rmsnorm", "rope")

FusionSpec = Union[str, Iterable[str], None]


def resolve_fusions(fusions: FusionSpec = "auto") -> frozenset:
    """"auto": every fusion when CUDA is available, none otherwise; "none" (or None, ""): none; otherwise a
    comma-separated string or an iterable of names from `FUSIONS`."""
    if fusions is None:
        return frozenset()
    if isinstance(fusions, str):
        if fusions == "auto":
            return frozenset(FUSIONS) if torch.cuda.is_available() or cuda_rules.enabled() else frozenset()
        if fusions in ("none", ""):
            return frozenset()
        fusions = [f.strip() for f in fusions.split(",") if f.strip()]
    names = frozenset(fusions)
    unknown = names - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; expected 'auto', 'none' or names from {FUSIONS}")
    return names


# ----------------------------------------------------------------------------------------------------- RMSNorm


def rms_norm_math(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32, rounded once to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


# Specializations (`compiled.signature`): activation dtype x weight dtype (or none) x eps x grad mode x which of
# [s, b] are 1 (decode: s = 1). A job uses a few (trainer with grad, generator prefill and decode without); a reward
# model or a second model adds its own. Sizes are symbolic: micro-batch widths and decode batches share them.
# Two graphs a key: [s, 1, h] (one sequence, or a packed row) comes contiguous or transposed from [1, s, h]; a
# dimension of size 1 is contiguous at any stride, and dynamo guards on that stride (and its base's).
_rms_norm_compiled = CompiledKernel(rms_norm_math, "fused.rms_norm", lambda *args: (), max_keys=24,
                                    graphs_per_key=2)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, impl: Optional[str] = None) -> torch.Tensor:
    """RMSNorm over the last dimension. impl: "compiled" (`rms_norm_math` compiled; the default for CUDA tensors),
    "math" (`rms_norm_math` as is; the default otherwise) or "torch" (torch's fused kernel where it has one, the
    weight cast to x's dtype for it)."""
    if impl is None:
        impl = "compiled" if x.is_cuda else "math"
    if impl == "torch":
        w = weight if weight is None or weight.dtype == x.dtype else weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if impl == "compiled":
        return _rms_norm_compiled(x, weight, eps)
    if impl == "math":
        return rms_norm_math(x, weight, eps)
    raise ValueError(f"unknown RMSNorm implementation {impl!r}")


class FusedRMSNorm(torch.nn.RMSNorm):
    """Drop-in for the norm `WrappedTorchNorm` builds (`torch.nn.RMSNorm(hidden_size, eps)`) with a compiled forward
    (and backward) for CUDA inputs, and for CPU inputs in the CUDA-rules mode it was built in. Takes Megatron-Core's
    norm constructor arguments."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        # The same restrictions as WrappedTorchNorm's (which asserts them for torch's norms).
        if config.normalization != "RMSNorm":
            raise ValueError(f"FusedRMSNorm is an RMSNorm; the config asks for {config.normalization}")
        if config.layernorm_zero_centered_gamma or config.sequence_parallel or config.memory_efficient_layer_norm:
            raise ValueError("FusedRMSNorm supports neither zero-centered gamma, sequence parallelism nor "
                             "memory-efficient layer norm")
        super().__init__(hidden_size, eps=eps)
        self.cuda_rules_on = cuda_rules.enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps, "compiled" if cuda_rules.gpu_path(x, self.cuda_rules_on) else "math")


# -------------------------------------------------------------------------------------------------------- RoPE


def rope_math(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of t [s, b, heads, d] by angles freqs [s, 1 or b, 1, rot_dim] (non-interleaved halves;
    dimensions past rot_dim pass through)."""
    rot = freqs.shape[-1]
    x = t[..., :rot]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    if rot < t.shape[-1]:
        out = torch.cat((out, t[..., rot:]), dim=-1)
    return out


# Specializations (`compiled.signature`): dtype x grad mode x which of [s, b, heads] are 1 (decode: s = 1; GQA
# keys at high TP: one head) x query (contiguous) or key (a strided view of the fused QKV projection) x a rotary
# dimension smaller than the head's.
_rope_compiled = CompiledKernel(rope_math, "fused.rope", lambda t, freqs: (freqs.shape[-1] < t.shape[-1],),
                                max_keys=24, graphs_per_key=1)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, compiled: Optional[bool] = None) -> torch.Tensor:
    """`rope_math`, compiled for CUDA tensors (or as `compiled` says)."""
    if compiled is None:
        compiled = t.is_cuda
    return (_rope_compiled if compiled else rope_math)(t, freqs)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False, *, cuda_rules_on: bool = False) -> torch.Tensor:
    """The signature Megatron-Core calls its (transformer-engine) fused RoPE with, for [s, b, heads, d] inputs;
    `cuda_rules_on` is bound by `register_rope_fusion`."""
    if interleaved:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    return apply_rope(t, freqs, compiled=cuda_rules.gpu_path(t, cuda_rules_on))


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0, *, cuda_rules_on: bool = False) -> torch.Tensor:
    """The signature Megatron-Core calls its fused RoPE for packed sequences with: t [t, heads, d], sequence i at
    rows cu_seqlens[i]:cu_seqlens[i + 1], each rotated from position 0 (freqs [max_s, 1, 1, rot_dim]). Each row's
    angle is gathered by its position in its sequence, so the whole pack is one `rope_math` call."""
    if cp_size != 1:
        raise NotImplementedError("our fused RoPE for packed sequences does not split sequences over context ranks")
    rows = torch.arange(t.shape[0], device=t.device)
    starts = cu_seqlens.to(t.device, torch.long)
    positions = rows - starts[torch.searchsorted(starts, rows, right=True) - 1]
    return apply_rope(t.unsqueeze(1), freqs[positions], compiled=cuda_rules.gpu_path(t, cuda_rules_on)).squeeze(1)


def register_rope_fusion(cuda_rules_on: bool) -> bool:
    """Make Megatron-Core's `apply_rope_fusion` path available without transformer-engine: fill its
    `fused_apply_rotary_pos_emb` and `fused_apply_rotary_pos_emb_thd` (packed sequences) slots, each when empty or
    holding ours, with ours bound to `cuda_rules_on` (the CUDA-rules mode of the model being built: the slots are
    Megatron-Core's, one per process). Returns whether the slots now hold a fused RoPE (ours or TE's)."""
    from megatron.core.models.common.embeddings import rope_utils

    for name, fn in (("fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb),
                     ("fused_apply_rotary_pos_emb_thd", fused_apply_rotary_pos_emb_thd)):
        slot = getattr(rope_utils, name)
        if slot is None or (isinstance(slot, functools.partial) and slot.func is fn):
            setattr(rope_utils, name, functools.partial(fn, cuda_rules_on=cuda_rules_on))
    return rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None

