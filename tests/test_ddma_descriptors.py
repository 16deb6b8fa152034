"""DDMA's config-only parameter descriptors agree with real GPTModel stages (describe_params)."""

import pytest
import torch

from megatron_rl.ddma.descriptors import (
    ModelShape,
    check_layout,
    check_same_architecture,
    logical_params,
    stage_params,
)
from megatron_rl.ddma.verify import count_mismatches, logical_indices, reference_shard
from megatron_rl.models import get_preset
from megatron_rl.parallel import ParallelLayout
from megatron_rl.launch.spawn import run_local
from ddma_workers import describe_worker

CASES = [
    ({}, dict(tp=2, pp=2)),
    ({"tie_word_embeddings": True}, dict(tp=2, pp=2)),
    ({"tie_word_embeddings": True}, dict(tp=1, pp=1, dp=4)),
    ({"num_query_groups": 4}, dict(tp=4)),
    ({"tie_word_embeddings": True, "vocab_size": 250}, dict(tp=1, pp=4)),
    # Qwen2's QKV bias (split with the QKV rows), Qwen3's q/k norms (replicated) on heads wider than hidden/heads
    ({"family": "qwen2", "tie_word_embeddings": True}, dict(tp=2, pp=2)),
    ({"family": "qwen3", "head_dim": 32}, dict(tp=2, pp=2)),
    # Mixtures of experts: EP over DP ranks with each expert split over TP (a trainer's), EP inside TP with whole
    # experts (a generator's), EP with pipeline stages.
    ({"family": "mixtral", "num_moe_experts": 4, "moe_ffn_hidden_size": 48}, dict(tp=2, dp=2, ep=2)),
    ({"family": "qwen3_moe", "head_dim": 32, "num_moe_experts": 4, "moe_ffn_hidden_size": 48},
     dict(tp=2, dp=2, ep=2, etp=1)),
    ({"family": "mixtral", "num_moe_experts": 4, "moe_ffn_hidden_size": 48}, dict(pp=2, dp=2, ep=2)),
    # expert-data-parallel copies (DP4 x EP2: each expert on two ranks), a generator's EP inside TP with pipeline
    # stages, and expert TP over DP ranks (etp=2 at tp=1)
    ({"family": "qwen3_moe", "head_dim": 32, "num_moe_experts": 4, "moe_ffn_hidden_size": 48}, dict(dp=4, ep=2)),
    ({"family": "mixtral", "num_moe_experts": 4, "moe_ffn_hidden_size": 48}, dict(tp=2, pp=2, ep=2, etp=1)),
    ({"family": "mixtral", "num_moe_experts": 4, "moe_ffn_hidden_size": 48}, dict(dp=4, ep=2, etp=2)),
]


@pytest.fixture(scope="module")
def described():
    return run_local(describe_worker, 4, CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_descriptors_match_real_models(described, i):
    preset_kw, layout_kw = CASES[i]
    cfg = get_preset("tiny", **preset_kw)
    layout = ParallelLayout(**layout_kw)
    for per_rank in described:
        real = per_rank[i]
        tp_rank, pp_rank, dp_rank = real["coords"]
        mine = stage_params(cfg, layout, pp_rank, tp_rank, dp_rank)
        assert [lp.local_name for lp in mine] == list(real["shapes"])  # same names, same order
        by_name = {d.local_name: d for d in real["shards"]}
        for lp in mine:
            d = by_name[lp.local_name]
            assert lp.local_shape == real["shapes"][lp.local_name]
            assert (lp.global_name, lp.param.shape, lp.param.partition_dim, lp.param.partition_stride,
                    lp.param.is_vocab, lp.tied_copy) == (d.global_name, d.full_shape, d.partition_dim,
                                                          d.partition_stride, d.is_vocab, d.tied_copy)
            # The block map agrees with sharding.py's slicing (an independent implementation).
            full = torch.randn(d.full_shape, generator=torch.Generator().manual_seed(len(lp.global_name)))
            padded = cfg.padded_vocab_size(layout.tp) if d.is_vocab else None
            expected = d.slice_of(full, padded)
            flat, valid = logical_indices(lp)
            got = torch.where(valid, full.reshape(-1)[flat.clamp(max=full.numel() - 1)], torch.zeros(()))
            assert torch.equal(got, expected), lp.local_name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logical_params_cover_the_model_once(family):
    for tied in (False, True):
        cfg = get_preset("tiny", tie_word_embeddings=tied, family=family)
        total = sum(p.numel for p in logical_params(cfg))
        # num_parameters counts padded vocabulary rows at TP=1
        pad_rows = cfg.padded_vocab_size(1) - cfg.vocab_size
        assert total == cfg.num_parameters(1) - pad_rows * cfg.hidden_size * (1 if tied else 2)


def test_layouts_that_cannot_hold_the_model_fail_in_one_line():
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match=r"^trainer layout tp=4,pp=3,dp=1 cannot hold the model: tp=4 does not "
                                         r"divide the query groups \(2\); pp=3 does not divide the 4 layers$"):
        check_layout(cfg, ParallelLayout(tp=4, pp=3), "trainer")
    with pytest.raises(ValueError, match=r"^trainer and generator models differ: hidden_size 64 vs 128"):
        check_same_architecture(cfg, get_preset("tiny", hidden_size=128))
    # only the padding rule may differ
    check_same_architecture(cfg, get_preset("tiny", make_vocab_size_divisible_by=64))
    assert ModelShape.of(cfg) == ModelShape.of(ModelShape.of(cfg))


def test_expert_layouts_that_cannot_hold_the_model_fail_in_one_line():
    """EP / ETP on a dense model, an EP that does not divide the experts, an ETP that does not divide an expert's
    width, an expert grid that does not tile a stage's ranks: one line each, naming the numbers."""
    moe = get_preset("tiny", family="mixtral", num_moe_experts=4, moe_ffn_hidden_size=48)
    for cfg, layout, message in [
            (get_preset("tiny"), ParallelLayout(tp=2, dp=2, ep=2), "ep=2 needs a mixture-of-experts model"),
            (get_preset("tiny"), ParallelLayout(tp=2, etp=1), "etp=1 needs a mixture-of-experts model"),
            (moe, ParallelLayout(dp=3, ep=3), "ep=3 does not divide the 4 experts"),
            (moe, ParallelLayout(tp=1, dp=5, etp=5), r"etp=5 does not divide the experts' FFN hidden size \(48\)"),
            (moe, ParallelLayout(tp=2, ep=2),
             r"etp x ep = 2 x 2 does not divide the 2 ranks of a stage \(tp x dp = 2 x 1\)"),
            (moe, ParallelLayout(ep=0), "ep=0 must be >= 1")]:
        with pytest.raises(ValueError, match=rf"^generator layout {layout} cannot hold the model: .*{message}"):
            check_layout(cfg, layout, "generator")
        with pytest.raises(ValueError) as e:
            check_layout(cfg, layout, "generator")
        assert "\n" not in str(e.value)
    check_layout(moe, ParallelLayout(tp=2, dp=2, ep=2))  # a trainer's
    check_layout(moe, ParallelLayout(tp=2, dp=2, ep=2, etp=1))  # a generator's


def test_reference_shard_is_bit_stable_and_zero_on_padding():
    cfg = get_preset("tiny")
    lp = [p for p in stage_params(cfg, ParallelLayout(tp=2), 0, 1) if p.param.is_vocab][0]
    a, b = reference_shard(lp, seed=3), reference_shard(lp, seed=3)
    assert count_mismatches(a, b) == 0
    rows_real = cfg.vocab_size - 256  # rank 1 of TP2 holds rows 256..511 of the 512 padded rows
    assert count_mismatches(a, reference_shard(lp, seed=4)) > 0.99 * rows_real * cfg.hidden_size
    assert torch.all(a[rows_real:] == 0) and torch.all(a[:rows_real] != 0)
    assert a.abs().max() <= 1 / 16
