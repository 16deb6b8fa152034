"""Worker functions for the mixture-of-experts tests that need several ranks."""

from __future__ import annotations

import torch

from megatron_rl.models import build_gpt_model
from megatron_rl.models.sharding import gather_full_state_dict, load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import model_forward


def logits_worker(rank, world_size, cases, tokens, layout):
    """For each (cfg, logical weights): the model at `layout` loaded from them, whether gathering its weights back
    gives them bit for bit, and (last stage) its logits over the unpadded vocabulary gathered over TP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    g = build_topology([ExecutorPlacement("moe", ParallelLayout(**layout))])["moe"]
    out = []
    for cfg, full in cases:
        model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
        load_full_state_dict(model, full, cfg, g.pgs)
        back = gather_full_state_dict(model, cfg, g.pgs)
        same = back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
        with torch.no_grad():
            logits = model_forward(model, tokens, False)
        if g.is_last_stage:
            logits = gather_from_tensor_model_parallel_region(logits, group=g.pgs.tp)[..., :cfg.vocab_size]
        out.append((same, logits if g.is_last_stage else None))
    return out
