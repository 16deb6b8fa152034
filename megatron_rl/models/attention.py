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
    """Causal (or padding-masked) attention over [s, b, heads, head_dim] tensors, GQA included."""

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
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias")
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
