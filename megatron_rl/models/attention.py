"""Core attention on torch's scaled_dot_product_attention, pluggable into Megatron-Core's layer spec.

Megatron-Core's local `DotProductAttention` materializes the [b, heads, sq, sk] score matrix (and needs an
explicit mask); transformer-engine's is fast but optional. This module has the same constructor and forward
signature as `DotProductAttention` and calls `F.scaled_dot_product_attention`, which picks flash or
memory-efficient kernels on GPUs and a fused kernel on CPUs, handles GQA without repeating K/V (`enable_gqa`)
and never builds the score matrix for causal attention.
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
