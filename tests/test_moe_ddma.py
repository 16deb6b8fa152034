"""DDMA moves a mixture of experts' weights (issue 55): expert shards go point to point between any trainer
TP/EP/PP layout and any generator layout, each generator element from exactly one trainer rank that holds it, the
expert-data-parallel copies sharing the sending, and the per-push check covers the expert tensors."""

import math
import time
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.ddma.fingerprint import held_dtypes, local_fingerprints, mismatches
from megatron_rl.ddma.planner import plan_reshard
from megatron_rl.ddma.verify import reference_shard
from megatron_rl.models import get_preset
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel import ParallelLayout
from test_ddma_planner import check_balance, simulate
from tiny_hf import MOE_CONFIGS, tiny_moe_models

EXPERTS = ".local_experts."
TINY_MOE = dict(family="mixtral", num_moe_experts=4, moe_ffn_hidden_size=48)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_layout(draw, tp: int, pp: int, dp: int) -> ParallelLayout:
    """A layout whose expert grid (etp x ep) tiles a stage's tp x dp ranks: a trainer's (etp=tp, EP over DP), a
    generator's (etp x ep = tp), or any other."""
    etp = draw(st.sampled_from(_divisors(tp * dp)))
    ep = draw(st.sampled_from(_divisors(tp * dp // etp)))
    return ParallelLayout(tp, pp, dp, ep, etp)


@st.composite
def moe_reshard_cases(draw):
    src = _expert_layout(draw, draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 4)))
    dst = _expert_layout(draw, draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 4)))
    tp_l, ep_l, etp_l = math.lcm(src.tp, dst.tp), math.lcm(src.ep, dst.ep), math.lcm(src.etp, dst.etp)
    groups = tp_l * draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 2))
    cfg = ModelConfig(
        name="prop-moe", family=draw(st.sampled_from(sorted(MOE_CONFIGS))), num_layers=math.lcm(src.pp, dst.pp),
        hidden_size=heads * draw(st.sampled_from([2, 4])), num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=tp_l * 2, vocab_size=draw(st.integers(1, 300)), tie_word_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 128])),
        num_moe_experts=ep_l * draw(st.integers(1, 2)), moe_ffn_hidden_size=etp_l * draw(st.integers(1, 3)))
    where = draw(st.sampled_from(["disjoint", "colocated", "overlap"]))
    dst_first = {"disjoint": src.size, "colocated": 0, "overlap": draw(st.integers(0, src.size))}[where]
    return cfg, src, dst, dst_first, draw(st.sampled_from([1 << 16, 64]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_reshard_cases())
def test_expert_plans_write_every_generator_element_once_from_a_rank_holding_it(case):
    """Any pair of expert layouts (EP over DP, EP inside TP, expert TP other than TP, pipeline stages; disjoint,
    colocated or overlapping executors): applying the plan to unique element ids writes every generator element
    exactly once with its own id, reads only shards the source rank holds (`simulate`), and replicas holding the
    same shards send within one piece of each other (`check_balance`)."""
    cfg, src, dst, dst_first, split = case
    plan = plan_reshard(cfg, src, dst, dst_first_rank=dst_first, split_min_elements=split)
    simulate(plan, cfg, cfg)
    check_balance(plan)
    assert any(EXPERTS in c.dst_param for c in plan.copies)


def test_expert_data_parallel_replicas_share_the_sending():
    """A trainer at DP4 x EP2 holds each expert on two ranks (its expert-DP group): a generator at TP1 gets every
    expert from the two ranks that hold it, both of them sending, and never from a rank that holds other experts."""
    cfg = get_preset("tiny", **TINY_MOE)
    trainer = ParallelLayout(tp=1, dp=4, ep=2)
    plan = plan_reshard(cfg, trainer, ParallelLayout(tp=1), split_min_elements=1024)
    holders = {0: {0, 2}, 1: {0, 2}, 2: {1, 3}, 3: {1, 3}}  # EP rank = DP rank % 2 holds experts 2e, 2e + 1
    senders = defaultdict(set)
    for c in plan.copies:
        if EXPERTS in c.name:
            senders[int(c.name.split(EXPERTS)[1].split(".")[0])].add(c.src_rank)
    assert dict(senders) == holders
    loads = plan.sender_loads()
    assert min(loads.values()) > 0 and max(loads.values()) / min(loads.values()) < 1.1, loads
    check_balance(plan)


def _logical_box(lp, box):
    """The region of the logical (padded) tensor that `box` of `lp`'s local tensor holds (its partition-dim range
    inside one of the rank's blocks)."""
    dim = lp.param.partition_dim
    if dim is None:
        return box
    a, b = box[dim]
    for g0, g1, l0 in lp.blocks():
        if l0 <= a and b <= l0 + g1 - g0:
            return box[:dim] + ((g0 + a - l0, g0 + b - l0),) + box[dim + 1:]
    raise AssertionError(f"{lp.local_name}: {box} crosses a block")


def _disjoint(boxes) -> bool:
    return not any(all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(x, y))
                   for i, x in enumerate(boxes) for y in boxes[i + 1:])


def test_a_qwen3_30b_push_plans_without_models_and_fills_each_generator_element_from_one_source():
    """Qwen3-30B-A3B (128 experts of 48 layers) from a trainer at TP4 x DP8 x EP8 (16 experts per DP rank, each
    split over TP) into a generator at TP4 with EP4 inside TP (32 whole experts per rank) plans from the shapes
    alone, and every element of every generator tensor has exactly one source: the copies and padding fills of a
    tensor are disjoint and add up to it, each copy reads a shard its trainer rank holds, of the same logical
    region."""
    cfg = get_preset("qwen3-30b-a3b")
    t0 = time.perf_counter()
    plan = plan_reshard(cfg, ParallelLayout(tp=4, dp=8, ep=8), ParallelLayout(tp=4, ep=4, etp=1))
    print(f"qwen3-30b-a3b plan: {time.perf_counter() - t0:.2f} s, {len(plan.copies)} copies")
    boxes = defaultdict(list)
    src_params = {r: {lp.local_name: lp for lp in plan.src.params(r)} for r in plan.src.ranks}
    for r in plan.dst.ranks:
        dst_params = {lp.local_name: lp for lp in plan.dst.params(r)}
        for c in (c for c in plan.copies if c.dst_rank == r):
            s, d = src_params[c.src_rank][c.src_param], dst_params[c.dst_param]
            assert s.global_name == d.global_name == c.name and not s.tied_copy
            assert all(0 <= a < b <= n for (a, b), n in zip(c.src_box, s.local_shape)), c
            assert _logical_box(s, c.src_box) == _logical_box(d, c.dst_box), c
            boxes[r, c.dst_param].append(c.dst_box)
        for z in (z for z in plan.zero_fills if z.rank == r):
            boxes[r, z.param].append(z.box)
        for name, lp in dst_params.items():
            got = boxes[r, name]
            assert _disjoint(got) and sum(math.prod(b - a for a, b in box) for box in got) == math.prod(
                lp.local_shape), (r, name)
    experts = [c for c in plan.copies if EXPERTS in c.name]
    assert len({(c.dst_rank, c.dst_param) for c in experts}) == 48 * 128 * 2  # every expert tensor, once per rank
    assert set(plan.sender_loads()) == set(range(32)) and all(plan.sender_loads().values())


def _ends(cfg, src_layout, dst_layout, seed=3):
    """A plan and both ends' shards made from the reference weights directly: what an arrived push holds."""
    plan = plan_reshard(cfg, src_layout, dst_layout)
    src = {r: {lp.local_name: reference_shard(lp, seed) for lp in plan.src.params(r)} for r in plan.src.ranks}
    dst = {r: {lp.local_name: reference_shard(lp, seed) for lp in plan.dst.params(r)} for r in plan.dst.ranks}
    return plan, src, dst


def test_the_push_check_fingerprints_expert_tensors_and_names_a_stale_one():
    """TP2 x DP2 x EP2 -> TP2 x DP2 with EP2 inside TP: an arrived push passes, every generator expert tensor is
    fingerprinted, and one sampled element of an expert shard left as it was is named with the expert's tensor and
    the trainer rank that sent it."""
    plan, src, dst = _ends(get_preset("tiny", **TINY_MOE), ParallelLayout(tp=2, dp=2, ep=2),
                           ParallelLayout(tp=2, dp=2, ep=2, etp=1))
    dtypes = {k: v for r in dst for k, v in held_dtypes(plan, r, dst[r]).items()}
    held = {(r, n) for r in dst for n in dst[r] if EXPERTS in n}
    assert held and held <= set(dtypes)

    def gathered():
        return [local_fingerprints(plan, r, src.get(r), dst.get(r), dtypes) for r in sorted(set(src) | set(dst))]

    assert mismatches(plan, gathered()) == []
    c = next(c for c in plan.copies if EXPERTS in c.name and c.name.endswith("linear_fc2.weight"))
    row, col = c.dst_box[0][0], c.dst_box[1][0]  # row 0 of a region is sampled
    dst[c.dst_rank][c.dst_param][row, col] += 1.0
    bad = mismatches(plan, gathered())
    assert len(bad) == 1 and bad[0].startswith(f"{c.name}[") and f"generator rank {c.dst_rank}" in bad[0]
    assert f"trainer rank {c.src_rank} sent" in bad[0]


@pytest.fixture(scope="module")
def moe_models():
    """family -> (ModelConfig, logical Megatron weights) of a tiny transformers model."""
    return {family: (cfg, full) for family, (_, cfg, full) in tiny_moe_models().items()}


def test_pushes_from_expert_trainers_are_bit_exact_at_other_generator_layouts(moe_models):
    """Real models on six processes, both families: a trainer at TP2 x DP2 x EP2 (ranks 0-3) pushes into a
    generator at TP1 (rank 4); a trainer at PP2 x DP2 x EP2 (each stage's experts over its DP ranks) into a generator
    at TP2 with EP2 inside TP (ranks 4-5). Every generator tensor changes and equals the logical weights bit for
    bit, expert tensors are among the copies, the per-push check fingerprints them and passes, and the generator
    holds the trainer's step."""
    from megatron_rl.launch.spawn import run_local
    from moe_ddma_workers import push_cases_worker

    layouts = [(dict(tp=2, dp=2, ep=2), dict(tp=1), [4]), (dict(pp=2, dp=2, ep=2), dict(tp=2, ep=2, etp=1), [4, 5])]
    cases, expect = [], []
    for family, (cfg, full) in moe_models.items():
        for trainer, generator, ranks in layouts:
            cases.append((cfg, full, trainer, generator))
            expect.append((family, trainer, generator, ranks))
    t0 = time.perf_counter()
    out = run_local(push_cases_worker, 6, cases)
    print(f"{len(cases)} pushes on 6 processes: {time.perf_counter() - t0:.1f} s")
    for i, (family, trainer, generator, ranks) in enumerate(expect):
        full = moe_models[family][1]
        for rank in range(6):
            if rank not in ranks:
                assert out[rank][i] is None
                continue
            got, unchanged, experts, checked, step = out[rank][i]
            where = f"{family} {trainer} -> {generator}, rank {rank}"
            assert unchanged == [] and experts > 0 and checked > 0 and step == 1, where
            assert got.keys() == full.keys(), where
            assert all(torch.equal(got[k], full[k]) for k in full), where


def test_reshard_check_takes_a_moe_preset_and_expert_layouts(capsys):
    """`megatron-rl reshard-check --model qwen3-30b-a3b` shrunk by `--set` (8 experts), from a trainer's EP over
    DP into a generator with EP over its DP ranks and 8-bit weights: every generator tensor is checked, its expert
    tensors counted (each expert's two once per layer), nothing differs; a layout whose EP does not divide the
    experts is refused in one line before any process starts."""
    import json

    from megatron_rl.cli import main

    sets = [x for kv in ("num_layers=2", "hidden_size=64", "num_attention_heads=4", "num_query_groups=2",
                         "head_dim=16", "ffn_hidden_size=128", "num_moe_experts=8", "moe_ffn_hidden_size=32",
                         "vocab_size=300") for x in ("--set", kv)]
    args = ["reshard-check", "--model", "qwen3-30b-a3b", *sets, "--src", "tp=2,dp=2,ep=2"]
    assert main([*args, "--dst", "tp=1,dp=2,ep=2", "--quantize", "int8"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["mismatches"] == 0 and summary["expert_params_checked"] == 2 * 8 * 2
    assert summary["senders"] == 4
    assert main([*args, "--dst", "tp=1,dp=2,ep=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("megatron-rl reshard-check: generator (destination) layout tp=1,pp=1,dp=2,ep=3 cannot hold the "
                   "model: ep=3 does not divide the 8 experts; etp x ep = 1 x 3 does not divide the 2 ranks of a "
                   "stage (tp x dp = 1 x 2)")
