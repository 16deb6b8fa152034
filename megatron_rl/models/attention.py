"""Core attention on torch's scaled_dot_product_attention, pluggable into Megatron-Core's layer spec.

Megatron-Core's local `DotProductAttention` materializes the [b, heads, sq, sk] score matrix (and needs an
explicit mask); transformer-engine's is fast but optional. This module has the same constructor and forward
signature as `DotProductAttention` and calls `F.scaled_dot_product_attention`, which picks flash or
memory-efficient kernels on GPUs and a fused kernel on CPUs, handles GQA without repeating K/V (`enable_gqa`)
and never builds the score matrix for causal attention.

On a CPU, causal self-attention over short sequences is written out instead (two matmuls around a softmax in
fp32, the generator's own formula in `inference/kv_forward.py`): the CPU flash kernels run a GEMM per
(sequence, head, query block), and in bf16 each goes through oneDNN's primitive set-up, so a [32, 2, 40, 16]
attention took 14 ms forward and backward where the written-out one takes 2 ms (docs/benchmarks.md, "The CPU
trainer's attention written out"). Packed sequences are gathered into padded groups of similar lengths, a few
matmuls for the whole micro-batch instead of one kernel call per sequence.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_rl.compat import cuda_rules

# The longest sequence the CPU path writes attention out for, by dtype: below it the flash kernels' per-call costs
# dominate (in bf16, oneDNN's GEMM set-up), above it the written-out scores' memory traffic does; its
# [b, heads, s, s] fp32 scores stay small (docs/benchmarks.md, "The CPU trainer's attention written out").
WRITTEN_OUT_MAX_LEN = {torch.float32: 64, torch.bfloat16: 256, torch.float16: 256}
# A padded batch of at most this many tokens a row stays with the flash kernel: one call for the batch, in one
# query block, costs no more than the written-out matmuls (0.5-1.1 ms against 0.7-0.9 ms for [32, 2, 8-16, 16]).
FLASH_PADDED_MAX_LEN = 16


class SDPAttention(MegatronModule):
    """Causal (or padding-masked) attention over [s, b, heads, head_dim] tensors, GQA included; or over packed
    sequences (`packed_seq_params`, THD), each attending within itself only."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use transformer-engine")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp  # read by MegatronModule.sharded_state_dict
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cuda_rules_on = cuda_rules.enabled()  # GPU code paths on a CPU (tests of the GPU path)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None
        is_causal = False
        if attention_mask is not None:
            # Megatron's convention: True means "masked out"; SDPA's boolean mask: True means "attend".
            mask = ~attention_mask
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq == sk and sq > FLASH_PADDED_MAX_LEN and self._writes_out(q, sq):
                return _written_out(q, k, v, self.softmax_scale).permute(2, 0, 1, 3).reshape(sq, b, -1)
            if sq == sk:
                is_causal = True
            else:
                # Queries are the last sq positions of sk (decoding with a KV cache): bottom-right causal.
                rows = torch.arange(sk - sq, sk, device=q.device).unsqueeze(1)
                cols = torch.arange(sk, device=q.device).unsqueeze(0)
                mask = cols <= rows
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=self.heads_per_partition != self.groups_per_partition,
        )
        # [b, n, sq, d] -> [sq, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Packed sequences (THD: [t, heads, head_dim], sequence i at rows cu_seqlens[i]:cu_seqlens[i + 1]): causal
        attention within each sequence, never across. One SDPA call per sequence, each causal without a mask (the
        flash or fused kernels), rather than one call with a [t, t] block-diagonal mask, which would cost t^2 memory
        and, on GPUs, the slower masked kernels. [t, heads * head_dim]."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention packs sequences in the 'thd' format, not {params.qkv_format!r}")
        # The boundaries on the host: given with the parameters (`training.packing`), or read once a layer.
        bounds = getattr(params, "host_bounds", None) or params.cu_seqlens_q.tolist()
        if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q \
                and params.cu_seqlens_kv.tolist() != bounds:
            raise NotImplementedError("SDPAttention packs self-attention only (the same boundaries for q and kv)")
        if self._writes_out(query, max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)):
            return _packed_written_out(query, key, value, bounds, self.softmax_scale).reshape(query.shape[0], -1)
        out = torch.empty(query.shape[0], query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
        gqa = self.heads_per_partition != self.groups_per_partition
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                # [n, heads, d] -> [1, heads, n, d]
                q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                                   is_causal=b - a > 1, scale=self.softmax_scale, enable_gqa=gqa)
                out[a:b] = o[0].transpose(0, 1)
        return out.reshape(query.shape[0], -1)

    def _writes_out(self, x: torch.Tensor, longest: int) -> bool:
        """Whether causal attention over sequences of at most `longest` tokens is written out (`_written_out`): on
        the CPU path, without dropout, for short sequences."""
        return not cuda_rules.gpu_path(x, self.cuda_rules_on) and longest <= WRITTEN_OUT_MAX_LEN.get(x.dtype, 0) and \
            not (self.training and self.dropout_p > 0)


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over k, v [b, groups, s, d] as two matmuls around a softmax in fp32
    (fp64 for fp64), each group's query heads folded into the query length (GQA without repeating K/V)."""
    b, heads, s, d = q.shape
    g = k.shape[1]
    per = heads // g
    scores = torch.matmul(q.reshape(b, g, per * s, d), k.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale  # fp32 at least
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    scores = scores.view(b, g, per, s, s).masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype).view(b, g, per * s, s)
    return torch.matmul(probs, v).view(b, heads, s, d)


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Sequence indices grouped by length for padding (shortest first): a group takes sequences up to 5/4 of its
    shortest plus 8 tokens, so padding costs little while a micro-batch of 64 mixed lengths needs a few groups."""
    order = sorted((n, i) for i, n in enumerate(lengths) if n > 0)
    groups: list[list[int]] = []
    cap = -1
    for n, i in order:
        if n > cap:
            groups.append([])
            cap = n * 5 // 4 + 8
        groups[-1].append(i)
    return groups


def _packed_written_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                        scale: float) -> torch.Tensor:
    """`_written_out` over packed sequences (THD, sequence i at rows bounds[i]:bounds[i + 1]): each group of
    similar lengths is gathered into a right-padded [n, heads, longest, d] batch. A padding row's query is dropped
    and its key is seen by padding queries only, so it changes no real row (and gets no gradient). Rows outside
    every sequence come out zero. [t, heads, d]."""
    t, dev = query.shape[0], query.device
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    parts, dest = [], []
    for group in _length_groups(lengths):
        s = max(lengths[i] for i in group)
        pos = torch.arange(s, device=dev)
        first = torch.tensor([starts[i] for i in group], device=dev)
        rows = (first[:, None] + pos).clamp_(max=t - 1).view(-1)
        q, k, v = (x.index_select(0, rows).view(len(group), s, *x.shape[1:]).transpose(1, 2)
                   for x in (query, key, value))
        out = _written_out(q, k, v, scale).transpose(1, 2).reshape(len(group) * s, *query.shape[1:2], -1)
        n = torch.tensor([lengths[i] for i in group], device=dev)
        keep = (torch.arange(len(group), device=dev)[:, None] * s + pos)[pos < n[:, None]]
        parts.append(out.index_select(0, keep))
        dest.append(rows.view(len(group), s)[pos < n[:, None]])
    heads, d = query.shape[1], value.shape[-1]
    parts.append(query.new_zeros(1, heads, d))  # what rows outside every sequence read
    where = torch.full((t,), sum(p.shape[0] for p in parts) - 1, dtype=torch.long, device=dev)
    order = torch.cat(dest)
    where[order] = torch.arange(order.numel(), device=dev)
    return torch.cat(parts).index_select(0, where)
