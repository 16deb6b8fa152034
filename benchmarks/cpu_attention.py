"""The CPU trainer's attention: written out (`models/attention.py`) against the flash kernel it replaces.

    python benchmarks/cpu_attention.py            # one thread, as each rank of the 2-core default job runs

Forward and backward of causal packed attention, one micro-batch, on the default job's shape (tiny: 2 query heads
and 1 KV group per TP2 rank, head dim 16, 64 sequences of 20-64 tokens) and SmolLM2-135M's (9 heads, 3 groups,
head dim 64), in bf16 and fp32. The reference is what SDPAttention did before: one `scaled_dot_product_attention`
call per sequence (the CPU flash kernel). Prints both times and their ratio, then one JSON line per case; the
written-out path is taken where the ratio is below 1 (`WRITTEN_OUT_MAX_LEN`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

# (name, heads, KV groups, head dim, sequences, shortest, longest)
CASES = [("tiny", 2, 1, 16, 64, 20, 64), ("tiny", 2, 1, 16, 32, 64, 128), ("tiny", 2, 1, 16, 16, 128, 256),
         ("smollm2", 9, 3, 64, 16, 32, 64), ("smollm2", 9, 3, 64, 8, 64, 128), ("smollm2", 9, 3, 64, 8, 128, 256),
         ("smollm2", 9, 3, 64, 8, 256, 512)]


def _per_sequence_flash(q, k, v, bounds):
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qq, kk, vv = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    return out


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from megatron_rl.models.attention import WRITTEN_OUT_MAX_LEN, _packed_written_out

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for name, heads, groups, d, n, lo, hi in CASES:
            lengths = torch.randint(lo, hi + 1, (n,), generator=gen)
            bounds = [0, *lengths.cumsum(0).tolist()]
            t = bounds[-1]
            q, k, v = (torch.randn(t, h, d, dtype=dtype, generator=gen).requires_grad_() for h in (heads, groups, groups))
            grad = torch.randn(t, heads, d, dtype=dtype, generator=gen)
            scale = d ** -0.5
            flash = _median_ms(lambda: _per_sequence_flash(q, k, v, bounds).backward(grad), args.repeats)
            written = _median_ms(lambda: _packed_written_out(q, k, v, bounds, scale).backward(grad), args.repeats)
            taken = hi <= WRITTEN_OUT_MAX_LEN[dtype]
            dt = str(dtype).removeprefix("torch.")
            print(f"{name:8s} {dt:8s} {n:3d} x {lo}-{hi} tokens: flash {flash:7.1f} ms, written out {written:7.1f} ms, "
                  f"ratio {written / flash:.2f}{'  (taken)' if taken else ''}")
            emit({"benchmark": "cpu_attention", "shape": name, "dtype": dt, "sequences": n, "lengths": [lo, hi],
                  "flash_ms": round(flash, 2), "written_out_ms": round(written, 2),
                  "ratio": round(written / flash, 3), "taken": taken, "threads": args.threads})
    return 0


if __name__ == "__main__":
    sys.exit(main())
