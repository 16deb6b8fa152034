"""Streaming checkpoint conversion: time, throughput and peak memory of HF -> Megatron -> HF.

    python benchmarks/convert.py                      # hidden 1024, 8 layers (~640 MB in float32)
    python benchmarks/convert.py --tp 1 2             # also write the Megatron checkpoint with 2 processes

A random transformers Llama (hidden 1024, 8 layers, 16 heads / 8 KV heads, ffn 2816, vocab 32,000, untied,
float32) is saved as HF safetensors in a temporary directory, then converted by `megatron-rl convert` (one
subprocess per direction, as a user runs it): HF -> Megatron at each --tp, and Megatron -> HF. Peak memory is
measured where the work happens (the writing ranks for HF -> Megatron, the command itself for Megatron -> HF): the
peak resident set (VmHWM) minus the resident set when the conversion starts (torch, Megatron-Core imported),
as a ratio of the model's bytes. The issue's bar: well under 2 (two copies of the model). The bit-exact round
trip is checked too. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def _make_hf(d: Path, hidden: int, layers: int, ffn: int, vocab: int) -> int:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                   max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(d, safe_serialization=True, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _convert(*args) -> tuple[dict, float]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", *map(str, args)],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"convert {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), wall


def _same(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    out[k] = (f, k)
        return out

    ta, tb = tensors(a), tensors(b)
    if set(ta) != set(tb):
        return False
    import torch

    for k in ta:
        with safe_open(ta[k][0], framework="pt") as fa, safe_open(tb[k][0], framework="pt") as fb:
            if not torch.equal(fa.get_tensor(k), fb.get_tensor(k)):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="HF -> Megatron with these TP sizes")
    args = p.parse_args()
    result: dict = {"benchmark": "convert", "hidden": args.hidden, "layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        tmp = Path(tmp)
        model_bytes = _make_hf(tmp / "hf", args.hidden, args.layers, args.ffn, args.vocab)
        result["model_mb"] = round(model_bytes / 2**20, 1)
        print(f"model: {model_bytes / 2**20:.1f} MiB of float32 weights in {tmp / 'hf'}", flush=True)
        for tp in args.tp:
            s, wall = _convert(tmp / "hf", tmp / f"mcore_tp{tp}", "--to", "megatron", "--tp", tp)
            m = s["memory"]
            extra = max(pk - b for pk, b in zip(m["rank_peak_rss_mb"], m["rank_base_rss_mb"]))
            row = {"seconds": s["seconds"], "wall_seconds": round(wall, 2),
                   "mb_per_s": round(model_bytes / 2**20 / s["seconds"], 1),
                   "rank_peak_rss_mb": max(m["rank_peak_rss_mb"]), "rank_base_rss_mb": max(m["rank_base_rss_mb"]),
                   "peak_over_model": round(extra * 2**20 / model_bytes, 3),
                   "parent_peak_over_model": round((m["parent_peak_rss_mb"] - m["parent_base_rss_mb"]) * 2**20
                                                   / model_bytes, 3)}
            result[f"hf_to_megatron_tp{tp}"] = row
            print(f"HF -> Megatron, tp={tp}: {row['seconds']:.1f} s ({row['mb_per_s']} MiB/s, {wall:.1f} s with "
                  f"startup), peak per rank +{extra:.0f} MiB over {row['rank_base_rss_mb']:.0f} MiB at start = "
                  f"{row['peak_over_model']:.2f} x model", flush=True)
        s, wall = _convert(tmp / f"mcore_tp{args.tp[0]}", tmp / "back", "--to", "hf")
        m = s["memory"]
        extra = m["peak_rss_mb"] - m["base_rss_mb"]
        row = {"seconds": s["seconds"], "wall_seconds": round(wall, 2),
               "mb_per_s": round(model_bytes / 2**20 / s["seconds"], 1), "peak_rss_mb": m["peak_rss_mb"],
               "base_rss_mb": m["base_rss_mb"], "peak_over_model": round(extra * 2**20 / model_bytes, 3),
               "shards": s["shards"]}
        result["megatron_to_hf"] = row
        print(f"Megatron -> HF: {row['seconds']:.1f} s ({row['mb_per_s']} MiB/s, {wall:.1f} s with startup), "
              f"peak +{extra:.0f} MiB over {row['base_rss_mb']:.0f} MiB at start = {row['peak_over_model']:.2f} x "
              f"model", flush=True)
        result["round_trip_bit_exact"] = _same(tmp / "hf", tmp / "back")
        print(f"round trip bit for bit: {result['round_trip_bit_exact']}", flush=True)
    emit(result)


if __name__ == "__main__":
    main()
