"""Worker functions of the DDMA multi-process tests (importable by the fork server)."""

from __future__ import annotations

import math

import torch

from megatron_rl.ddma.sync import WeightSync
from megatron_rl.ddma.transport import TransportSettings
from megatron_rl.ddma.verify import count_mismatches
from megatron_rl.ddma.version import weight_version
from megatron_rl.models import build_gpt_model, get_preset
from megatron_rl.models.sharding import describe_params, load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology


def random_full_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Logical weights of the whole model (tests only: this is exactly what DDMA never builds)."""
    from megatron_rl.ddma.descriptors import logical_params

    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g) for p in logical_params(cfg)}


def reshard_worker(rank, world_size, preset_kw, src_kw, dst_kw, dst_first, bucket_bytes, dst_preset_kw=None,
                   steps=(3,), dst_dtype=torch.float32):
    """Trainer and generator in one world; sync; compare the generator bit for bit with a direct load.

    Runs a sync per entry of `steps`, refilling the trainer with new weights each time (a sync must overwrite
    everything, every time). A bfloat16 generator takes float32 trainer weights rounded as `copy_` rounds them
    (its norms stay float32, as Megatron-Core builds them). Returns, per generator rank, the mismatching
    parameter names and the version.
    """
    cfg = get_preset("tiny", **preset_kw)
    dst_cfg = get_preset("tiny", **(dst_preset_kw or preset_kw))
    src_layout, dst_layout = ParallelLayout(**src_kw), ParallelLayout(**dst_kw)
    topo = build_topology([ExecutorPlacement("trainer", src_layout, 0),
                           ExecutorPlacement("generator", dst_layout, dst_first)])
    t, g = topo["trainer"], topo["generator"]
    trainer = build_gpt_model(cfg, src_layout, t.pgs, attention="sdpa", seed=1) if t.is_member else None
    generator = (build_gpt_model(dst_cfg, dst_layout, g.pgs, attention="sdpa", seed=2, params_dtype=dst_dtype)
                 if g.is_member else None)
    sync = WeightSync(cfg, t, g, generator_model_cfg=dst_cfg, settings=TransportSettings(bucket_bytes=bucket_bytes))
    out = {"mismatches": [], "versions": [], "stats": []}
    for i, step in enumerate(steps):
        full = random_full_state(cfg, seed=100 + i)
        if trainer is not None:
            load_full_state_dict(trainer, full, cfg, t.pgs)
        if generator is not None:
            with torch.no_grad():
                for p in generator.parameters():
                    p.fill_(math.nan)
        result = sync.sync(trainer, generator, step=step if t.is_member else None)
        out["stats"].append(result.stats)
        if generator is None:
            continue
        # The reference: the same logical weights loaded straight into a generator-layout model.
        reference = build_gpt_model(dst_cfg, dst_layout, g.pgs, attention="sdpa", seed=3, params_dtype=dst_dtype)
        load_full_state_dict(reference, full, dst_cfg, g.pgs)
        ref = dict(reference.named_parameters())
        bad = [n for n, p in generator.named_parameters() if p.dtype != ref[n].dtype or count_mismatches(p, ref[n])]
        out["mismatches"].append(bad)
        out["versions"].append(weight_version(generator).step)
        out["params"] = len(ref)
        out["tied_copy"] = any(d.tied_copy for d in describe_params(generator, dst_cfg, g.tp_rank, dst_layout.tp))
    return out


def wrong_model_worker(rank, world_size):
    """The generator is built with a different FFN size than the plan says: every rank must fail, none hang."""
    cfg = get_preset("tiny")
    topo = build_topology([ExecutorPlacement("trainer", ParallelLayout(tp=2), 0),
                           ExecutorPlacement("generator", ParallelLayout(tp=1), 2)])
    t, g = topo["trainer"], topo["generator"]
    if t.is_member:
        model = build_gpt_model(cfg, t.layout, t.pgs, attention="sdpa")
    else:
        model = build_gpt_model(get_preset("tiny", ffn_hidden_size=88), g.layout, g.pgs, attention="sdpa")
    sync = WeightSync(cfg, t, g)
    sync.sync(model if t.is_member else None, model if g.is_member else None, step=1 if t.is_member else None)


def describe_worker(rank, world_size, cases):
    """For each (preset overrides, layout) on this world: describe_params of this rank's real model stage."""
    out = []
    for preset_kw, layout_kw in cases:
        cfg = get_preset("tiny", **preset_kw)
        layout = ParallelLayout(**layout_kw)
        g = build_topology([ExecutorPlacement("m", layout, 0)])["m"]
        if not g.is_member:
            out.append(None)
            continue
        model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa")
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        out.append({"coords": g.coords, "shards": describe_params(model, cfg, g.tp_rank, layout.tp),
                    "shapes": shapes})
    return out
