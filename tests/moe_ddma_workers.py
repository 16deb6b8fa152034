"""Worker functions for the tests of DDMA moving a mixture of experts' weights (tests/test_moe_ddma.py)."""

from __future__ import annotations

import torch

from megatron_rl.models import build_gpt_model
from full_state import gather_full_state_dict
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology


def _push_case(rank, cfg, full, trainer_layout, generator_layout):
    """One push of `full` from a trainer at `trainer_layout` (ranks from 0) into a generator at `generator_layout`
    (the ranks after the trainer's, built with other weights), then the per-push check over every rank of the world
    (ranks in neither executor take part in the check with nothing). A generator rank returns its weights gathered
    back to logical ones, the names the push left unchanged, the number of expert tensors the plan copies into it
    and the number of expert tensors (of all generator ranks) the check fingerprinted; other ranks None."""
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
    if not g.is_member:
        check.after_push(None, None, 1, 0.0)
        return None
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=77)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = sync.sync(None, model)
    check.after_push(None, parameters_of(model), 1, result.seconds)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    experts = sum(".local_experts." in c.dst_param for c in sync.plan.copies if c.dst_rank == rank)
    checked = sum(".local_experts." in name for _, name in check.dtypes)
    return gather_full_state_dict(model, cfg, g.pgs), unchanged, experts, checked, result.version.step


def push_cases_worker(rank, world_size, cases):
    """Each case (cfg, logical weights, trainer layout kwargs, generator layout kwargs) pushed in turn on the same
    world (`_push_case`); returns this rank's result per case."""
    return [_push_case(rank, *case) for case in cases]
