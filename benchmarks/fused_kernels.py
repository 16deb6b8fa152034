"""The fused kernels of `megatron_rl.models.fused` against the unfused paths they replace, one op at a time.

    python benchmarks/fused_kernels.py          # GPU: the 1B training shapes (8 x 2048 tokens) and a decode step

RMSNorm: torch.nn.RMSNorm as Megatron-Core's local spec runs it (bf16 input, fp32 weight: torch's composite path),
ours (that arithmetic compiled) and torch's fused kernel reached by casting the weight to bf16. RoPE: Megatron-Core's
`_apply_rotary_pos_emb_bshd` and ours, on queries and on keys (a strided view of the fused QKV output). Each timed
forward and forward + backward (median over iterations, CUDA events); max |difference| to the unfused path in bf16
and fp32. Decode attention (one token per slot against a bf16 cache): SDPA with GQA and a mask (what the generator
runs), SDPA on the folded layout (a group's query heads as rows) and two batched matmuls around a compiled masked
softmax, timed inside CUDA graphs.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        import time

        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _fwd_bwd(fn, *inputs):
    def run():
        for t in inputs:
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))
    return run


def _max_diff(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def bench_rmsnorm(tokens, hidden, device, iters, res):
    from megatron_rl.models.fused import rms_norm

    eps = 1e-5
    for dtype in (torch.bfloat16, torch.float32):
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(tokens, hidden, generator=g) * 2).to(device, dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device).requires_grad_()  # fp32, as in the model
        ref = lambda: F.rms_norm(x, (hidden,), w, eps)  # noqa: E731  (torch.nn.RMSNorm in Megatron's local spec)
        variants = {"ours": lambda: rms_norm(x, w, eps),  # noqa: E731  (the default: compiled on GPUs)
                    "torch_kernel": lambda: rms_norm(x, w, eps, impl="torch")}  # noqa: E731  (weight cast to bf16)
        y_ref = ref()
        gy = torch.randn_like(y_ref)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), gy)
        for name, fn in variants.items():
            y = fn()
            gx, gw = torch.autograd.grad(y, (x, w), gy)
            res[f"rmsnorm_{name}_{tag}_max_diff"] = _max_diff(y, y_ref)
            res[f"rmsnorm_{name}_{tag}_grad_x_max_diff"] = _max_diff(gx, gx_ref)
            res[f"rmsnorm_{name}_{tag}_grad_w_rel_diff"] = _max_diff(gw, gw_ref) / float(gw_ref.abs().max())
        if dtype != torch.bfloat16:
            continue
        variants["torch_fp32_weight"] = ref
        for name, fn in variants.items():
            with torch.no_grad():
                res[f"rmsnorm_fwd_ms_{name}"] = _time_ms(fn, iters)
            res[f"rmsnorm_fwd_bwd_ms_{name}"] = _time_ms(_fwd_bwd(fn, x, w), iters)


def bench_rope(seq, batch, heads, groups, head_dim, device, iters, res):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_rl.models.fused import apply_rope

    per = heads // groups
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), -1)[:, None, None, :].to(device)
    for dtype in (torch.bfloat16, torch.float32):
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        g = torch.Generator(device="cpu").manual_seed(1)
        qkv = torch.randn(seq, batch, groups, (per + 2) * head_dim, generator=g).to(device, dtype).requires_grad_()
        q, k, _ = torch.split(qkv, [per * head_dim, head_dim, head_dim], dim=3)
        q = q.reshape(seq, batch, heads, head_dim)  # a copy, as in Megatron's get_query_key_value_tensors
        for name, t in (("q", q), ("k", k)):
            ref = lambda t=t: _apply_rotary_pos_emb_bshd(t, freqs)  # noqa: E731
            ours = lambda t=t: apply_rope(t, freqs)  # noqa: E731
            y_ref, y = ref(), ours()
            gy = torch.randn_like(y_ref)
            (g_ref,), (g_ours,) = torch.autograd.grad(y_ref, (qkv,), gy), torch.autograd.grad(y, (qkv,), gy)
            res[f"rope_{name}_{tag}_max_diff"] = _max_diff(y, y_ref)
            res[f"rope_{name}_{tag}_grad_max_diff"] = _max_diff(g_ours, g_ref)
            if dtype != torch.bfloat16:
                continue
            with torch.no_grad():
                res[f"rope_{name}_fwd_ms_megatron"] = _time_ms(ref, iters)
                res[f"rope_{name}_fwd_ms_ours"] = _time_ms(ours, iters)
            res[f"rope_{name}_fwd_bwd_ms_megatron"] = _time_ms(_fwd_bwd(ref, qkv), iters)
            res[f"rope_{name}_fwd_bwd_ms_ours"] = _time_ms(_fwd_bwd(ours, qkv), iters)


def _graph_time_us(fn, reps: int = 20) -> float:
    """Per-call time of fn replayed inside a CUDA graph (as the decode step runs): no launch overhead."""
    if not torch.cuda.is_available():
        return _time_ms(fn, reps) * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return _time_ms(graph.replay, 10) * 1e3 / reps


def _bmm_attention(q, keys, values, attend, scale):
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    probs = torch.softmax(scores.masked_fill(~attend, float("-inf")), dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


@torch.no_grad()
def bench_decode_attention(batch, heads, groups, head_dim, cache_len, device, iters, res):
    """One decode step's cache attention: SDPA with GQA and a mask (what `kv_forward` runs), SDPA on the folded
    layout (query heads of a group as rows, no GQA) and two batched matmuls around a compiled masked softmax.
    Timed inside CUDA graphs."""
    per = heads // groups
    g = torch.Generator(device="cpu").manual_seed(2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, batch, heads, head_dim, generator=g).to(device, dtype)
    keys = torch.randn(batch, groups, cache_len, head_dim, generator=g).to(device, dtype)
    values = torch.randn(batch, groups, cache_len, head_dim, generator=g).to(device, dtype)
    positions = torch.randint(0, cache_len, (batch, 1), generator=g).to(device)
    attend = (torch.arange(cache_len, device=device)[None, None, :] <= positions[:, :, None])[:, None]
    scale = head_dim ** -0.5
    bmm = torch.compile(_bmm_attention) if device.type == "cuda" else _bmm_attention

    def gqa():
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=attend, scale=scale,
                                             enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(1, batch, -1)

    def folded():
        out = F.scaled_dot_product_attention(q.view(batch, groups, per, head_dim), keys, values, attn_mask=attend,
                                             scale=scale)
        return out.reshape(1, batch, -1)

    def bmm_softmax():
        return bmm(q.view(batch, groups, per, head_dim), keys, values, attend, scale).reshape(1, batch, -1)

    ref = gqa()
    cache_bytes = 2 * keys.numel() * keys.element_size()
    for name, fn in (("sdpa_gqa_masked", gqa), ("sdpa_folded", folded), ("bmm_softmax", bmm_softmax)):
        if name != "sdpa_gqa_masked":
            res[f"decode_attention_{name}_max_diff"] = _max_diff(fn(), ref)
        us = _graph_time_us(fn)
        res[f"decode_attention_us_{name}"] = us
        res[f"decode_attention_cache_read_tb_s_{name}"] = cache_bytes / (us * 1e-6) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--seq", type=int, default=2048 if gpu else 64)
    p.add_argument("--batch", type=int, default=8 if gpu else 2)
    p.add_argument("--hidden", type=int, default=2048 if gpu else 128)
    p.add_argument("--heads", type=int, default=32 if gpu else 4)
    p.add_argument("--groups", type=int, default=8 if gpu else 2)
    p.add_argument("--decode-batch", type=int, default=64 if gpu else 4)
    p.add_argument("--cache-len", type=int, default=384 if gpu else 64)
    p.add_argument("--iters", type=int, default=50 if gpu else 5)
    args = p.parse_args(argv)
    device = torch.device("cuda" if gpu else "cpu")
    head_dim = args.hidden // args.heads
    res = {"benchmark": "fused_kernels", "device": torch.cuda.get_device_name() if gpu else "cpu",
           "tokens": args.seq * args.batch, "hidden": args.hidden}
    bench_rmsnorm(args.seq * args.batch, args.hidden, device, args.iters, res)
    bench_rope(args.seq, args.batch, args.heads, args.groups, head_dim, device, args.iters, res)
    bench_decode_attention(args.decode_batch, args.heads, args.groups, head_dim, args.cache_len, device, args.iters,
                           res)
    for k, v in res.items():
        if isinstance(v, float):
            res[k] = float(f"{v:.4g}")
    emit(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
