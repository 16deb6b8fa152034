"""The bytes a resume reads, before and after the loader of issue 56 (`checkpointing/loader.py`).

    python benchmarks/resume_reads.py                     # SmolLM2-135M shape with 8 heads, two gloo ranks
    python benchmarks/resume_reads.py --preset tiny --heads 0

(SmolLM2-135M's 9 attention heads and 3 KV groups do not split over TP2: by default the shape has 8 and 4 of the
same head size, which happens to keep its 134.5M parameters exactly; `--heads 0` keeps the preset's.) Two ranks
save a training checkpoint at TP1 x DP2 (bf16 weights, the distributed optimizer with Adam state, and a
KL reference: the policy's weights again, under `reference.*`), then load its model and optimizer directories as
`TrainCheckpointer.load` does, at DP2 and at TP2 x DP1, three ways, each after the page cache is emptied of the
checkpoint's files:
- plain: Megatron-Core's default torch_dist load (timed, twice, interleaved with the after's: the disk's rate
  drifts between runs);
- before: the same reads counted (torch's whole-chunk reads through `RangeReader(whole_chunks=True)`, every rank
  reading all it needs);
- after: `resume_strategy` (each DP-replicated tensor read by one rank and broadcast; each chunk read only as far
  as needed), timed (twice) and counted.
Bytes are the tensor data read at the reader (`ReadCount.data`; the headers beside), per rank and in all, against
the checkpoint's tensor bytes; `rchar` (/proc/self/io: every byte the rank's read calls returned, metadata and all)
is shown beside as a check from outside the reader.

Ends with one JSON line: per target layout, checkpoint_tensor_bytes, before/after total and max-rank bytes, header
bytes, and the plain and after load times.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import evict, files_under  # noqa: E402
from common import emit  # noqa: E402

TARGETS = {"dp2": dict(tp=1, dp=2), "tp2": dict(tp=2, dp=1)}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _model(preset: str, heads: int):
    import dataclasses

    from megatron_rl.models import get_preset

    cfg = get_preset(preset)
    if heads:
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{heads}h", num_attention_heads=heads,
                                  num_query_groups=heads // 2, head_dim=cfg.hidden_size // cfg.num_attention_heads)
    return cfg


def _engine(cfg, layout_kw):
    import torch

    from megatron_rl.checkpointing.megatron_state import ensure_optimizer_state
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import TrainEngine
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    layout = ParallelLayout(**layout_kw)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", params_dtype=torch.bfloat16)
    engine = TrainEngine.create(model, g.pgs, TrainerSettings(), LRSchedule(lr=1e-5))
    ensure_optimizer_state(engine.optimizer)  # Adam moments allocated, as after a step
    return layout, engine


def _sharded(engine, sub: str) -> dict:
    """What `TrainCheckpointer.load` hands dist_checkpointing for directory `sub` (the policy as KL reference)."""
    from megatron_rl.checkpointing import megatron_state

    if sub == "model":
        return megatron_state.sharded_model(engine)
    sd = megatron_state.sharded_optimizer(engine, megatron_state.sharded_model(engine), is_loading=True)
    sd["reference"] = megatron_state.sharded_reference(engine.model.module, engine)
    return sd


def rank_main(rank, world_size, preset, heads, root):
    import gc

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing.loader import RangeLoadStrategy, resume_strategy
    from megatron_rl.checkpointing.training import TrainCheckpointer
    cfg = _model(preset, heads)
    layout, engine = _engine(cfg, dict(tp=1, dp=world_size))
    path = TrainCheckpointer(root).save(1, engine, reference=engine.model.module, layout=layout, model_cfg=cfg,
                                        rl_state={"step": 1} if rank == 0 else None)
    del engine
    gc.collect()
    out = {"path": str(path)}
    for name, kw in TARGETS.items():
        _, engine = _engine(cfg, kw)

        res = {"plain": [], "before": [], "after": []}
        for mode in ("before", "plain", "after", "plain", "after"):  # the disk's rate drifts: the times interleaved
            strategy = {"plain": None, "before": RangeLoadStrategy(whole_chunks=True),
                        "after": resume_strategy(engine.pgs.dp_cp)}[mode]
            dist.barrier()
            if rank == 0:
                evict(files_under(path))
            dist.barrier()
            rchar, t0 = _rchar(), time.perf_counter()
            for sub in ("model", "optimizer"):
                dist_checkpointing.load(_sharded(engine, sub), str(path / sub), sharded_strategy=strategy)
            seconds, rchar = time.perf_counter() - t0, _rchar() - rchar
            dist.barrier()
            res[mode].append({"s": seconds, "rchar": rchar})
            if strategy is not None:
                res[mode][-1].update(data=strategy.read.data, header=strategy.read.header)
        out[name] = res
        del engine
        gc.collect()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--heads", type=int, default=8, help="attention heads (KV groups: half), 0: the preset's")
    p.add_argument("--dir", default="runs/resume_reads_bench", help="where to write (the filesystem measured)")
    args = p.parse_args(argv)

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_rl.launch.spawn import run_local

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ranks = run_local(rank_main, 2, args.preset, args.heads, str(root), timeout=3600)
    path = Path(ranks[0]["path"])
    tensor_bytes = 0
    for sub in ("model", "optimizer"):
        md = FileSystemReader(str(path / sub)).read_metadata()
        tensor_bytes += sum(c.sizes.numel() * t.properties.dtype.itemsize for t in md.state_dict_metadata.values()
                            if isinstance(t, TensorStorageMetadata) for c in t.chunks)
    out = {"model": _model(args.preset, args.heads).name, "saved_at": "tp=1,dp=2",
           "checkpoint_tensor_bytes": tensor_bytes}
    for name, kw in TARGETS.items():
        r = {mode: [rank[name][mode][0] for rank in ranks] for mode in ("plain", "before", "after")}
        row = {"layout": f"tp={kw['tp']},dp={kw['dp']}"}
        for mode in ("plain", "after"):  # each round's slowest rank
            row[f"{mode}_load_s"] = [max(rank[name][mode][i]["s"] for rank in ranks) for i in range(2)]
        for mode in ("before", "after"):
            row[f"{mode}_bytes"] = sum(x["data"] for x in r[mode])
            row[f"{mode}_max_rank_bytes"] = max(x["data"] for x in r[mode])
            row[f"{mode}_header_bytes"] = sum(x["header"] for x in r[mode])
            row[f"{mode}_vs_checkpoint"] = row[f"{mode}_bytes"] / tensor_bytes
        for mode in ("plain", "after"):
            row[f"{mode}_rchar"] = sum(x["rchar"] for x in r[mode])
        out[name] = row
        print(f"{out['model']}, saved at TP1 x DP2 ({tensor_bytes / 1e9:.3f} GB of tensors), loaded at "
              f"{row['layout']}: "
              f"before {row['before_bytes'] / 1e9:.3f} GB read ({row['before_vs_checkpoint']:.2f}x; busiest rank "
              f"{row['before_max_rank_bytes'] / 1e9:.3f} GB), after {row['after_bytes'] / 1e9:.3f} GB "
              f"({row['after_vs_checkpoint']:.2f}x; busiest rank {row['after_max_rank_bytes'] / 1e9:.3f} GB); headers "
              f"{row['before_header_bytes'] / 1e6:.1f} / {row['after_header_bytes'] / 1e6:.1f} MB; read calls "
              f"returned {row['plain_rchar'] / 1e9:.3f} / {row['after_rchar'] / 1e9:.3f} GB; load "
              f"{' / '.join(f'{x:.2f}' for x in row['plain_load_s'])} s plain, "
              f"{' / '.join(f'{x:.2f}' for x in row['after_load_s'])} s after (two rounds)")
    emit(out)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
