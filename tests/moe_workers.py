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


def push_worker(rank, world_size, cfg, full, trainer_layout, generator_layout):
    """Ranks [0, trainer size): a trainer at `trainer_layout` loaded from the logical weights `full`; the rest: a
    generator at `generator_layout` built with other weights. One DDMA push with the per-push check; the generator
    ranks return their weights gathered back to logical ones, the names the push left unchanged and the number of
    expert tensors the plan copies into them."""
    from megatron_rl.ddma.fingerprint import PushCheck
    from megatron_rl.ddma.sync import WeightSync, parameters_of

    t_layout, g_layout = ParallelLayout(**trainer_layout), ParallelLayout(**generator_layout)
    topo = build_topology([ExecutorPlacement("trainer", t_layout, 0),
                           ExecutorPlacement("generator", g_layout, t_layout.size)])
    t, g = topo["trainer"], topo["generator"]
    sync = WeightSync(cfg, t, g)
    check = PushCheck(sync.plan, rank, None, interval=1)
    if t.is_member:
        model = build_gpt_model(cfg, t.layout, t.pgs, attention="sdpa")
        load_full_state_dict(model, full, cfg, t.pgs)
        result = sync.sync(model, None, step=1)
        check.after_push(parameters_of(model), None, 1, result.seconds)
        return None
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=77)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = sync.sync(None, model)
    check.after_push(None, parameters_of(model), 1, result.seconds)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    experts = sum(".local_experts." in c.dst_param for c in sync.plan.copies if c.dst_rank == rank)
    return gather_full_state_dict(model, cfg, g.pgs), unchanged, experts
