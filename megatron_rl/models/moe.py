"""Megatron-Core's MoE layer on a model whose activations are whole over tensor parallelism.

Megatron-Core's token dispatchers take their input split over the TP ranks along the tokens (sequence
parallelism), and its MoE layer refuses to train with TP > 1 without it: every TP rank would route and compute
the same tokens again. This project does not use sequence parallelism: the trainer's packed rows, the
generator's incremental forward and the pipeline stages all hand whole activations between layers.
`TokenSplitMoELayer` keeps that contract and gives the dispatcher what it expects, within the layer: each TP rank
takes its 1/TP of the layer's tokens (flattened over sequence and batch, padded with masked tokens to a multiple
of TP), runs Megatron-Core's layer on them, and the outputs are all-gathered back. The backward of the split is
the all-gather of the token gradients, that of the gather a split (the activations after the layer are the same
on every TP rank, so are their gradients). The arithmetic per token is Megatron-Core's (a test checks it against
transformers at TP2 x EP2); the duplicated work is gone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer


class TokenSplitMoELayer(MoELayer):
    """Megatron-Core's MoELayer taking whole [s, b, h] activations: each TP rank routes 1/TP of the tokens (see
    the module docstring)."""

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        # The layer's own check against duplicated tokens (training at TP > 1 without sequence parallelism) reads
        # this group's size; the tokens are split here, so it sees a group of one (CP, which this project keeps
        # at 1).
        self.attn_tp_group = pg_collection.cp

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        tp = self.tp_group.size()
        if tp == 1:
            return super().forward(hidden_states, padding_mask=padding_mask)
        s, b, h = hidden_states.shape
        tokens = hidden_states.reshape(s * b, 1, h)
        # [b, s] with True for real tokens -> [1, s * b] in the flattened order (padding_mask is batch-first).
        valid = (torch.ones(s * b, dtype=torch.bool, device=tokens.device) if padding_mask is None
                 else padding_mask.transpose(0, 1).reshape(s * b).bool())
        pad = -(s * b) % tp
        if pad:
            tokens = F.pad(tokens, (0, 0, 0, 0, 0, pad))
            valid = F.pad(valid, (0, pad), value=False)
        mine = scatter_to_sequence_parallel_region(tokens, group=self.tp_group)
        chunk = mine.shape[0]
        rank = self.tp_group.rank()
        my_mask = valid[rank * chunk:(rank + 1) * chunk].reshape(1, chunk)
        out, bias = super().forward(mine, padding_mask=None if padding_mask is None and not pad else my_mask)
        out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=self.tp_group)
        return out[: s * b].reshape(s, b, h), bias
