"""What a training checkpoint hands Megatron-Core's dist_checkpointing, and the workarounds its save and load need.

The sharded state dicts (`TrainCheckpointer` saves and loads through them; the tensors are views of the live
state, so one dict serves a save and a load):
- `sharded_model`: the GPTModel's, through `models/sharding.py: model_sharded_state_dict` (the one that convert,
  eval and the initial weights use);
- `sharded_optimizer`: the LR scheduler, the trainer's counters and, once the optimizer has state, the optimizer
  (the distributed optimizer's per-parameter state in pieces, `optimizer_state`); `load_optimizer` restores it;
- `sharded_reference`: the KL reference model's weights, its keys behind `reference.` in the optimizer checkpoint
  (`saved_with_reference` tells whether a checkpoint holds them).

Workarounds, each for something Megatron-Core 0.16 does:
- `spread_replicas`: it picks DP rank 0 to write every replicated tensor; spread the writes over the DP group;
- `ensure_optimizer_state`: a fresh distributed optimizer has no state to load into without apex/TE;
- `unshare_adam_steps`: its load gives every parameter the same Adam `step` tensor;
- `no_common`: skip its cross-rank comparison of common state on ranks that hold none;
- `writer_logs_captured`: its writer processes log their errors; keep them for the error's message.

Megatron-Core is imported by the functions that use it: importing this module needs only torch.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.checkpointing import optimizer_state
from megatron_rl.checkpointing.layout import OPTIMIZER_DIR
from megatron_rl.checkpointing.reads import read_owners

# Optimizers other than the distributed one are written by Megatron-Core (each DP group's rank 0 holds the whole
# state already); the distributed optimizer's state is written in pieces by `optimizer_state`.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def sharded_model(engine) -> dict:
    """The trainer's GPTModel as a sharded state dict (this rank's shard, views of the live weights)."""
    from megatron_rl.models.sharding import model_sharded_state_dict

    return model_sharded_state_dict(engine.model.module, engine.pgs.dp_cp)


def spread_replicas(sharded_state_dict: dict, group, expert_group=None) -> None:
    """Decide which DP rank writes each model tensor, so that the weights' writes (and their host copies) are spread
    over the DP group instead of all falling on DP rank 0, the main replica Megatron-Core picks.

    Every DP rank of a model-parallel shard holds the same tensors, so each computes the same assignment alone, with
    no communication: `reads.read_owners`, the rule by which a resume picks the rank that reads each. The owner
    becomes the main replica (DP coordinate 0 of the replica id), the others not (1). Factories are applied first
    (SwiGLU's two halves are spread separately). A mixture of experts' expert weights (keys under `.experts.`) are
    held alike only by their expert-data-parallel group (`expert_group`; other DP ranks hold other experts): they
    are spread over that group, and left as Megatron-Core marks them without one."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    shards = [sh for sh in nested_values(sharded_state_dict)
              if isinstance(sh, ShardedTensor) and isinstance(sh.replica_id, tuple) and len(sh.replica_id) == 3]
    experts = [sh for sh in shards if ".experts." in sh.key]
    for grp, part in ((group, [sh for sh in shards if ".experts." not in sh.key]), (expert_group, experts)):
        if grp is None or grp.size() == 1 or not part:
            continue
        owners = read_owners([(sh.key, sh.global_offset, sh.data.numel() * sh.data.element_size()) for sh in part],
                             grp.size())
        for sh, owner in zip(part, owners):
            sh.replica_id = (*sh.replica_id[:2], 0 if owner == grp.rank() else 1)


_REFERENCE_PREFIX = "reference."


def sharded_reference(reference, engine) -> dict:
    """The KL reference model's sharded state: the policy's keys behind `reference.` (the state dict's own keys
    unchanged, so what `load` returns goes straight into `reference.load_state_dict`)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    from megatron_rl.models.sharding import model_sharded_state_dict

    sd = model_sharded_state_dict(reference, engine.pgs.dp_cp)
    replace_prefix_for_sharding(sd, "", _REFERENCE_PREFIX)
    return sd


def saved_with_reference(path: Path) -> bool:
    """Does the checkpoint at `path` hold a KL reference model? Reads only the optimizer checkpoint's index, on any
    rank, so that every rank can check before the collective `load`."""
    from megatron.core import dist_checkpointing

    index = dist_checkpointing.load_tensors_metadata(str(Path(path) / OPTIMIZER_DIR))
    return any(k.startswith(_REFERENCE_PREFIX) for k in index)


def ensure_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state yet, and without apex/TE its `state_dict()` needs the
    per-parameter `step` that only a real step creates. Megatron-Core's own remedy: one step on zero gradients,
    whose values the load then overwrites in place."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def unshare_adam_steps(optimizer) -> None:
    """Megatron-Core's load gives every parameter's torch Adam state the *same* `step` tensor object; torch
    increments each parameter's step in place, so a shared tensor advances once per parameter per update and
    the bias correction goes wrong from the first step after a resume. Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def has_optimizer_state(optimizer) -> bool:
    """Has the optimizer taken a step (Adam moments exist)? A job that starts from given weights saves its first
    checkpoint before any update: there is no optimizer state to save then, and resuming from it starts fresh."""
    return any(getattr(getattr(o, "optimizer", None), "state", None)
               for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def sharded_optimizer(engine, model_sd: dict, is_loading: bool, with_state: bool = True) -> dict:
    """The optimizer checkpoint's state dict: scheduler, counters and (once the optimizer has state) the optimizer,
    the distributed optimizer's per-parameter state in pieces (`optimizer_state`: each rank its own range, no
    gather; other optimizers as Megatron-Core writes them). The tensors are views of the live state, so the same
    dict serves a save and a load (`load_optimizer`)."""
    out = {
        "scheduler": engine.scheduler.state_dict(),
        "engine": engine.counters(),
    }
    if not with_state:
        return out
    opts = _distributed_optimizers(engine.optimizer)
    if opts is None:
        out["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(
            _OPTIM_METADATA, dp_cp_group=engine.pgs.dp_cp))
        return out
    parts = [{**o.state_dict(), "param_state": optimizer_state.sharded_param_state(o, model_sd)} for o in opts]
    out["optimizer"] = parts[0] if len(parts) == 1 else dict(enumerate(parts))
    return out


def _distributed_optimizers(optimizer) -> Optional[list]:
    """The DistributedOptimizers behind `optimizer` (a chain or one), or None when it is another kind."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return opts if all(isinstance(o, DistributedOptimizer) for o in opts) else None


def load_optimizer(engine, model_sd: dict, loaded: dict) -> None:
    """Restore the optimizer from what `dist_checkpointing.load` returned for `sharded_optimizer`:
    the common state (param groups, the step) through Megatron-Core, then each rank's own range of the
    per-parameter state (any layout; also checkpoints written in the `fully_reshardable` format, whose keys and
    shapes are the same)."""
    opts = _distributed_optimizers(engine.optimizer)
    if opts is None:
        engine.optimizer.load_state_dict(loaded)
        return
    parts = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    for o, part in zip(opts, parts):
        common = {k: v for k, v in part.items() if k not in ("param_state", "param_state_sharding_type")}
        o.load_state_dict(common)  # param groups and step; the state tensors keep their storage
        # The views are built again after that load, in case the inner optimizer replaced its state tensors.
        optimizer_state.apply(optimizer_state.sharded_param_state(o, model_sd), part["param_state"])


def no_common(common_state_dict: dict) -> dict:
    """A `preprocess_common` for the write plan: ranks without trainer state (generators) hold no common state
    either, so Megatron-Core's cross-rank comparison of common state dicts would only report that."""
    return {}


@contextlib.contextmanager
def writer_logs_captured():
    """Megatron-Core's checkpoint writers log their errors (a full disk, from a writer process) before the save
    raises a CheckpointException that names none: keep those records off the terminal, for the error's message
    (failure.log), not the console."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.name}: {record.getMessage()}"[:500])

    log = logging.getLogger("megatron.core.dist_checkpointing")
    handler, propagate = _Keep(logging.ERROR), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
