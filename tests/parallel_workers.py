"""Worker functions run on every rank by the multi-process tests (importable by the fork server)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.models import build_gpt_model, get_preset
from full_state import gather_full_state_dict
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import TrainEngine
from megatron_rl.training.settings import LRSchedule, TrainerSettings
from megatron_rl.training.lm_loss import make_lm_loss


def make_batch(vocab: int, batch: int = 8, seq: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, : seq // 4] = 0  # a "prompt" that is not trained on
    loss_mask[1, -3:] = 0  # a shorter sequence
    return {"tokens": tokens, "loss_mask": loss_mask}


def split_for_rank(batch: dict, dp: int, dp_rank: int, micro: int) -> list[dict]:
    """This DP rank's share of the global batch, as micro-batches of `micro` sequences."""
    n = batch["tokens"].shape[0] // dp
    mine = {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in batch.items()}
    return [{k: v[i:i + micro] for k, v in mine.items()} for i in range(0, n, micro)]


def lm_step_worker(rank, world_size, layout_kw, preset_kw, state_path, attention, micro, optim, out_path=None):
    """Load the logical weights, compute logits for the batch, take one Adam step; return logits, loss, params."""
    layout = ParallelLayout(**layout_kw)
    cfg = get_preset("tiny", **preset_kw)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention=attention, seed=7)
    if state_path is None:
        full = gather_full_state_dict(model, cfg, g.pgs)
        load_full_state_dict(model, full, cfg, g.pgs)  # zero the padding rows as in every layout
        if rank == 0:
            torch.save(full, out_path)
    else:
        load_full_state_dict(model, torch.load(state_path), cfg, g.pgs)
    engine = TrainEngine.create(model, g.pgs, TrainerSettings(clip_grad=1.0, adam_eps=optim["adam_eps"]),
                                LRSchedule(lr=optim["lr"]))
    batch = make_batch(cfg.vocab_size)
    micro_batches = split_for_rank(batch, layout.dp, g.dp_rank, micro)
    loss_fn = make_lm_loss(g.pgs.tp, cfg.vocab_size)

    captured = []

    def logits_fn(logits, mb):
        shards = [torch.empty_like(logits) for _ in range(layout.tp)]
        dist.all_gather(shards, logits.detach().contiguous(), group=g.pgs.tp)
        captured.append(torch.cat(shards, dim=-1)[..., : cfg.vocab_size])
        return loss_fn(logits, mb)

    with torch.no_grad():
        engine.forward_backward(micro_batches, logits_fn, forward_only=True)
    metrics = engine.step(micro_batches, loss_fn)
    params = gather_full_state_dict(model, cfg, g.pgs)
    logits = torch.cat(captured) if captured else None
    return {"dp_rank": g.dp_rank, "last": g.is_last_stage, "tp_rank": g.tp_rank, "logits": logits,
            "metrics": metrics, "params": params}


def two_executors_worker(rank, world_size, placements_kw):
    """Build several executors in one world; run collectives inside each executor's own groups."""
    placements = [ExecutorPlacement(name, ParallelLayout(**lay), first) for name, lay, first in placements_kw]
    topo = build_topology(placements)
    out = {}
    for name, g in topo.items():
        if not g.is_member:
            out[name] = None
            continue
        info = {"coords": g.coords}
        for dim in ("tp", "pp", "dp", "mp", "embd"):
            group = getattr(g.pgs, dim)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            info[dim] = (dist.get_process_group_ranks(group), t.item())
        # each group's own timeout for one collective (torch would give a new group gloo's 30 min default)
        info["timeouts"] = {getattr(g.pgs, dim)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                            for dim in ("tp", "pp", "dp", "mp", "embd", "intra_dist_opt")}
        out[name] = info
    # Interleave the executors' collectives (as a running job does) to show they do not wait on each other.
    for _ in range(3):
        for name, g in topo.items():
            if g.is_member:
                t = torch.ones(1)
                dist.all_reduce(t, group=g.pgs.intra_dist_opt)
                assert t.item() == g.layout.size
    return out


def model_in_two_executors_worker(rank, world_size):
    """Colocated: a trainer TP=2 and a generator TP=1 x DP=2 on the same two ranks, each with its own model."""
    cfg = get_preset("tiny")
    topo = build_topology([ExecutorPlacement("trainer", ParallelLayout(tp=2)),
                           ExecutorPlacement("generator", ParallelLayout(tp=1, dp=2))])
    t, g = topo["trainer"], topo["generator"]
    trainer = build_gpt_model(cfg, t.layout, t.pgs, attention="sdpa")
    generator = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    full = gather_full_state_dict(trainer, cfg, t.pgs)
    load_full_state_dict(generator, full, cfg, g.pgs)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    from megatron_rl.training.engine import model_forward

    with torch.no_grad():
        lt = model_forward(trainer, tokens, False)
        shards = [torch.empty_like(lt) for _ in range(2)]
        dist.all_gather(shards, lt.contiguous(), group=t.pgs.tp)
        lt = torch.cat(shards, -1)[..., : cfg.vocab_size]
        lg = model_forward(generator, tokens, False)[..., : cfg.vocab_size]
    return (lt - lg).abs().max().item()


def dist_checkpoint_worker(rank, world_size, layout_kw, ckpt_dir, mode):
    """Save the model with Megatron-Core's dist_checkpointing in one layout, or load it in another: into a model
    built without initialization (`initialize=False`, as a job's trainer builds one that resumes), which must
    draw no random number and still shard as an initialized one (its tensor-parallel attributes)."""
    from megatron.core import dist_checkpointing

    layout = ParallelLayout(**layout_kw)
    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=11 if mode == "save" else 99,
                            initialize=mode == "save")
    if mode == "load":
        after = torch.random.get_rng_state()
        assert torch.equal(after, torch.manual_seed(99).get_state()), "an uninitialized build drew random numbers"
    metadata = {"dp_cp_group": g.pgs.dp_cp}
    if mode == "save":
        import os

        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), ckpt_dir)
        return gather_full_state_dict(model, cfg, g.pgs)
    state = dist_checkpointing.load(model.sharded_state_dict(metadata=metadata), ckpt_dir)
    model.load_state_dict(state)
    plain = gather_full_state_dict(model, cfg, g.pgs)
    # Again through `model_sharded_state_dict`, into weights poisoned with NaN: each SwiGLU fc1 merge returns the
    # parameter itself (its halves were read into it), and a merge of pieces read elsewhere is Megatron-Core's cat.
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron_rl.models.sharding import model_sharded_state_dict

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    sharded = model_sharded_state_dict(model, g.pgs.dp_cp)
    factories = {k: f for k, f in sharded.items() if isinstance(f, ShardedTensorFactory)}
    params = dict(model.state_dict(keep_vars=True))
    state = dist_checkpointing.load(sharded, ckpt_dir)
    in_place = {k: state[k].data_ptr() == params[k].data_ptr() for k in factories}
    model.load_state_dict(state)
    f = next(iter(factories.values()))
    pieces = [sh.data.clone() for sh in nested_values(f.build())]
    merged = f.merge_fn(pieces)
    elsewhere = bool(torch.equal(merged, torch.cat(pieces)) and merged.data_ptr() != f.data.data_ptr())
    return {"plain": plain, "in_place_load": gather_full_state_dict(model, cfg, g.pgs), "in_place": in_place,
            "elsewhere_merged": elsewhere}


def rank_and_world_worker(rank, world_size):
    """(rank, world size) as the process group sees them."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def imported_at_start(rank, world_size, names):
    """Which of `names` this rank had imported when it started (what its fork server preloaded)."""
    import sys

    return [name in sys.modules for name in names]


def frozen_at_start(rank, world_size):
    """How many objects this rank started with out of the garbage collector's reach (what its fork server froze)."""
    import gc

    return gc.get_freeze_count()



def threads_at_start(rank, world_size):
    """The torch threads this rank was given."""
    import torch

    return torch.get_num_threads()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def others_running_a_second_after_returning(rank, world_size, pid_dir):
    """Every rank writes its pid to `pid_dir`; ranks 1.. then return at once, while rank 0 waits for all the pids,
    waits a second more, and returns whether each of the others' processes still runs."""
    import os
    import time
    from pathlib import Path

    d = Path(pid_dir)
    (d / f"{rank}.tmp").write_text(str(os.getpid()))
    os.replace(d / f"{rank}.tmp", d / str(rank))
    if rank != 0:
        return None
    while not all((d / str(r)).exists() for r in range(world_size)):
        time.sleep(0.01)
    time.sleep(1.0)
    return [_running(int((d / str(r)).read_text())) for r in range(1, world_size)]
