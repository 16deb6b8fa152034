"""Worker functions for the training-checkpoint tests (run under megatron_rl.launch.spawn.run_local)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.algorithms import AIPOSettings
from megatron_rl.checkpointing.training import TrainCheckpointer
from megatron_rl.models import build_gpt_model, get_preset
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.settings import LRSchedule, TrainerSettings
from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
from full_state import gather_full_state_dict
from rl_workers import make_rollouts


def index_contents(index) -> dict:
    """A checkpoint index (`resume_check.Index`) as comparable data: {(directory, key): (global shape, dtype, every
    chunk's offsets and sizes) or "object"}."""
    return {(d, key): (tuple(e.size), e.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in e.chunks))
            if hasattr(e, "chunks") else "object"
            for d, md in index.metadata.items() for key, e in md.state_dict_metadata.items()}


def _trainer(layout_kw, state_path, seed=0):
    layout_kw = dict(layout_kw)
    distributed = layout_kw.pop("distributed_optimizer", True)  # False: Megatron-Core's DP-replicated optimizer
    cfg = get_preset("tiny", **layout_kw.pop("model", {}))  # "model": preset overrides (a mixture of experts)
    layout = ParallelLayout(**layout_kw)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=seed)
    if state_path is not None:
        load_full_state_dict(model, torch.load(state_path), cfg, g.pgs)
    # The synthetic rollouts' behaviour log-probs are random (gaps of several nats): the step guard would skip their
    # steps, and these tests count and compare steps taken (the guard's own tests: test_trainer_options.py).
    trainer = TrainerSettings(micro_batch_size=2, adam_eps=1e-4, clip_grad=10.0,
                              use_distributed_optimizer=distributed, spike_factor=0.0)
    settings = RLTrainerSettings(trainer, AIPOSettings(rho=2.0),
                                 LRSchedule(lr=1e-3, warmup_steps=2, total_steps=20, decay_style="cosine"),
                                 temperature=0.8)
    return cfg, layout, g, RLTrainer(model, cfg, g, settings)


def train_save_continue(rank, world_size, layout_kw, state_path, root, steps, async_save=False):
    """`steps` AIPO steps, a checkpoint, one more step: the uninterrupted reference. With `async_save`, the next
    step runs before the checkpoint's files are written (the write waits for it): the checkpoint must still hold
    the state of the save, not the step's."""
    import threading

    from megatron_rl.checkpointing.background import PlannedWrite

    cfg, layout, g, trainer = _trainer(layout_kw, state_path)
    for i in range(steps):
        trainer.step(make_rollouts(cfg.vocab_size, seed=i))
    ck = TrainCheckpointer(root, keep_last=2, async_save=async_save)
    stepped = threading.Event()
    if async_save:
        write = PlannedWrite.write
        PlannedWrite.write = lambda self: (stepped.wait(), write(self))[1]
    path = ck.save(steps, trainer.engine, layout=layout, model_cfg=cfg,
                   rl_state={"step": steps, "weight_version": steps} if rank == 0 else None,
                   tokenizer={"type": "byte"})
    metrics = trainer.step(make_rollouts(cfg.vocab_size, seed=steps))
    stepped.set()
    ck.wait()
    return {"path": str(path), "metrics": metrics, "params": gather_full_state_dict(trainer.model.module, cfg, g.pgs)}


def train_save_continue_old_format(rank, world_size, layout_kw, state_path, root, steps):
    """`train_save_continue`, with the optimizer written as main wrote it before the pieces format: Megatron-Core's
    `fully_reshardable` (gathered onto each DP group's rank 0)."""
    from megatron_rl.checkpointing import megatron_state

    def old_format(engine, model_sd, is_loading, with_state=True):
        out = {"scheduler": engine.scheduler.state_dict(),
               "engine": {"steps_done": engine.steps_done, "nonfinite_total": engine.nonfinite_total,
                          "nonfinite_in_a_row": engine.nonfinite_in_a_row}}
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                    "dp_cp_group": engine.pgs.dp_cp}
        out["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        return out

    megatron_state.sharded_optimizer = old_format
    return train_save_continue(rank, world_size, layout_kw, state_path, root, steps)


def load_and_continue(rank, world_size, layout_kw, path, steps, load_optimizer=True, nccl_rules=False):
    """A fresh trainer (different random init) restored from `path`, then the same next step; with `nccl_rules`,
    every collective and point-to-point transfer keeps NCCL's rules (`compat.cuda_rules`)."""
    if nccl_rules:
        from megatron_rl.checkpointing import loader
        from megatron_rl.compat import cuda_rules

        cuda_rules.install_nccl_rules()
        loader.DIRECT_BYTES = 4096  # the tiny model's matrices sent in place, its norms coalesced in buckets
    cfg, layout, g, trainer = _trainer(layout_kw, None, seed=77)
    ck = TrainCheckpointer(Path(path).parent)
    if load_optimizer:
        rl_state = ck.load(path, trainer.engine)
    else:  # control: weights only, fresh optimizer
        from megatron.core import dist_checkpointing

        sd = trainer.model.module.sharded_state_dict(metadata={"dp_cp_group": g.pgs.dp_cp})
        trainer.model.module.load_state_dict(dist_checkpointing.load(sd, f"{path}/model"))
        rl_state = {}
    metrics = trainer.step(make_rollouts(cfg.vocab_size, seed=steps))
    return {"metrics": metrics, "params": gather_full_state_dict(trainer.model.module, cfg, g.pgs),
            "rl_state": rl_state, "lr": trainer.engine.optimizer.param_groups[0]["lr"],
            "steps_done": trainer.engine.steps_done, "read_bytes": ck.last_load_read.data}


def train_with_two_saves(rank, world_size, state_path, root):
    """Two steps, save, two steps, save (the crash test kills the second save midway)."""
    cfg, layout, g, trainer = _trainer(dict(tp=world_size), state_path)
    ck = TrainCheckpointer(root, keep_last=2)
    for i in range(4):
        trainer.step(make_rollouts(cfg.vocab_size, seed=i))
        if i % 2 == 1:
            ck.save(i + 1, trainer.engine, layout=layout, model_cfg=cfg,
                    rl_state={"step": i + 1, "weight_version": i + 1} if rank == 0 else None)
    return True


def overflowing_update(rank, world_size, state_path, root):
    """A step and a checkpoint, then an update with an infinite learning rate (finite loss and gradients, NaN
    weights): the step raises, and a save afterwards refuses to write."""
    import math

    from megatron_rl.checkpointing.training import CheckpointError
    from megatron_rl.training.engine import NonFiniteError

    cfg, layout, g, trainer = _trainer(dict(tp=world_size), state_path)
    ck = TrainCheckpointer(root)
    trainer.step(make_rollouts(cfg.vocab_size, seed=0))
    ck.save(1, trainer.engine, layout=layout, model_cfg=cfg, rl_state={"step": 1, "weight_version": 1})
    for group in trainer.engine.optimizer.param_groups:
        group["lr"] = math.inf
    out = {}
    for what, call in (("step", lambda: trainer.step(make_rollouts(cfg.vocab_size, seed=1))),
                       ("save", lambda: ck.save(2, trainer.engine, layout=layout, model_cfg=cfg))):
        try:
            call()
        except (NonFiniteError, CheckpointError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def crash_main() -> None:
    """`ckpt_workers STATE ROOT`: `train_with_two_saves` in a world of one rank, run by the crash test as a command of
    its own (`warm_cli`), whose environment names the failpoint that kills the rank."""
    import sys

    from megatron_rl.launch.spawn import run_local

    run_local(train_with_two_saves, 1, sys.argv[1], sys.argv[2])


def _tensor_bytes(d) -> int:
    """The bytes of tensor data a dist_checkpointing directory holds (every saved chunk), from its metadata."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(d)).read_metadata()
    return sum(math.prod(c.sizes) * t.properties.dtype.itemsize for t in md.state_dict_metadata.values()
               if isinstance(t, TensorStorageMetadata) for c in t.chunks)


def _flat(x, path=()):
    """(path, leaf) of a nested dict/list, in order."""
    if isinstance(x, dict):
        return [e for k in sorted(x, key=str) for e in _flat(x[k], (*path, k))]
    if isinstance(x, list):
        return [e for i, v in enumerate(x) for e in _flat(v, (*path, i))]
    return [(path, x)]


def _differences(a, b) -> list:
    """The paths where two loaded state dicts differ: tensors bit for bit (dtype, shape, bytes), the rest by ==."""
    fa, fb = _flat(a), _flat(b)
    if [p for p, _ in fa] != [p for p, _ in fb]:
        return ["structure"]
    out = []
    for (p, x), (_, y) in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.reshape(-1).view(torch.uint8) if x.numel() else x,
                                    y.reshape(-1).view(torch.uint8) if y.numel() else y))
        else:
            same = x == y
        if not same:
            out.append(".".join(map(str, p)))
    return out


def resume_reads(rank, world_size, state_path, root):
    """Save at TP1 x DP2 (with a KL reference, here the policy's own weights), then for a resume at DP2 and at
    TP2 x DP1: load each directory plainly (Megatron-Core's default strategy), with torch's whole-chunk reads
    counted (the before-figure) and with `resume_strategy` into state poisoned with NaN; the last must give the plain
    load's values bit for bit. Returns each layout's counts and differences, the `.distcp` files that load opened
    (both directories), those `resume_read_ahead` names for reading ahead of each load, and the broadcasts of the
    exchange (dtype, bytes)."""
    import builtins
    import io
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values

    from megatron_rl.checkpointing import loader, megatron_state
    from megatron_rl.checkpointing.layout import read_meta
    from megatron_rl.checkpointing.loader import RangeLoadStrategy, resume_strategy

    cfg, layout, g, trainer = _trainer(dict(tp=1, dp=2), state_path)
    trainer.step(make_rollouts(cfg.vocab_size, seed=0))
    path = TrainCheckpointer(root).save(1, trainer.engine, reference=trainer.model.module, layout=layout,
                                        model_cfg=cfg, rl_state={"step": 1} if rank == 0 else None)
    out = {"tensor_bytes": {sub: _tensor_bytes(path / sub) for sub in ("model", "optimizer")}}
    for name, kw in (("dp2", dict(tp=1, dp=2)), ("tp2", dict(tp=2, dp=1))):
        _, _, g2, fresh = _trainer(kw, None, seed=77)
        engine = fresh.engine
        megatron_state.ensure_optimizer_state(engine.optimizer)

        def build(sub):
            if sub == "model":
                return megatron_state.sharded_model(engine)
            sd = megatron_state.sharded_optimizer(engine, megatron_state.sharded_model(engine), is_loading=True)
            sd["reference"] = megatron_state.sharded_reference(fresh.model.module, engine)
            return sd

        res = {"before": [0, 0], "after": [0, 0], "received": 0, "differences": [], "opened": set(), "messages": [],
               "read_ahead": [[Path(p).relative_to(path).as_posix() for p, _, _ in extents] for extents in
                              loader.resume_read_ahead(path, ("model", "optimizer"), read_meta(path), engine.pgs)]}
        for sub in ("model", "optimizer"):
            plain = dist_checkpointing.load(build(sub), str(path / sub))
            plain = dict_list_map_outplace(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, plain)
            whole = RangeLoadStrategy(whole_chunks=True)
            res["differences"] += [f"whole {sub}: {d}" for d in _differences(
                plain, dist_checkpointing.load(build(sub), str(path / sub), sharded_strategy=whole))]
            sd = build(sub)
            for v in nested_values(sd):
                if getattr(v, "data", None) is not None and v.data.is_floating_point():
                    v.data.detach().fill_(float("nan"))
            strategy = resume_strategy(engine.pgs.dp_cp)
            # The tiny model's matrices (4 KB and more) are sent in place, its norms coalesced in buckets.
            strategy.direct_bytes = 4096
            opened, real_broadcast = res["opened"], loader.dist.broadcast
            real_opens = os.open, builtins.open, io.open

            def spying(real, chunks):  # chunks: the loader's reads of tensors, else the small files' reads
                def spy(name, *args, **kwargs):
                    if isinstance(name, (str, os.PathLike)) and Path(name).is_relative_to(path / sub) and \
                            chunks == str(name).endswith(".distcp"):
                        opened.add(Path(name).relative_to(path).as_posix())
                    return real(name, *args, **kwargs)
                return spy

            def broadcast(tensor, *args, **kwargs):
                res["messages"].append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
                return real_broadcast(tensor, *args, **kwargs)

            # The files the load opens: for its tensors (the loader's `os.open`), its small files (Python's `open`;
            # the `.distcp` files it opens so are other ranks' read for a few objects, not read ahead).
            loader.os.open = spying(real_opens[0], True)
            builtins.open, io.open = spying(real_opens[1], False), spying(real_opens[2], False)
            loader.dist.broadcast = broadcast
            try:
                res["differences"] += [f"{sub}: {d}" for d in _differences(
                    plain, dist_checkpointing.load(sd, str(path / sub), sharded_strategy=strategy))]
            finally:
                (loader.os.open, builtins.open, io.open), loader.dist.broadcast = real_opens, real_broadcast
            for key, s in (("before", whole), ("after", strategy)):
                res[key][0] += s.read.data
                res[key][1] += s.read.header
            res["received"] += strategy.received
        out[name] = res
    return out
