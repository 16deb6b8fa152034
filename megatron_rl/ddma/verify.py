"""`megatron-rl reshard-check`: run DDMA between two layouts on local processes and check every bit.

The trainer is filled with pseudo-random weights that are a pure function of (seed, parameter name, logical index),
so each rank computes exactly its own shard (no rank builds a full tensor, so this also runs for larger presets).
The generator starts as NaN, DDMA runs, and each generator parameter is compared bit for bit with the same logical
weights sliced directly into the generator's layout (padding rows zero). With `quantize="int8"` or `"fp8"` the codes
and scales must equal `quant.quantize` of that direct slice, bit for bit, and dequantize to within half a step.
`tests/test_ddma_transport.py` checks the same against `load_full_state_dict`, an independent slicing path.
A mixture of experts (a MoE preset, or `--set num_moe_experts=...`) is checked the same way between layouts with
`ep`/`etp` (`--src tp=2,dp=2,ep=2 --dst tp=2,ep=2,etp=1`): each rank fills, and checks, the experts the expert grid
gives it; the summary's `expert_params_checked` counts the generator's expert tensors.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.ddma.descriptors import LocalParam, stage_params
from megatron_rl.ddma.planner import plan_reshard
from megatron_rl.ddma.quant import quantize as quantize_shard, quantized_targets, weight_format
from megatron_rl.ddma.sync import WeightSync
from megatron_rl.ddma.transport import DEFAULT_BUCKET_BYTES, TransportSettings
from megatron_rl.models.param_spec import is_expert
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.topology import ExecutorPlacement, build_topology

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64 (torch wraps on overflow)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _hash_to_unit(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed deterministic map from int64 to floats k / 2**27 in [-1/16, 1/16), exact in float32."""
    x = x * _GOLDEN
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    x = x ^ (x >> 31)
    bits = (x >> 20) & 0xFFFFFF  # 24 bits
    return (bits.to(torch.float64) - (1 << 23)).to(torch.float32) / float(1 << 27)


def logical_indices(lp: LocalParam) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat index in the logical (unpadded) tensor of every element of this rank's local tensor, and a mask of
    the elements that are real (False on vocabulary padding rows)."""
    p = lp.param
    shape = lp.local_shape
    flat = torch.zeros(shape, dtype=torch.int64)
    valid = torch.ones(shape, dtype=torch.bool)
    stride = 1
    for dim in reversed(range(len(shape))):
        if dim == p.partition_dim:
            idx = torch.cat([torch.arange(g0, g1) for g0, g1, _ in lp.blocks()])
            ok = idx < p.shape[dim]
            view = [1] * len(shape)
            view[dim] = -1
            valid &= ok.view(view)
        else:
            idx = torch.arange(shape[dim])
            view = [1] * len(shape)
            view[dim] = -1
        flat += idx.view(view) * stride
        stride *= p.shape[dim]
    return flat, valid


def reference_shard(lp: LocalParam, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's slice of the pseudo-random logical weights (zeros on padding rows)."""
    flat, valid = logical_indices(lp)
    salt = (zlib.crc32(lp.global_name.encode()) << 20) ^ (seed << 52)
    values = _hash_to_unit(flat + salt)
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype)).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def count_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements whose bits differ (so NaN never matches a number, and -0.0 does not match 0.0)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return actual.numel()
    return int((_bits(actual.detach().cpu()) != _bits(expected)).sum())


def _local_params(model_cfg: ModelConfig, groups) -> dict[str, LocalParam]:
    return {lp.local_name: lp for lp in stage_params(model_cfg, groups.layout, groups.pp_rank, groups.tp_rank,
                                                     groups.dp_rank)}


def reshard_check_worker(rank: int, world_size: int, cfg_kw: dict, src: str, dst: str, colocated: bool,
                         bucket_bytes: int, seed: int, dtype_name: str, wire_dtype_name: Optional[str],
                         quantize: Optional[str] = None) -> dict:
    """One rank of the verifier: build both executors' models, sync, compare (run by `reshard_check`)."""
    from megatron_rl.models.builder import build_gpt_model

    cfg = ModelConfig(**cfg_kw)
    dtype = getattr(torch, dtype_name)
    wire = getattr(torch, wire_dtype_name) if wire_dtype_name else None
    src_layout, dst_layout = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    placements = [ExecutorPlacement("trainer", src_layout, 0),
                  ExecutorPlacement("generator", dst_layout, 0 if colocated else src_layout.size)]
    topo = build_topology(placements)
    t, g = topo["trainer"], topo["generator"]
    trainer = generator = None
    with torch.no_grad():
        if t.is_member:
            trainer = build_gpt_model(cfg, t.layout, t.pgs, attention="sdpa", seed=seed + 1, params_dtype=dtype)
            expected = _local_params(cfg, t)
            for name, p in trainer.named_parameters():
                p.copy_(reference_shard(expected[name], seed, p.dtype))
        if g.is_member:
            generator = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=seed + 2, params_dtype=dtype)
            for p in generator.parameters():
                p.fill_(float("nan"))
    settings = TransportSettings(bucket_bytes=bucket_bytes, wire_dtype=wire, quantize=quantize)
    sync = WeightSync(cfg, t, g, settings=settings)
    targets = {}
    if generator is not None and quantize:
        targets = quantized_targets(quantize, cfg, g.layout, g.pp_rank, g.tp_rank, dp_rank=g.dp_rank)
    dst = None if generator is None else {**dict(generator.named_parameters()), **targets}
    dist.barrier()
    t0 = time.perf_counter()
    result = sync.sync(trainer, dst, step=7 if t.is_member else None)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    out = {"rank": rank, "seconds": elapsed, "sync_seconds": result.seconds,
           **dataclasses.asdict(result.stats), "mismatches": 0, "elements_checked": 0, "params_checked": 0,
           "expert_params_checked": 0, "version": None, "quant_error_over_bound": 0.0}
    if generator is not None:
        expected = _local_params(cfg, g)
        names = {n for n, _ in generator.named_parameters()}
        if names != set(expected):
            raise RuntimeError(f"rank {rank}: generator parameters {sorted(names ^ set(expected))} do not match "
                               f"the descriptors")
        for name, p in generator.named_parameters():
            want = reference_shard(expected[name], seed, p.dtype)
            if wire is not None:  # what a cast to the wire dtype and back gives
                want = reference_shard(expected[name], seed, wire).to(p.dtype)
            if name in targets:
                # exactly what quantizing the local full-precision shard gives, and within half a step of it
                q, direct = targets[name], quantize_shard(want, quantize)
                out["mismatches"] += count_mismatches(q.qweight, direct.qweight)
                out["mismatches"] += count_mismatches(q.scale, direct.scale)
                err = (q.dequantize() - want.float()).abs() / q.half_step(want)
                out["quant_error_over_bound"] = max(out["quant_error_over_bound"], float(err.max()))
            else:
                out["mismatches"] += count_mismatches(p, want)
            out["elements_checked"] += p.numel()
            out["params_checked"] += 1
            out["expert_params_checked"] += is_expert(name)
        out["version"] = None if sync.version is None else sync.version.step
    return out


def reshard_check(cfg: ModelConfig, src: ParallelLayout, dst: ParallelLayout, *, colocated: bool = False,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, seed: int = 0, dtype: str = "float32",
                  wire_dtype: Optional[str] = None, quantize: Optional[str] = None) -> dict:
    """Run the verifier on local gloo processes; return the summary (the CLI prints it as one JSON line)."""
    from megatron_rl.launch.spawn import run_local

    t0 = time.perf_counter()
    plan = plan_reshard(cfg, src, dst, dst_first_rank=0 if colocated else src.size)  # fails fast, one line
    plan_seconds = time.perf_counter() - t0
    for name in filter(None, (dtype, wire_dtype)):
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
    world = max(src.size, dst.size) if colocated else src.size + dst.size
    ranks = run_local(reshard_check_worker, world, dataclasses.asdict(cfg), str(src), str(dst), colocated,
                      bucket_bytes, seed, dtype, wire_dtype, quantize)
    generator_ranks = range(0, dst.size) if colocated else range(src.size, src.size + dst.size)
    versions = {ranks[r]["version"] for r in generator_ranks}
    mismatches = sum(r["mismatches"] for r in ranks)
    summary = {
        "model": cfg.name, "src": str(src), "dst": str(dst), "colocated": colocated, "world_size": world,
        "dtype": dtype, "wire_dtype": wire_dtype or "native", "quantize": quantize, "bucket_bytes": bucket_bytes,
        "bytes_moved": sum(r["bytes_sent"] for r in ranks),
        "bytes_local": sum(r["bytes_local"] for r in ranks),
        "messages": sum(r["messages_sent"] for r in ranks),
        "rounds": max(r["rounds"] for r in ranks),
        "peak_staging_bytes": max(r["peak_staging_bytes"] for r in ranks),
        "senders": sum(1 for r in ranks if r["bytes_sent"]),
        "seconds": max(r["seconds"] for r in ranks),
        "plan_seconds": plan_seconds,
        "params_checked": sum(r["params_checked"] for r in ranks),
        "expert_params_checked": sum(r["expert_params_checked"] for r in ranks),  # of a mixture of experts
        "elements_checked": sum(r["elements_checked"] for r in ranks),
        "mismatches": mismatches,
        "quant_error_over_bound": max(r["quant_error_over_bound"] for r in ranks),
        "version": versions.pop() if len(versions) == 1 else sorted(versions, key=str),
        "plan": plan.summary(),
    }
    summary["ok"] = (mismatches == 0 and summary["version"] == 7 and summary["elements_checked"] > 0
                     and (quantize is None
                          or summary["quant_error_over_bound"] <= weight_format(quantize).ERROR_OVER_HALF_STEP))
    return summary


PROCESSES_PER_CORE = 4  # reshard-check: a layout pair needing more processes than this per core needs --force


def reshard_check_command(model: str, overrides: dict, src: str, dst: str, *, colocated: bool, force: bool,
                          **options) -> dict:
    """`megatron-rl reshard-check`: the preset `model` with field `overrides` and the two layouts checked (ValueError,
    one line), then `reshard_check`."""
    import dataclasses

    from megatron_rl.launch.spawn import usable_cores
    from megatron_rl.models.presets import get_preset

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; known: {', '.join(sorted(fields))}")
    cfg = get_preset(model, **overrides)
    src_layout, dst_layout = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    world = max(src_layout.size, dst_layout.size) if colocated else src_layout.size + dst_layout.size
    cores = usable_cores()
    if world > PROCESSES_PER_CORE * cores and not force:
        raise ValueError(f"--src {src} --dst {dst} needs {world} processes, more than {PROCESSES_PER_CORE} per CPU "
                         f"core ({cores} cores here); pass --force to start them")
    return reshard_check(cfg, src_layout, dst_layout, colocated=colocated, **options)
