"""Training checkpoints: one sharded, reshardable checkpoint per saved step, written atomically.

Layout of a run's checkpoint root (see checkpoints/README.md):

    ROOT/step_00000042/           one complete checkpoint (the name is the number of trainer steps done)
        megatron_rl.json          format, step, weight version, the layout it was written with, model shape,
                                  tokenizer, and a manifest (every file with its size and CRC-32) written last
        model/                    Megatron-Core dist_checkpointing (torch_dist) of the GPTModel: the same as a
                                  converted checkpoint, so `convert --to hf`, `eval` and `inspect` read it
        optimizer/                dist_checkpointing of the optimizer in its fully reshardable form (the
                                  distributed optimizer's state per parameter, not per DP bucket), the LR
                                  scheduler, the trainer's counters and, in runs with a KL penalty, the frozen
                                  reference model's weights (keys `reference.*`)
        rng/rank_00000.pt         per-rank RNG states (restored when the layout is unchanged)
        rl_state.pt               the controller's state: next step, weight version, rollouts of batches that
                                  were generated with weights older than this checkpoint (they cannot be
                                  regenerated after a restart), counters
    ROOT/step_00000050.tmp/       a write in progress (or killed midway): never read, removed by the next save
    ROOT/latest                   the name of the newest complete checkpoint, replaced atomically after the
                                  rename, so it never points at a partial write

Every rank of the torch.distributed world calls `save` / `load` (dist_checkpointing coordinates over the default
group); ranks that hold no trainer state (generator executors) pass `engine=None` and write nothing.

A save refuses non-finite state (weights, main parameters, Adam moments) on any rank. Each file's checksum is
computed right after the write by the rank that wrote it (its shards, its RNG file; rank 0 the rest), while the file
is still in that node's page cache; `find` and `load` check the checksums with the files split over the ranks, so a
corrupt shard is named in one line and `fallback` can skip it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.checkpointing.layout import (CHECKSUM_MISMATCH, CHECKSUMS, LATEST, MANIFEST, META, MODEL_DIR,
                                              OPTIMIZER_DIR, RL_STATE, RNG_DIR, STEP_DIR, TOKENIZER_DIR, TRAIN_FORMAT,
                                              CheckpointError, checksum_mismatches, file_checksum, manifest,
                                              manifest_problems, read_latest, step_dir_name)
from megatron_rl.checkpointing import storage
from megatron_rl.checkpointing.tokenizer import save_tokenizer
from megatron_rl.failpoints import failpoint

logger = logging.getLogger(__name__)

# Megatron-Core is imported by the functions that use it: importing this module (the controller does) needs only torch.

# The distributed optimizer's state is saved per parameter (canonical form), so it loads at any TP/PP/DP.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# A rank whose weights are smaller than this saves with one writer process (`_save_strategy`).
ONE_WRITER_BELOW_BYTES = 64 << 20


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved, current = state["tracker"], tracker.get_states()
    if any(name in current and saved[name].numel() != current[name].numel() for name in saved):
        # Saved on another kind of device: a CPU generator's state is 5,056 bytes, a CUDA one's 16. The tracker
        # keeps the states this run seeded (from the job's seed and TP rank); nothing else depends on them here
        # (no dropout), so the resumed run trains the same, with one line saying so.
        logger.warning("the checkpoint's model-parallel RNG states come from another kind of device "
                       "(%d bytes, here %d); continuing from this run's seeded states",
                       next(iter(saved.values())).numel(), next(iter(current.values())).numel())
        return
    tracker.set_states(saved)


def _model_sharded_state_dict(engine) -> dict:
    return engine.model.module.sharded_state_dict(metadata={"dp_cp_group": engine.pgs.dp_cp})


_REFERENCE_PREFIX = "reference."


def _reference_sharded_state_dict(reference, engine) -> dict:
    """The KL reference model's sharded state: the policy's keys behind `reference.` (the state dict's own keys
    unchanged, so what `load` returns goes straight into `reference.load_state_dict`)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    sd = reference.sharded_state_dict(metadata={"dp_cp_group": engine.pgs.dp_cp})
    replace_prefix_for_sharding(sd, "", _REFERENCE_PREFIX)
    return sd


def saved_with_reference(path: Path) -> bool:
    """Does the checkpoint at `path` hold a KL reference model? Reads only the optimizer checkpoint's index, on any
    rank, so that every rank can check before the collective `load`."""
    from megatron.core import dist_checkpointing

    index = dist_checkpointing.load_tensors_metadata(str(Path(path) / OPTIMIZER_DIR))
    return any(k.startswith(_REFERENCE_PREFIX) for k in index)


def _ensure_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state yet, and without apex/TE its `state_dict()` needs the
    per-parameter `step` that only a real step creates. Megatron-Core's own remedy: one step on zero gradients,
    whose values the load then overwrites in place."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_step_tolerated():
    """Megatron-Core 0.16 restores torch Adam's per-parameter `step` from the param groups, then copies every
    state key of the live optimizer from the checkpoint's per-parameter tensors, which do not carry `step`
    (KeyError 'step' without apex/TE). During our load, the step already set is passed through unchanged."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = {**tensors, "step": state["step"].clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def _unshare_adam_steps(optimizer) -> None:
    """Megatron-Core's load gives every parameter's torch Adam state the *same* `step` tensor object; torch
    increments each parameter's step in place, so a shared tensor advances once per parameter per update and
    the bias correction goes wrong from the first step after a resume. Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _has_optimizer_state(optimizer) -> bool:
    """Has the optimizer taken a step (Adam moments exist)? A job that starts from given weights saves its first
    checkpoint before any update: there is no optimizer state to save then, and resuming from it starts fresh."""
    return any(getattr(getattr(o, "optimizer", None), "state", None)
               for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_sharded_state_dict(engine, model_sd: dict, is_loading: bool, with_state: bool = True) -> dict:
    metadata = dict(_OPTIM_METADATA, dp_cp_group=engine.pgs.dp_cp)
    out = {
        "scheduler": engine.scheduler.state_dict(),
        "engine": {"steps_done": engine.steps_done, "nonfinite_total": engine.nonfinite_total,
                   "nonfinite_in_a_row": engine.nonfinite_in_a_row},
    }
    if with_state:
        out["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return out


def _no_common(common_state_dict: dict) -> dict:
    return {}


def _device() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _save_strategy(engine):
    """Megatron-Core's default torch_dist save strategy, with one writer process instead of its default two when this
    rank's weights are smaller than `ONE_WRITER_BELOW_BYTES`.

    Every save forks its writers from the rank; for a small shard a fork of a process holding torch, Megatron-Core
    and the job costs more than the writing, which a second writer only splits. The format is the same either way
    (a rank writes one `__<rank>_<i>.distcp` file per writer) and loads with any writer count."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) if engine is not None else 0
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1 if weights < ONE_WRITER_BELOW_BYTES else 2)


def _results_stay_in_process() -> None:
    """Give Megatron-Core's torch_dist writer a plain queue for its write results, before its first save here.

    Left alone, the writer's first save starts a `multiprocessing.Manager` server (a fresh interpreter: seconds on a
    CPU, in every rank that writes) to serve that queue to background savers. Our saves are synchronous: the writer
    processes hand their results to the rank, which puts them on this queue and reads them back in the same save,
    so nothing crosses a process boundary through it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _state_finite_everywhere(engine) -> bool:
    """Collective over the world: is the trainer state of every rank finite (`TrainEngine.state_finite`)?"""
    bad = torch.zeros(1, device=_device())
    if engine is not None and not engine.state_finite():
        bad.fill_(1.0)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


# The files a rank writes itself: dist_checkpointing's shards `[prefix]__<rank>_<i>.distcp`, our `rng/rank_<rank>.pt`.
_WRITER_RANK = re.compile(r"__(\d+)_\d+\.distcp$|^rank_(\d+)\.pt$")


def _writer_rank(name: str, world_size: int) -> int:
    """The rank that wrote the checkpoint file called `name` (rank 0 for files it cannot tell)."""
    m = _WRITER_RANK.search(name)
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world_size else 0


def _checksums(tmp: Path) -> Optional[dict[str, str]]:
    """Collective: the checksum of every file under `tmp`, each computed by the rank that wrote it; the whole map
    on rank 0 (None elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    mine = {rel: file_checksum(tmp / rel) for rel in files if _writer_rank(Path(rel).name, world) == rank}
    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {rel: c for part in parts for rel, c in part.items()} if rank == 0 else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories under `root`, oldest first (`*.tmp*` writes excluded)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def verify(path: Path, checksums: bool = False) -> dict:
    """Check a checkpoint is complete (every file of the manifest present with its size) and, with `checksums`,
    unmodified (every file's content matches its checksum; this reads every file); returns its metadata, else
    raises CheckpointError naming what is wrong in one line."""
    path = Path(path)
    meta_path = path / META
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if ".tmp" in path.name:
        raise CheckpointError(f"{path}: incomplete checkpoint (a write that never finished)")
    if not meta_path.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint ({META} missing)")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: corrupt ({e})") from None
    if meta.get("format") != TRAIN_FORMAT:
        raise CheckpointError(f"{path}: not a training checkpoint (format {meta.get('format')!r})")
    problems = manifest_problems(path, meta)
    if problems:
        raise CheckpointError(f"{path}: corrupt checkpoint ({problems[0]})")
    if checksums:
        _raise_mismatch(path, checksum_mismatches(path, meta))
    return meta


@contextlib.contextmanager
def _writer_logs_captured():
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


def _raise_mismatch(path: Path, mismatches: list[str]) -> None:
    if mismatches:
        more = f" (and {len(mismatches) - 1} more files)" if len(mismatches) > 1 else ""
        raise CheckpointError(f"{path / mismatches[0]}: {CHECKSUM_MISMATCH}{more}")


@dataclasses.dataclass
class TrainCheckpointer:
    """Saves and finds the training checkpoints of one run under `root`."""

    root: Path
    keep_last: int = 2
    log: Optional[Callable[[str], None]] = None  # rank 0's notes (unfinished saves removed)

    def __post_init__(self):
        self.root = Path(self.root)
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        self._verified: set[Path] = set()  # checkpoints whose checksums `verify` has read (find, then load)

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self, step: int, engine=None, *, reference=None, layout=None, model_cfg=None,
             rl_state: Optional[dict] = None, tokenizer: Optional[dict] = None, extra: Optional[dict] = None) -> Path:
        """Collective over the world. Trainer ranks pass their TrainEngine (and the layout / model shape, and the
        KL reference model when the run has one: `RLTrainer.reference`); the controller (rank 0) passes
        `rl_state`. `tokenizer` is the metadata entry, or {"source": PATH} to copy a tokenizer (HF directory,
        .gguf, sentencepiece .model) into the checkpoint. Returns the final path.

        When the filesystem refuses the save (full, read-only, permissions, gone), CheckpointError in one line that
        names the directory, the cause, what to do and the checkpoint kept; the unfinished write is removed."""
        name = step_dir_name(step)
        try:
            with _writer_logs_captured() as records:
                return self._save(step, name, engine, reference=reference, layout=layout, model_cfg=model_cfg,
                                  rl_state=rl_state, tokenizer=tokenizer, extra=extra)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - Megatron-Core's CheckpointException is a BaseException
            problem = storage.diagnose(self.root, e)
            if problem is None:
                raise
            shutil.rmtree(self.root / f"{name}.tmp", ignore_errors=True)  # it must not hold the next save's space
            latest = read_latest(self.root)
            kept = f"the last complete checkpoint, {latest.name}, is kept" if latest else "no checkpoint was saved"
            raise CheckpointError(f"{self.root}: {name} not saved: {problem}; {kept}"
                                  + "".join(f"\n  {r}" for r in records)) from e

    def _save(self, step: int, name: str, engine, *, reference, layout, model_cfg, rl_state, tokenizer,
              extra) -> Path:
        from megatron.core import dist_checkpointing

        rank = dist.get_rank()
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        self._verified.discard(final)
        t0 = time.perf_counter()
        if not _state_finite_everywhere(engine):
            raise CheckpointError(f"{final}: not written: the trainer's weights or optimizer state hold non-finite "
                                  f"values (the last finite state is the newest checkpoint)")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self.remove_unfinished()
            for sub in (MODEL_DIR, OPTIMIZER_DIR, RNG_DIR):
                (tmp / sub).mkdir(parents=True)
        dist.barrier()
        # Ranks without trainer state (generators) hold no common state either: skip the cross-rank comparison
        # of common state dicts, which would only report that.
        save = functools.partial(dist_checkpointing.save, preprocess_common_before_consistancy_check=_no_common,
                                 sharded_strategy=_save_strategy(engine))
        _results_stay_in_process()
        if engine is not None:
            model_sd = _model_sharded_state_dict(engine)
            save(model_sd, str(tmp / MODEL_DIR))
        else:
            save({}, str(tmp / MODEL_DIR))
        failpoint("checkpoint_between_model_and_optimizer", name)
        if engine is not None:
            optimizer_state = _has_optimizer_state(engine.optimizer)
            optim_sd = _optimizer_sharded_state_dict(engine, _model_sharded_state_dict(engine), is_loading=False,
                                                     with_state=optimizer_state)
            if reference is not None:
                optim_sd["reference"] = _reference_sharded_state_dict(reference, engine)
            save(optim_sd, str(tmp / OPTIMIZER_DIR))
            torch.save(_rng_state(), tmp / RNG_DIR / f"rank_{rank:05d}.pt")
        else:
            save({}, str(tmp / OPTIMIZER_DIR))
        if rank == 0 and rl_state is not None:
            torch.save(rl_state, tmp / RL_STATE)
        if rank == 0 and tokenizer is not None and "source" in tokenizer:
            # The checkpoint carries its tokenizer's files, so that it stands on its own (eval, convert, resume).
            tokenizer = save_tokenizer(Path(tokenizer["source"]), tmp / TOKENIZER_DIR)
        dist.barrier()
        checksums = _checksums(tmp)
        if rank == 0:
            meta = {
                "format": TRAIN_FORMAT, "step": step,
                "weight_version": (rl_state or {}).get("weight_version", step),
                "layout": dataclasses.asdict(layout) if layout is not None else None,
                "world_size": dist.get_world_size(),
                "dtype": (str(next(engine.model.module.parameters()).dtype).replace("torch.", "")
                          if engine is not None else None),
                "model": dataclasses.asdict(model_cfg) if model_cfg is not None else None,
                "tokenizer": tokenizer, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "optimizer_state": _has_optimizer_state(engine.optimizer) if engine is not None else None,
                **(extra or {}),
            }
            meta[MANIFEST] = manifest(tmp)
            meta[CHECKSUMS] = checksums
            _fsync_write(tmp / META, json.dumps(meta, indent=2))
            failpoint("checkpoint_before_rename", name)
            if final.exists():  # an earlier run saved this step (e.g. a resume that repeats it): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            pointer_tmp = self.root / f"{LATEST}.tmp"
            _fsync_write(pointer_tmp, name + "\n")
            os.replace(pointer_tmp, self.root / LATEST)
            _fsync_dir(self.root)
            self._prune(keep=final)
        dist.barrier()
        self.last_save_s = time.perf_counter() - t0
        return final

    def remove_unfinished(self) -> None:
        """Delete the `step_*.tmp` left by saves that failed or were killed (rank 0: before a save, and on resume),
        and say how much space that gave back."""
        names, freed = storage.remove_unfinished(self.root)
        if names and self.log is not None:
            self.log(f"removed {len(names)} unfinished checkpoint write{'s' if len(names) > 1 else ''} "
                     f"({', '.join(names)}): {storage.human_bytes(freed)} freed in {self.root}")

    def _prune(self, keep: Path) -> None:
        complete = [p for _, p in list_checkpoints(self.root)]
        for p in complete[: max(len(complete) - self.keep_last, 0)]:
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob("step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)

    # ---- find and load ---------------------------------------------------------------------------------------
    def verify(self, path: Path) -> dict:
        """`verify(path, checksums=True)`, collective when torch.distributed is initialized: each rank reads a
        share of the files, and every rank gets the same answer. Remembered, so that `load` after `find` reads the
        files once."""
        path = Path(path)
        meta = verify(path)
        if path in self._verified:
            return meta
        files = sorted(meta.get(CHECKSUMS) or {})
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank, world = dist.get_rank(), dist.get_world_size()
            parts: list = [None] * world
            dist.all_gather_object(parts, checksum_mismatches(path, meta, files[rank::world]))
            mismatches = sorted(rel for part in parts for rel in part)
        else:
            mismatches = checksum_mismatches(path, meta, files)
        _raise_mismatch(path, mismatches)
        self._verified.add(path)
        return meta

    def find(self, fallback: bool = False) -> Optional[Path]:
        """The checkpoint to resume from: the one `latest` names, verified. None when the run has none.

        A corrupt or incomplete latest checkpoint is an error naming it, unless `fallback` asks for the newest
        earlier checkpoint that verifies."""
        latest = read_latest(self.root)
        if latest is None:
            if list_checkpoints(self.root):
                raise CheckpointError(f"{self.root}: checkpoints present but no '{LATEST}' pointer; pass the "
                                      f"step directory explicitly or restore the pointer")
            return None
        try:
            self.verify(latest)
            return latest
        except CheckpointError as e:
            if not fallback:
                older = [p.name for s, p in list_checkpoints(self.root) if p != latest]
                hint = (f"; set checkpoint.fallback=true to resume from {older[-1]}" if older else "")
                raise CheckpointError(f"{e}{hint}") from None
        for _, p in reversed(list_checkpoints(self.root)):
            if p == latest:
                continue
            try:
                self.verify(p)
                return p
            except CheckpointError:
                continue
        raise CheckpointError(f"{self.root}: no loadable checkpoint (latest {latest.name} is corrupt)")

    def load(self, path: Path, engine=None, reference=None) -> dict:
        """Collective over the world: restores model, optimizer, scheduler, counters (trainer ranks), the KL
        reference model's weights into `reference` when given (CheckpointError if the checkpoint has none) and,
        when the world and layout are those it was written with, the RNG states. Returns the metadata plus
        `rl_state` (the controller's state, on every rank)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        meta = self.verify(path)
        if reference is not None and not saved_with_reference(path):
            raise CheckpointError(f"{path}: saved without a KL reference model, which this run needs (it was "
                                  f"written by a run with algorithm.kl_coef = 0?)")
        if engine is not None:
            with_state = meta.get("optimizer_state") is not False
            if with_state:
                _ensure_optimizer_state(engine.optimizer)
            model_sd = _model_sharded_state_dict(engine)
            state = dist_checkpointing.load(model_sd, str(path / MODEL_DIR))
            engine.model.module.load_state_dict(state)
            optim_sd = _optimizer_sharded_state_dict(engine, _model_sharded_state_dict(engine), is_loading=True,
                                                     with_state=with_state)
            if reference is not None:
                optim_sd["reference"] = _reference_sharded_state_dict(reference, engine)
            ostate = dist_checkpointing.load(optim_sd, str(path / OPTIMIZER_DIR))
            if reference is not None:
                reference.load_state_dict(ostate["reference"])
            if with_state:
                with _torch_adam_step_tolerated():
                    engine.optimizer.load_state_dict(ostate["optimizer"])
                _unshare_adam_steps(engine.optimizer)
            else:  # saved before the first update: the main parameters are still copies of the old weights
                engine.optimizer.reload_model_params()
            engine.scheduler.load_state_dict(ostate["scheduler"])
            for k, v in ostate["engine"].items():
                setattr(engine, k, v)
            rng = path / RNG_DIR / f"rank_{dist.get_rank():05d}.pt"
            same_world = meta.get("world_size") == dist.get_world_size()
            if same_world and rng.exists():
                _set_rng_state(torch.load(rng, weights_only=False))
        else:
            dist_checkpointing.load({}, str(path / MODEL_DIR))
            dist_checkpointing.load({}, str(path / OPTIMIZER_DIR))
        rl = path / RL_STATE
        meta["rl_state"] = torch.load(rl, weights_only=True) if rl.exists() else {}
        dist.barrier()
        return meta
