"""Properties of the DDMA planner, checked by applying plans to tensors of unique element ids."""

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.ddma.descriptors import LocalParam, logical_params
from megatron_rl.ddma.planner import Endpoint, ReshardPlan, plan_reshard
from megatron_rl.models import get_preset
from megatron_rl.models.presets import ModelConfig
from megatron_rl.models.sharding import ParamShard
from megatron_rl.parallel import ParallelLayout

POISON = -7  # value of a source's tied-embedding copy: the planner must never read it


def _shard(lp: LocalParam, full: torch.Tensor, padded_rows) -> torch.Tensor:
    """The local tensor of `lp`, cut by sharding.py's slicing (independent of the planner's block arithmetic)."""
    p = lp.param
    d = ParamShard(lp.local_name, p.name, p.shape, p.partition_dim, p.partition_stride, lp.tp_rank, lp.tp_size,
                   p.is_vocab, lp.tied_copy)
    return d.slice_of(full, padded_rows).clone()


def _view(t, box):
    return t[tuple(slice(a, b) for a, b in box)]


def simulate(plan: ReshardPlan, src_cfg: ModelConfig, dst_cfg: ModelConfig) -> None:
    """Apply `plan` to unique ids and check: every destination element written exactly once, with the right id,
    padding zero, no read from a rank or parameter that does not hold the data."""
    full, next_id = {}, 1
    for p in logical_params(src_cfg):
        full[p.name] = torch.arange(next_id, next_id + p.numel, dtype=torch.int64).view(p.shape)
        next_id += p.numel
    src, dst = plan.src, plan.dst
    src_tensors: dict = {}
    for r in src.ranks:
        key = src.params(r)  # DP replicas hold the same values (but a mixture of experts' hold other experts)
        if key not in src_tensors:
            padded = src_cfg.padded_vocab_size(src.layout.tp)
            src_tensors[key] = {lp.local_name: (torch.full(lp.local_shape, POISON, dtype=torch.int64)
                                                if lp.tied_copy else _shard(lp, full[lp.global_name], padded))
                                for lp in src.params(r)}
    dst_tensors, counts, expected = {}, {}, {}
    dst_padded = dst_cfg.padded_vocab_size(dst.layout.tp)
    for r in dst.ranks:
        for lp in dst.params(r):
            dst_tensors[r, lp.local_name] = torch.full(lp.local_shape, -1, dtype=torch.int64)
            counts[r, lp.local_name] = torch.zeros(lp.local_shape, dtype=torch.int64)
            expected[r, lp.local_name] = _shard(lp, full[lp.global_name], dst_padded)
    for c in plan.copies:
        assert c.src_rank in src.ranks and c.dst_rank in dst.ranks
        s = src_tensors[src.params(c.src_rank)][c.src_param]
        assert all(0 <= a < b <= n for (a, b), n in zip(c.src_box, s.shape)), c
        _view(dst_tensors[c.dst_rank, c.dst_param], c.dst_box).copy_(_view(s, c.src_box))
        _view(counts[c.dst_rank, c.dst_param], c.dst_box).add_(1)
    for z in plan.zero_fills:
        _view(dst_tensors[z.rank, z.param], z.box).zero_()
        _view(counts[z.rank, z.param], z.box).add_(1)
    for key, t in dst_tensors.items():
        assert torch.all(counts[key] == 1), f"{key}: elements written {counts[key].unique().tolist()} times"
        assert torch.equal(t, expected[key]), f"{key}: wrong elements"


def check_balance(plan: ReshardPlan) -> None:
    """Within each set of replicas (ranks holding the same shards: DP replicas, and with experts, expert-DP ones),
    network loads differ by at most the largest piece one of them sends (greedy least-loaded assignment guarantees
    that)."""
    loads = plan.sender_loads()
    biggest = defaultdict(int)
    for c in plan.copies:
        if not c.is_local:
            biggest[c.src_rank] = max(biggest[c.src_rank], c.numel)
    classes = defaultdict(list)
    for r in plan.src.ranks:
        classes[plan.src.params(r)].append(r)
    for ranks in classes.values():
        for a in ranks:
            for b in ranks:
                assert loads[a] - loads[b] <= biggest[a], (a, b, loads)


@st.composite
def reshard_cases(draw):
    tp_s, tp_d = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    pp_s, pp_d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dp_s, dp_d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    tp_l = math.lcm(tp_s, tp_d)
    groups = tp_l * (draw(st.integers(1, 2)) if tp_l <= 8 else 1)
    heads = groups * draw(st.integers(1, 3))  # GQA: 1 to 3 query heads per group
    kv = draw(st.sampled_from([1, 2]))
    cfg = ModelConfig(
        name="prop", num_layers=math.lcm(pp_s, pp_d), hidden_size=heads * kv, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=tp_l * draw(st.integers(1, 3)),
        vocab_size=draw(st.integers(1, 600)), tie_word_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 3, 8, 64, 128])))
    dst_cfg = ModelConfig(**{**cfg.__dict__, "make_vocab_size_divisible_by":
                             draw(st.sampled_from([1, 5, 8, 64, 128]))})
    src, dst = ParallelLayout(tp_s, pp_s, dp_s), ParallelLayout(tp_d, pp_d, dp_d)
    where = draw(st.sampled_from(["disjoint", "colocated", "overlap"]))
    dst_first = {"disjoint": src.size, "colocated": 0, "overlap": draw(st.integers(0, src.size))}[where]
    split = draw(st.sampled_from([1 << 16, 64]))
    return cfg, dst_cfg, src, dst, dst_first, split


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_planner_properties(case):
    cfg, dst_cfg, src, dst, dst_first, split = case
    plan = plan_reshard(cfg, src, dst, src_first_rank=0, dst_first_rank=dst_first, dst_cfg=dst_cfg,
                        split_min_elements=split)
    simulate(plan, cfg, dst_cfg)
    check_balance(plan)
    overlap = set(plan.src.ranks) & set(plan.dst.ranks)
    if not overlap:
        assert plan.local_elements == 0
        assert all(plan.sender_loads().values()), "every trainer rank sends"
    # boxes of a copy have the same shape on both sides
    assert all(tuple(b - a for a, b in c.src_box) == c.shape for c in plan.copies)


def test_plans_are_cached_and_pure():
    cfg = get_preset("tiny")
    a = plan_reshard(cfg, ParallelLayout(2, 2, 1), ParallelLayout(1, 1, 2))
    b = plan_reshard(get_preset("tiny"), ParallelLayout(2, 2, 1), ParallelLayout(1, 1, 2), dst_first_rank=4)
    assert a is b
    assert a.dst == Endpoint(a.src.model, ParallelLayout(1, 1, 2), 4)


def test_colocated_copies_locally_what_the_rank_already_holds():
    cfg = get_preset("tiny")
    plan = plan_reshard(cfg, ParallelLayout(tp=2), ParallelLayout(tp=1, dp=2), dst_first_rank=0)
    for r in (0, 1):
        rp = plan.for_rank(r)
        # each generator rank already holds its own TP half: local; the other half comes from the other rank
        assert {c.src_rank for c in rp.local} == {r} and {c.src_rank for c in rp.recvs} == {1 - r}
    # same layout on the same ranks: nothing moves over the network
    same = plan_reshard(cfg, ParallelLayout(tp=2), ParallelLayout(tp=2), dst_first_rank=0)
    assert same.network_elements == 0 and same.local_elements > 0


def test_senders_are_balanced_over_dp_replicas():
    cfg = get_preset("tiny")
    plan = plan_reshard(cfg, ParallelLayout(tp=1, dp=4), ParallelLayout(tp=2), split_min_elements=1024)
    loads = list(plan.sender_loads().values())
    assert min(loads) > 0 and max(loads) / min(loads) < 1.1, loads
    # each of the two generator ranks gets its half of the sharded weights and a whole copy of the norms
    norms = sum(p.numel for p in logical_params(cfg) if p.partition_dim is None)
    assert plan.network_elements == sum(p.numel for p in logical_params(cfg)) + norms


def test_impossible_pairs_fail_before_planning():
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match="generator \\(destination\\) layout tp=8,pp=1,dp=1 cannot hold the model"):
        plan_reshard(cfg, ParallelLayout(), ParallelLayout(tp=8))
    with pytest.raises(ValueError, match="trainer and generator models differ: num_layers 4 vs 8"):
        plan_reshard(cfg, ParallelLayout(), ParallelLayout(), dst_cfg=get_preset("tiny", num_layers=8))


def test_a_plan_keeps_what_the_transport_derives_from_it():
    """Per-rank plans, round schedules and contiguity are computed once per plan, in its `PlanMemo`."""
    from megatron_rl.ddma.schedule import end_contiguous, schedule

    plan = plan_reshard(get_preset("tiny"), ParallelLayout(tp=2), ParallelLayout(tp=1, dp=2))
    assert plan.for_rank(2) is plan.for_rank(2) is plan.memo.rank_plans[2]
    rounds = schedule(plan, 1 << 12)
    assert schedule(plan, 1 << 12) is rounds is plan.memo.schedules[1 << 12]
    assert sum(len(r) for r in rounds) >= sum(1 for c in plan.copies if not c.is_local)
    c = next(c for c in plan.copies if not c.is_local)
    assert end_contiguous(c, plan, "dst") is plan.memo.contiguous["dst", c]


def test_planning_leaves_the_garbage_collector_as_it_found_it():
    """The planner turns Python's cyclic collector off while it builds a plan (`_without_cyclic_gc`): it is on
    again after a plan and after a layout error, and stays off where the caller had turned it off."""
    import gc

    from megatron_rl.ddma.planner import _plan_cached, plan_reshard
    from megatron_rl.models.presets import get_preset
    from megatron_rl.parallel.layout import ParallelLayout

    tiny = get_preset("tiny")
    _plan_cached.cache_clear()  # plans built here, not ones cached by an earlier test
    collections = []
    gc.collect()  # no young objects left to push a collection past its threshold before the planner starts
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    try:
        plan = plan_reshard(get_preset("llama3-8b"), ParallelLayout(tp=4, pp=2), ParallelLayout(tp=2, dp=2))
    finally:
        gc.callbacks.pop()
    # thousands of objects and no collection among them: at most the young generation's, once the collector is
    # back on (without the switch, dozens)
    assert len(plan.copies) > 1000 and collections in ([], [0]), collections
    assert gc.isenabled()
    assert plan_reshard(tiny, ParallelLayout(tp=2), ParallelLayout(dp=2)).copies
    assert gc.isenabled()
    with pytest.raises(ValueError, match="does not divide"):
        plan_reshard(tiny, ParallelLayout(tp=3), ParallelLayout())
    assert gc.isenabled()
    gc.disable()
    try:
        plan_reshard(tiny, ParallelLayout(pp=2), ParallelLayout(tp=2))
        assert not gc.isenabled()
    finally:
        gc.enable()
