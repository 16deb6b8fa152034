"""SDPA core attention against Megatron-Core's local DotProductAttention and a plain reference."""

import math

import torch

from megatron_rl.launch.spawn import run_local


def _model_worker(rank, world_size):
    from megatron_rl.models import build_gpt_model, get_preset
    from full_state import gather_full_state_dict
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("x", ParallelLayout())])["x"]
    sdpa = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    local = build_gpt_model(cfg, g.layout, g.pgs, attention="local")
    load_full_state_dict(local, gather_full_state_dict(sdpa, cfg, g.pgs), cfg, g.pgs)
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model_forward(sdpa, tokens, False), model_forward(local, tokens, True)



def test_gpt_with_sdpa_equals_gpt_with_local_attention():
    a, b = run_local(_model_worker, 1)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _reference_attention(q, k, v, scale):
    # q [sq, b, h, d], k/v [sk, b, g, d]; queries are the last sq positions.
    sq, sk = q.shape[0], k.shape[0]
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    allowed = torch.arange(sk)[None, :] <= torch.arange(sk - sq, sk)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(sq, q.shape[1], -1)


def _core_worker(rank, world_size):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.presets import get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("x", ParallelLayout())])["x"]
    cfg = transformer_config(get_preset("tiny"), g.layout)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=g.pgs)
    torch.manual_seed(0)
    out = {}
    for sq, sk in ((7, 7), (1, 9), (3, 9)):  # prefill, one decode step, a chunk against a cache
        q = torch.randn(sq, 2, 4, 16)
        k = torch.randn(sk, 2, 2, 16)
        v = torch.randn(sk, 2, 2, 16)
        out[(sq, sk)] = (attn(q, k, v, None), _reference_attention(q, k, v, 1 / math.sqrt(16)))
    return out


def test_sdpa_core_attention_is_causal_with_gqa_and_kv_cache_offsets():
    for key, (got, want) in run_local(_core_worker, 1)[0].items():
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
