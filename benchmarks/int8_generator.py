"""The int8 generator's weight memory and decode speed against the same generator in its compute dtype.

    python benchmarks/int8_generator.py     # CPU: tiny and llama-1b (memory), tiny (speed), fp32
    python benchmarks/int8_generator.py --dtype bf16 --memory-cases llama-1b,llama3-8b --speed-cases tiny
                                            # GPU: llama-1b and llama3-8b, bf16, batch 64, 128 + 256 tokens

Memory: bytes of the weights one rank holds (parameters, plus int8 weights and their scales), for a generator
built in the compute dtype and one built by `build_int8_generator`; the reference is the ratio if every weight
were int8 (1 byte against the dtype's size). The vocabulary tensors stay in the compute dtype, so models with
large vocabularies save less. Speed: greedy decode tokens/s of the two on random weights (int8 dequantizes each
layer in the forward, so it is expected to be slower). On a GPU also the peak memory while building each
(`torch.cuda.max_memory_allocated`; the int8 build must stay near its own weight bytes). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, sync  # noqa: E402


def _build(cfg, g, dtype, int8: bool, fill: bool):
    from megatron_rl.inference.quantized import build_int8_generator, weight_bytes
    from megatron_rl.models import build_gpt_model

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if int8:
        model, targets = build_int8_generator(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype)
    else:  # no initialization: only the bytes and the speed matter here
        model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype,
                                config_overrides={"perform_initialization": False})
        targets = {}
    # The most GPU memory the build ever held: the int8 build must never hold the full-precision matrices.
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    if not fill:  # memory only: the allocations are untouched, so even 8B fits a small machine's RAM
        return model, targets, weight_bytes(model, targets), peak
    with torch.no_grad():  # random weights of a sane scale (the same distribution for both)
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
        for w8 in targets.values():
            w8.qweight.copy_(torch.randint(-127, 128, w8.qweight.shape, generator=gen, device=w8.qweight.device))
            w8.scale.fill_(0.02 * 3 / 127)
    return model, targets, weight_bytes(model, targets), peak


def _decode_tokens_per_s(model, cfg, g, batch: int, prompt: int, new: int) -> float:
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams

    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=batch, max_len=prompt + new)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    reqs = [GenerationRequest(p.tolist(), SamplingParams(temperature=0, max_new_tokens=new)) for p in prompts]
    gen.generate(reqs)  # warm-up (cache, decode graph)
    sync()
    t = time.perf_counter()
    outs = gen.generate(reqs)
    sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--memory-cases", default="llama-1b,llama3-8b" if gpu else "tiny,llama-1b")
    p.add_argument("--speed-cases", default="llama-1b,llama3-8b" if gpu else "tiny")
    p.add_argument("--batch", type=int, default=64 if gpu else 16)
    p.add_argument("--prompt", type=int, default=128 if gpu else 32)
    p.add_argument("--new", type=int, default=256 if gpu else 32)
    p.add_argument("--dtype", default="bf16" if gpu else "fp32", choices=["fp32", "bf16"])
    args = p.parse_args(argv)

    import torch.distributed as dist

    from megatron_rl.compat import activate
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    activate()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    g = build_topology([ExecutorPlacement("generator", ParallelLayout())])["generator"]
    dsize = torch.finfo(dtype).bits // 8
    result = {"benchmark": "int8_generator", "device": torch.cuda.get_device_name() if gpu else "cpu",
              "dtype": str(dtype).replace("torch.", "")}
    cases = list(dict.fromkeys(args.memory_cases.split(",") + args.speed_cases.split(",")))
    for name in filter(None, cases):
        cfg = get_preset(name)
        row = {}
        for int8 in (False, True):
            speed = name in args.speed_cases.split(",")
            model, targets, nbytes, peak = _build(cfg, g, dtype, int8, fill=speed)
            key = "int8" if int8 else "dense"
            row[f"{key}_bytes"] = nbytes
            row[f"{key}_build_peak"] = peak
            if speed:
                row[f"{key}_tokens_per_s"] = _decode_tokens_per_s(model, cfg, g, args.batch, args.prompt, args.new)
            del model, targets
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        ratio = row["int8_bytes"] / row["dense_bytes"]
        print(f"{name}: weights {row['dense_bytes'] / 2**20:.1f} MiB {result['dtype']} -> "
              f"{row['int8_bytes'] / 2**20:.1f} MiB int8, ratio {ratio:.3f} (all-int8 reference {1 / dsize:.3f})")
        result[f"{name}_weight_ratio"] = round(ratio, 4)
        result[f"{name}_weight_bytes"] = [row["dense_bytes"], row["int8_bytes"]]
        if row["dense_build_peak"]:
            peak_ratio = row["int8_build_peak"] / row["dense_build_peak"]
            print(f"{name}: peak GPU memory while building {row['dense_build_peak'] / 2**20:.0f} MiB "
                  f"{result['dtype']}, {row['int8_build_peak'] / 2**20:.0f} MiB int8, ratio {peak_ratio:.3f} "
                  f"(weights alone: {ratio:.3f})")
            result[f"{name}_build_peak_bytes"] = [row["dense_build_peak"], row["int8_build_peak"]]
            result[f"{name}_build_peak_ratio"] = round(peak_ratio, 4)
        if "int8_tokens_per_s" in row:
            speed = row["int8_tokens_per_s"] / row["dense_tokens_per_s"]
            print(f"{name}: decode {row['dense_tokens_per_s']:.0f} tok/s {result['dtype']}, "
                  f"{row['int8_tokens_per_s']:.0f} tok/s int8, ratio {speed:.3f}")
            result[f"{name}_decode_speed_ratio"] = round(speed, 4)
    dist.destroy_process_group()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
