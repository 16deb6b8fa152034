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


def _per_sequence_reference(q, k, v, bounds, scale):
    """Causal attention within each packed sequence (THD [t, heads, d]), one `_reference_attention` each, in fp64;
    rows outside every sequence zero."""
    out = torch.zeros(q.shape[0], q.shape[1] * v.shape[-1], dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            out[a:b] = _reference_attention(*(x[a:b, None].double() for x in (q, k, v)), scale)[:, 0]
    return out


def test_packed_attention_written_out_equals_each_sequence_alone_with_its_gradients():
    """The CPU path's written-out attention over packed sequences (grouped by length, padded, GQA folded): outputs
    and gradients equal each sequence attended alone, for lengths that fall in several groups, an empty sequence
    and rows after the last sequence (zero, and no gradient)."""
    from megatron_rl.models.attention import _length_groups, _packed_written_out

    torch.manual_seed(0)
    lengths = [5, 1, 17, 0, 30, 29, 64, 3, 40]
    assert len(_length_groups(lengths)) > 2  # the case covers several padded groups
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = bounds[-1] + 3
    q, k, v = (torch.randn(t, h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    grad = torch.randn(t, 4, 16, dtype=torch.float64)
    got = _packed_written_out(q, k, v, bounds, 0.25)
    got.backward(grad)
    got_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = _per_sequence_reference(q, k, v, bounds, 0.25)
    want.backward(grad.reshape(t, -1))
    torch.testing.assert_close(got.reshape(t, -1), want, atol=1e-12, rtol=0)
    for name, a, b in zip("qkv", got_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m: f"grad {name}: {m}")
    assert not got[bounds[-1]:].any() and not got_grads[0][bounds[-1]:].any()


def test_the_cpu_writes_short_attention_out_and_leaves_long_sequences_to_the_flash_kernel(monkeypatch):
    """SDPAttention on the CPU: bf16 sequences of 40 tokens, packed or padded, never call the SDPA kernel (its
    per-GEMM set-up is what the written-out path avoids); fp32 sequences over the fp32 limit do, and so does a padded
    batch of very short rows (one call in one query block); every path agrees with the reference."""
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models import attention
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.presets import get_preset
    from megatron_rl.parallel import ParallelLayout

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    attn = attention.SDPAttention(transformer_config(get_preset("tiny"), ParallelLayout()), 1, AttnMaskType.causal,
                                  "self", pg_collection=_OneRank())
    torch.manual_seed(0)
    limit, short = attention.WRITTEN_OUT_MAX_LEN[torch.float32], attention.FLASH_PADDED_MAX_LEN
    # (dtype, tokens a row, whether the padded batch calls the kernel, whether the packed one does)
    cases = ((torch.bfloat16, 40, False, False), (torch.float32, limit, False, False),
             (torch.float32, limit + 1, True, True), (torch.bfloat16, short, True, False))
    for dtype, s, padded_kernel, packed_kernel in cases:
        q, k, v = (torch.randn(s, 2, h, 16, dtype=dtype) for h in (4, 2, 2))
        calls.clear()
        padded = attn(q, k, v, None)
        assert bool(calls) == padded_kernel, (dtype, s, "padded")
        calls.clear()
        bounds = [0, s // 3, s, 2 * s]
        packed = attn(*(x.transpose(0, 1).reshape(2 * s, h, 16) for x, h in ((q, 4), (k, 2), (v, 2))), None,
                      packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(bounds),
                                                        cu_seqlens_kv=torch.tensor(bounds)))
        assert bool(calls) == packed_kernel, (dtype, s, "packed")
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        want = _reference_attention(q.double(), k.double(), v.double(), 0.25)
        torch.testing.assert_close(padded.double(), want, **tol)
        flat = [x.transpose(0, 1).reshape(2 * s, -1, 16) for x in (q, k, v)]
        torch.testing.assert_close(packed.double(), _per_sequence_reference(*flat, bounds, 0.25), **tol)


class _OneRank:
    """A one-rank stand-in for the tensor-parallel group (SDPAttention reads only its size)."""

    class tp:
        @staticmethod
        def size():
            return 1
