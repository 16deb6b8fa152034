"""Time one training step (forward, backward, distributed-optimizer step) of a preset in a layout.

    python benchmarks/train_step.py                               # tiny, TP=2 on CPU (2 processes, gloo)
    python benchmarks/train_step.py --preset llama-1b --attention sdpa --micro-batch 4 --seq 2048   # one GPU

Prints tokens/s and model TFLOP/s (and MFU against the device's bf16 peak on a GPU), then one JSON line.
The step is the trainer's real step (TrainEngine with Megatron-Core DDP, distributed optimizer, pipeline
schedule) with next-token cross entropy; the RL loss costs the same matmuls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, peak_tflops, timed, training_flops_per_token  # noqa: E402


def _bench(rank, world_size, args):
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import TrainEngine
    from megatron_rl.training.settings import LRSchedule, TrainerSettings
    from megatron_rl.training.lm_loss import make_lm_loss

    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.dp)
    cfg = get_preset(args.preset)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    overrides = {"bias_activation_fusion": args.fuse_swiglu}
    model = build_gpt_model(cfg, layout, g.pgs, attention=args.attention, params_dtype=dtype,
                            config_overrides=overrides, fusions=args.fusions)
    if args.loss == "rl":
        step_fn = _rl_step_fn(model, cfg, g, args)
    else:
        engine = TrainEngine.create(model, g.pgs, TrainerSettings(), LRSchedule(lr=1e-5))
        loss_fn = make_lm_loss(g.pgs.tp, cfg.vocab_size)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator().manual_seed(g.dp_rank)
        micro = [{"tokens": torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=gen).to(device),
                  "loss_mask": torch.ones(args.micro_batch, args.seq, device=device)}
                 for _ in range(args.num_micro)]

        def step_fn():
            engine.step(micro, loss_fn)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = timed(step_fn, args.steps, args.warmup)
    if args.profile and rank == 0:
        _profile(step_fn)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"times": times, "peak_mem_gib": peak_mem}


def _rl_step_fn(model, cfg, g, args):
    """The trainer executor's AIPO step on a synthetic rollout batch (prompt = first quarter of each sequence)."""
    from megatron_rl.algorithms import compute_advantages
    from megatron_rl.rollout import RolloutBatch
    from megatron_rl.training.settings import LRSchedule, TrainerSettings
    from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings

    n = args.micro_batch * args.num_micro * args.dp
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (n, args.seq), generator=gen)
    prompt = torch.full((n,), args.seq // 4)
    response = torch.full((n,), args.seq - args.seq // 4)
    mask = torch.arange(args.seq)[None] >= prompt[:, None]
    logp_mu = torch.where(mask, -torch.rand(n, args.seq, generator=gen) * 8, torch.zeros(n, args.seq))
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    groups = torch.arange(n) // 4
    batch = RolloutBatch(tokens, prompt, response, logp_mu, rewards, groups, torch.zeros(n, dtype=torch.long))
    batch.advantages = compute_advantages(rewards, groups, "group_mean")
    trainer = RLTrainer(model, cfg, g, RLTrainerSettings(TrainerSettings(micro_batch_size=args.micro_batch),
                                                         schedule=LRSchedule(lr=1e-6)))
    return lambda: trainer.step(batch)


def _profile(step_fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step_fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--preset", default="llama-1b" if gpu else "tiny")
    p.add_argument("--tp", type=int, default=1 if gpu else 2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "local", "te"])
    p.add_argument("--dtype", default="bf16" if gpu else "fp32", choices=["fp32", "bf16"])
    p.add_argument("--micro-batch", type=int, default=8 if gpu else 4)
    p.add_argument("--num-micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024 if gpu else 128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--loss", default="lm", choices=["lm", "rl"],
                   help="lm: next-token cross entropy; rl: the trainer's AIPO step on a synthetic rollout batch")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one profiled step")
    p.add_argument("--fuse-swiglu", action=argparse.BooleanOptionalAction, default=gpu,
                   help="Megatron-Core's torch.compile'd SwiGLU (bias_activation_fusion); default: on GPUs")
    p.add_argument("--fusions", default="auto",
                   help="build_gpt_model's fusions: auto (all on GPUs, none on CPUs), none, or a comma list of "
                        "rmsnorm, rope")
    args = p.parse_args(argv)

    from megatron_rl.models import get_preset
    from megatron_rl.models.builder import resolve_attention_backend
    from megatron_rl.models.fused import resolve_fusions
    from megatron_rl.parallel import ParallelLayout

    world = ParallelLayout(args.tp, args.pp, args.dp).size
    args.attention = resolve_attention_backend(args.attention)
    result = {"benchmark": "train_step", "loss": args.loss, "preset": args.preset, "tp": args.tp, "pp": args.pp, "dp": args.dp,
              "attention": args.attention, "dtype": args.dtype, "fuse_swiglu": args.fuse_swiglu,
              "fusions": ",".join(sorted(resolve_fusions(args.fusions))) or "none", "micro_batch": args.micro_batch,
              "num_micro": args.num_micro, "seq": args.seq,
              "device": torch.cuda.get_device_name() if gpu else "cpu"}
    try:
        if gpu:
            if world != 1:
                raise SystemExit("on a GPU this script runs one rank; use torchrun for more")
            import torch.distributed as dist

            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            torch.cuda.set_device(0)
            out = _bench(0, 1, args)
            dist.destroy_process_group()
        else:
            from megatron_rl.launch.spawn import run_local

            out = run_local(_bench, world, args)[0]
    except torch.OutOfMemoryError as e:
        result.update(status="out_of_memory", error=str(e).splitlines()[0][:200])
        emit(result)
        return 1
    step = statistics.median(out["times"])
    tokens = args.micro_batch * args.num_micro * args.seq * args.dp
    cfg = get_preset(args.preset)
    tflops = training_flops_per_token(cfg, args.seq) * tokens / step / 1e12
    result.update(status="ok", step_s=round(step, 4), tokens_per_s=round(tokens / step, 1),
                  model_tflops_per_gpu=round(tflops / world, 4), peak_mem_gib=out["peak_mem_gib"])
    peak = peak_tflops()
    if peak:
        result["mfu"] = round(tflops / world / peak, 4)
        result["peak_tflops"] = peak
    print(f"{args.preset} {args.attention} tp={args.tp} pp={args.pp} dp={args.dp} {tokens} tokens/step: "
          f"{step * 1e3:.1f} ms/step, {tokens / step:,.0f} tokens/s, {tflops / world:.1f} TFLOP/s per rank"
          + (f", MFU {result['mfu']:.1%} of {peak:.0f}" if peak else ""))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
