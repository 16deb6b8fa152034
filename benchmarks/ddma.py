"""DDMA weight sync against moving the same bytes with no resharding at all.

    python benchmarks/ddma.py            # what this machine allows: CPU always, the GPU part when CUDA is there

CPU: trainer and generator processes on this machine (gloo). DDMA (plan cached, handshake, packing into buckets,
point-to-point messages, in-place writes) against one raw gloo message per (sender, receiver) pair carrying
the same bytes: `cpu_ratio` = raw time / DDMA time (goal >= 0.8).
GPU: a single-process reshard between two layouts (every rank's shards on the one device, all copies as device
copies) of a 1B-like and an 8B-like model in bf16, against one device-to-device copy of the same bytes:
`*_ratio` = copy time / reshard time (goal >= 0.9; the copy runs near 3 TB/s counting reads and writes).
Extrapolation: for 8B / 70B / 405B in trainer/generator layouts of the paper's scale, the plan (pure, no
tensors) gives the bytes the busiest rank sends or receives; divided by a per-GPU bandwidth that is the sync time
if the links run at that rate.
Parameters are plain tensors shaped by `ddma.descriptors` (no GPTModel is built: only the transfer is timed).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, timed  # noqa: E402


def _params(cfg, layout, local_rank, dtype, device, fill):
    from megatron_rl.ddma.descriptors import rank_params

    out = {}
    for lp in rank_params(cfg, layout, local_rank):
        out[lp.local_name] = (torch.randn(lp.local_shape, dtype=dtype, device=device) if fill
                              else torch.empty(lp.local_shape, dtype=dtype, device=device))
    return out


def _cpu_worker(rank, world_size, preset, src, dst, steps, bucket_mb):
    from megatron_rl.ddma.fingerprint import PushCheck
    from megatron_rl.ddma.planner import plan_reshard
    from megatron_rl.ddma.transport import TransportSettings, execute_plan
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout

    torch.set_num_threads(1)
    cfg = get_preset(preset)
    src_l, dst_l = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    plan = plan_reshard(cfg, src_l, dst_l)
    is_src, is_dst = rank < src_l.size, rank >= src_l.size
    sp = _params(cfg, src_l, rank, torch.float32, "cpu", True) if is_src else None
    dp = _params(cfg, dst_l, rank - src_l.size, torch.float32, "cpu", False) if is_dst else None
    settings = TransportSettings(bucket_bytes=int(bucket_mb * 2**20))
    rp = plan.for_rank(rank)
    # the same bytes per (sender, receiver) pair, as one message each
    out_bytes, in_bytes = {}, {}
    for c in rp.sends:
        out_bytes[c.dst_rank] = out_bytes.get(c.dst_rank, 0) + c.numel * 4
    for c in rp.recvs:
        in_bytes[c.src_rank] = in_bytes.get(c.src_rank, 0) + c.numel * 4
    raw_out = {p: torch.empty(n, dtype=torch.uint8) for p, n in out_bytes.items()}
    raw_in = {p: torch.empty(n, dtype=torch.uint8) for p, n in in_bytes.items()}

    workspace: dict = {}

    def ddma():
        execute_plan(plan, rank, sp, dp, settings, step=0 if is_src else None, workspace=workspace)

    def raw():
        ops = [dist.P2POp(dist.isend, t, p) for p, t in raw_out.items()]
        ops += [dist.P2POp(dist.irecv, t, p) for p, t in raw_in.items()]
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()

    push_check = PushCheck(plan, rank, dist.group.WORLD, interval=1)  # due after every push
    versions = itertools.count(1)

    def check():  # the end-to-end check of that push (ddma/fingerprint.py), as the job runs it every N pushes
        push_check.after_push(sp, dp, next(versions), 0.0)

    times = {"ddma": [], "raw": [], "check": []}
    for i in range(steps + 1):  # the first round of each is a warm-up
        for name, fn in (("ddma", ddma), ("raw", raw), ("check", check)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t)
    return {"times": times, "bytes": plan.network_elements * 4}


def cpu_case(preset: str, src: str, dst: str, steps: int, bucket_mb: float) -> dict:
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.launch.spawn import run_local

    world = ParallelLayout.parse(src).size + ParallelLayout.parse(dst).size
    out = run_local(_cpu_worker, world, preset, src, dst, steps, bucket_mb, timeout=1800)[0]
    ddma, raw = statistics.median(out["times"]["ddma"]), statistics.median(out["times"]["raw"])
    check = statistics.median(out["times"]["check"])
    return {"preset": preset, "src": src, "dst": dst, "bucket_mb": bucket_mb, "bytes": out["bytes"],
            "ddma_s": ddma, "raw_gloo_s": raw, "ratio": raw / ddma, "check_s": check, "check_over_push": check / ddma}


def gpu_case(preset: str, src: str, dst: str, steps: int) -> dict:
    """Single process: every virtual rank's shards on this GPU; the reshard against one copy of the same bytes."""
    from megatron_rl.ddma.fingerprint import held_dtypes, local_fingerprints
    from megatron_rl.ddma.local import InProcessReshard
    from megatron_rl.ddma.planner import plan_reshard
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout

    cfg = get_preset(preset)
    src_l, dst_l = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    plan = plan_reshard(cfg, src_l, dst_l)
    dev = torch.device("cuda")
    srcs = {r: _params(cfg, src_l, r, torch.bfloat16, dev, True) for r in range(src_l.size)}
    dsts = {r + src_l.size: _params(cfg, dst_l, r, torch.bfloat16, dev, False) for r in range(dst_l.size)}
    job = InProcessReshard(plan, srcs, dsts)
    reshard = statistics.median(timed(job.run, steps, 2))
    # The same copies in the parameters' own dtype (bf16 elements): what the wide-element views save.
    narrow = statistics.median(timed(InProcessReshard(plan, srcs, dsts, wide=False).run, steps, 2))
    a = torch.empty(job.bytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    copy = statistics.median(timed(lambda: b.copy_(a), steps, 2))

    dtypes = {k: v for r in dsts for k, v in held_dtypes(plan, r, dsts[r]).items()}

    def fingerprints():  # every rank's half of the push check (the sums; the all_gather of a few KB is not timed)
        for r in set(srcs) | set(dsts):
            local_fingerprints(plan, r, srcs.get(r), dsts.get(r), dtypes)
    check = statistics.median(timed(fingerprints, steps, 1))
    a = b = srcs = dsts = job = None  # free the device memory before the next case
    torch.cuda.empty_cache()
    return {"preset": preset, "src": src, "dst": dst, "bytes": plan.network_elements * 2 + plan.local_elements * 2,
            "copies": len(plan.copies), "reshard_s": reshard, "d2d_copy_s": copy, "ratio": copy / reshard,
            "reshard_bf16_elements_s": narrow, "ratio_bf16_elements": copy / narrow,
            "reshard_GBps_rw": 2 * (plan.network_elements + plan.local_elements) * 2 / reshard / 1e9,
            "check_s": check, "check_over_push": check / reshard}


# (trainer layout, generator layout) at the paper's scale: the trainer on most GPUs, generators with fewer GPUs
# each (so several DP replicas), disjoint.
EXTRAPOLATE = {
    "llama3-8b": ("tp=8,pp=1,dp=16", "tp=1,pp=1,dp=128"),
    "llama3-70b": ("tp=8,pp=4,dp=4", "tp=8,pp=1,dp=16"),
    "llama3-405b": ("tp=8,pp=9,dp=8", "tp=8,pp=2,dp=32"),
}
BANDWIDTHS = {"ib_400gbps": 50e9, "nvlink_h100": 450e9}  # bytes/s per GPU, one direction


def extrapolate() -> dict:
    """Sync time if each GPU's link runs at a given rate: the busiest rank's bytes (sent or received) / rate."""
    from megatron_rl.ddma.planner import plan_reshard
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout

    out = {}
    for preset, (src, dst) in EXTRAPOLATE.items():
        plan = plan_reshard(get_preset(preset), ParallelLayout.parse(src), ParallelLayout.parse(dst))
        sent = plan.sender_loads()
        received: dict[int, int] = {}
        for c in plan.copies:
            received[c.dst_rank] = received.get(c.dst_rank, 0) + c.numel
        busiest = max(max(sent.values()), max(received.values())) * 2  # bf16 bytes
        out[preset] = {"src": src, "dst": dst, "busiest_rank_bytes": busiest,
                       "senders": sum(1 for v in sent.values() if v), "trainer_ranks": len(sent),
                       **{f"seconds_at_{k}": busiest / bw for k, bw in BANDWIDTHS.items()}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-preset", default="smollm2-135m")
    p.add_argument("--cpu-src", default="tp=1,pp=2")
    p.add_argument("--cpu-dst", default="tp=1")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-cpu", action="store_true", help="skip the multi-process CPU comparison")
    args = p.parse_args(argv)
    result = {}
    if not args.no_cpu:
        c = cpu_case(args.cpu_preset, args.cpu_src, args.cpu_dst, args.steps, args.bucket_mb)
        print(f"CPU {c['preset']} {c['src']} -> {c['dst']}: DDMA {c['ddma_s'] * 1e3:.1f} ms, raw gloo "
              f"{c['raw_gloo_s'] * 1e3:.1f} ms for {c['bytes'] / 1e6:.1f} MB (ratio {c['ratio']:.2f}); push check "
              f"{c['check_s'] * 1e3:.1f} ms ({c['check_over_push']:.3f} of a push)", flush=True)
        result["cpu"] = c
        result["cpu_ratio"] = c["ratio"]
    if torch.cuda.is_available():
        for key, (preset, src, dst) in {"gpu_1b": ("llama-1b", "tp=2,pp=2", "tp=1"),
                                        "gpu_8b": ("llama3-8b", "tp=4,pp=2", "tp=2")}.items():
            g = gpu_case(preset, src, dst, args.steps)
            print(f"GPU {preset} {src} -> {dst}: reshard {g['reshard_s'] * 1e3:.2f} ms, d2d copy "
                  f"{g['d2d_copy_s'] * 1e3:.2f} ms for {g['bytes'] / 1e9:.2f} GB ({g['copies']} copies, ratio "
                  f"{g['ratio']:.2f}, {g['reshard_GBps_rw']:.0f} GB/s read+write; as bf16 elements "
                  f"{g['reshard_bf16_elements_s'] * 1e3:.2f} ms, ratio {g['ratio_bf16_elements']:.2f}); push check "
                  f"sums {g['check_s'] * 1e3:.2f} ms ({g['check_over_push']:.3f} of a reshard)", flush=True)
            result[key] = g
            result[f"{key}_ratio"] = g["ratio"]
    result["extrapolated"] = extrapolate()
    for preset, e in result["extrapolated"].items():
        print(f"{preset} {e['src']} -> {e['dst']}: busiest rank moves {e['busiest_rank_bytes'] / 1e9:.2f} GB: "
              + ", ".join(f"{e[k]:.2f} s at {k[len('seconds_at_'):]}" for k in e if k.startswith("seconds_at_")),
              flush=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
