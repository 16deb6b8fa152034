"""The logical state dict of a sharded model, assembled on every rank (tests compare whole models with it; a real
job never gathers, see `ddma`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.models.presets import ModelConfig
from megatron_rl.models.sharding import describe_params


def _unstrided_cat(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of `models.sharding._strided_chunk` over all parts."""
    if stride == 1:
        return torch.cat(shards, dim=dim)
    per = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per[p][s] for s in range(stride) for p in range(len(shards))], dim=dim)


@torch.no_grad()
def gather_full_state_dict(model: torch.nn.Module, cfg: ModelConfig, pgs) -> dict[str, torch.Tensor]:
    """The logical state dict, assembled on every rank of the executor (small models only)."""
    tp_rank, tp_size = pgs.tp.rank(), pgs.tp.size()
    params = dict(model.named_parameters())
    mine: dict[str, torch.Tensor] = {}
    for d in describe_params(model, cfg, tp_rank, tp_size):
        if d.tied_copy:
            continue
        p = params[d.local_name].detach().contiguous()
        if d.partition_dim is not None and d.tp_size > 1:
            shards = [torch.empty_like(p) for _ in range(d.tp_size)]
            dist.all_gather(shards, p, group=pgs.expt_tp if d.is_expert else pgs.tp)
            p = _unstrided_cat(shards, d.partition_dim, d.partition_stride)
        p = p.cpu()
        if d.is_vocab:
            p = p[: cfg.vocab_size]
        mine[d.global_name] = p.clone()
    # Stages hold different layers, expert-parallel ranks different experts: exchange over both.
    full: dict[str, torch.Tensor] = {}
    for group in (pgs.ep, pgs.pp):
        if group.size() > 1:
            parts: list = [None] * group.size()
            dist.all_gather_object(parts, mine, group=group)
            mine = {k: v for part in parts for k, v in part.items()}
    full.update(mine)
    return full
