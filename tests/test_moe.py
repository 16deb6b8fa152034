"""Mixture-of-experts models (Qwen3-MoE, Mixtral): Megatron-Core's MoE layers under tensor and expert parallelism
against transformers' own classes."""

import pytest
import torch

from tiny_hf import MOE_CONFIGS, file_state_dict, tiny_family_model


@pytest.fixture(scope="module")
def moe_models():
    """family -> (transformers model, ModelConfig, logical Megatron weights)."""
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    out = {}
    for family in MOE_CONFIGS:
        hf = tiny_family_model(family)
        cfg = model_config_from_hf(hf.config, name=family)
        out[family] = hf, cfg, hf_to_megatron(file_state_dict(hf), cfg)
    return out


@pytest.mark.parametrize("layout", [dict(tp=2, dp=2, ep=2), dict(tp=2, ep=2, etp=1)], ids=["trainer", "in-tp"])
def test_logits_at_tp2_ep2_match_transformers(moe_models, layout):
    """TP2 x DP2 x EP2 (a trainer's layout: each rank holds 2 of the 4 experts, each split over 2 TP ranks) and
    TP2 with EP2 inside TP (a generator's: each TP rank holds 2 whole experts): the weights gathered back are the
    loaded ones bit for bit, and every rank's logits equal transformers' within the dense families' bound. The MoE
    layer splits its tokens over TP itself (`models.moe.TokenSplitMoELayer`)."""
    from megatron_rl.launch.spawn import run_local
    from moe_workers import logits_worker

    tokens = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(3))  # 21 tokens: TP pads one
    cases = [(cfg, full) for _, cfg, full in moe_models.values()]
    results = run_local(logits_worker, layout["tp"] * layout.get("dp", 1), cases, tokens, layout)
    for i, family in enumerate(moe_models):
        with torch.no_grad():
            want = moe_models[family][0](tokens).logits
        for rank, per_rank in enumerate(results):
            same, logits = per_rank[i]
            assert same, (family, rank)
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0, msg=lambda m: f"{family} rank {rank}: {m}")
