"""Our GPTModel builder against transformers' Llama (the independent reference) on the same weights."""

import pytest
import torch

from megatron_rl.launch.spawn import run_local

transformers = pytest.importorskip("transformers")

CASES = {
    "gqa-untied-llama3-rope": dict(tie=False, rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "gqa-tied": dict(tie=True, rope=None),
}


def _hf_model(tie, rope):
    cfg = transformers.LlamaConfig(
        vocab_size=311, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tie, rope_scaling=rope, attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # make the norms non-trivial
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours_worker(rank, world_size, model_cfg, logical, tokens, layout_kw):
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    g = build_topology([ExecutorPlacement("x", ParallelLayout(**layout_kw))])["x"]
    model = build_gpt_model(model_cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, logical, model_cfg, g.pgs)
    with torch.no_grad():
        logits = model_forward(model, tokens, False)
    shards = [torch.empty_like(logits) for _ in range(g.layout.tp)]
    torch.distributed.all_gather(shards, logits.contiguous(), group=g.pgs.tp)
    return torch.cat(shards, -1)[..., : model_cfg.vocab_size]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_llama(case):
    from megatron_rl.models.hf_mapping import hf_to_megatron, megatron_to_hf, model_config_from_hf

    hf = _hf_model(CASES[case]["tie"], CASES[case]["rope"])
    cfg = model_config_from_hf(hf.config)
    assert cfg.rope_scaling == (CASES[case]["rope"] is not None)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    logical = hf_to_megatron(sd, cfg)
    back = megatron_to_hf(logical, cfg)
    for k, v in sd.items():
        if "rotary" not in k:
            assert torch.equal(back[k], v), k
    tokens = torch.randint(0, 311, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits
    for layout in (dict(tp=1), dict(tp=2)):
        got = run_local(_ours_worker, layout["tp"], cfg, logical, tokens, layout)[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{layout}: {m}")
