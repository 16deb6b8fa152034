"""Training checkpoints: one sharded, reshardable checkpoint per saved step, written atomically.

Layout of a run's checkpoint root (see checkpoints/README.md):

    ROOT/step_00000042/           one complete checkpoint (the name is the number of trainer steps done)
        megatron_rl.json          format, step, weight version, the layout it was written with, model shape,
                                  tokenizer, and a manifest (every file with its size and CRC-32) written last
        model/                    Megatron-Core dist_checkpointing (torch_dist) of the GPTModel: the same as a
                                  converted checkpoint, so `convert --to hf`, `eval` and `inspect` read it
        optimizer/                dist_checkpointing of the optimizer in model space (the distributed
                                  optimizer's state per parameter, each rank writing the pieces it owns:
                                  `optimizer_state`; it loads at any TP/PP/DP), the LR scheduler, the trainer's counters and, in runs with a KL penalty, the frozen
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
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.checkpointing.layout import (CHECKSUM_MISMATCH, CHECKSUMS, LATEST, MANIFEST, META, MODEL_DIR,
                                              OPTIMIZER_DIR, RL_STATE, RNG_DIR, STEP_DIR, TOKENIZER_DIR, TRAIN_FORMAT,
                                              CheckpointError, checksum_mismatches, file_checksums, manifest,
                                              manifest_problems, read_latest, step_dir_name)
from megatron_rl.checkpointing import background, optimizer_state, safe_load, storage
from megatron_rl.checkpointing.tokenizer import save_tokenizer
from megatron_rl.failpoints import failpoint

logger = logging.getLogger(__name__)

# Megatron-Core is imported by the functions that use it: importing this module (the controller does) needs only torch.

# Optimizers other than the distributed one are written by Megatron-Core (each DP group's rank 0 holds the whole
# state already); the distributed optimizer's state is written in pieces by `optimizer_state`.
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
    """Every RNG's state as tensors, numbers and tuples: what `torch.load(weights_only=True)` reads back."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, *rest = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), *rest)
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

        kind, keys, *rest = state["numpy"]  # keys: a tensor, or an array where the file holds numpy's own state
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), *rest))
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
    from megatron_rl.models.sharding import model_sharded_state_dict

    return model_sharded_state_dict(engine.model.module, engine.pgs.dp_cp)


def _spread_replicas(sharded_state_dict: dict, group) -> None:
    """Decide which DP rank writes each model tensor, so that the weights' writes (and their host copies) are spread
    over the DP group instead of all falling on DP rank 0, the main replica Megatron-Core picks.

    Every DP rank of a model-parallel shard holds the same tensors, so each computes the same assignment alone, with
    no communication: the tensors largest first (then by key and offset), each to the least-loaded rank. The owner
    becomes the main replica (DP coordinate 0 of the replica id), the others not (1). Factories are applied first
    (SwiGLU's two halves are spread separately)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    size, rank = group.size(), group.rank()
    apply_factories(sharded_state_dict)
    if size == 1:
        return
    shards = [sh for sh in nested_values(sharded_state_dict)
              if isinstance(sh, ShardedTensor) and isinstance(sh.replica_id, tuple) and len(sh.replica_id) == 3]
    shards.sort(key=lambda sh: (-sh.data.numel() * sh.data.element_size(), sh.key, sh.global_offset))
    loads = [0] * size
    for sh in shards:
        owner = min(range(size), key=lambda r: (loads[r], r))
        loads[owner] += sh.data.numel() * sh.data.element_size()
        sh.replica_id = (*sh.replica_id[:2], 0 if owner == rank else 1)


_REFERENCE_PREFIX = "reference."


def _reference_sharded_state_dict(reference, engine) -> dict:
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


def _ensure_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state yet, and without apex/TE its `state_dict()` needs the
    per-parameter `step` that only a real step creates. Megatron-Core's own remedy: one step on zero gradients,
    whose values the load then overwrites in place."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


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
    """The optimizer checkpoint's state dict: scheduler, counters and (once the optimizer has state) the optimizer,
    the distributed optimizer's per-parameter state in pieces (`optimizer_state`: each rank its own range, no
    gather; other optimizers as Megatron-Core writes them). The tensors are views of the live state, so the same
    dict serves a save and a load (`_load_optimizer`)."""
    out = {
        "scheduler": engine.scheduler.state_dict(),
        "engine": {"steps_done": engine.steps_done, "nonfinite_total": engine.nonfinite_total,
                   "nonfinite_in_a_row": engine.nonfinite_in_a_row},
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


def _load_optimizer(engine, model_sd: dict, loaded: dict) -> None:
    """Restore the optimizer from what `dist_checkpointing.load` returned for `_optimizer_sharded_state_dict`:
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


def _no_common(common_state_dict: dict) -> dict:
    return {}


def _device() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _writer_count(engine) -> int:
    """Files (and writer threads) per rank and directory. A rank whose weights are smaller than
    `ONE_WRITER_BELOW_BYTES` writes one file (fewer, larger files); larger shards are written by several threads,
    since one thread serializes at a few hundred MB/s (measured: 7.6 s for 1.9 GB with one, 4.2 s with two, 3.9 s
    with eight on this 2-core machine, where the disk is the limit at two): two, and up to four where the node has
    the cores. The format is the same either way (`__<rank>_<i>.distcp` per writer) and loads with any count."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) if engine is not None else 0
    if weights < ONE_WRITER_BELOW_BYTES:
        return 1
    return min(4, max(2, (os.cpu_count() or 2) // 4))


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


def _files(tmp: Path) -> list[str]:
    """Every file under `tmp`, relative, sorted (the markers of a background save excluded)."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p.is_file() and background.MARKERS not in p.relative_to(tmp).parts)


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


def storage_fault_line(root: Path, what: str, problem: str) -> str:
    """The one line for a storage fault under a run's checkpoint root: what failed, the diagnosis
    (`storage.diagnose`), and the checkpoint a relaunch resumes from."""
    latest = read_latest(Path(root))
    kept = f"the last complete checkpoint, {latest.name}, is kept" if latest else "no checkpoint was saved"
    return f"{root}: {what}: {problem}; {kept}"


@dataclasses.dataclass
class _Pending:
    """A save whose files are being written in the background (`TrainCheckpointer.wait` ends it)."""

    name: str
    tmp: Path
    thread: threading.Thread
    started: float
    blocking_s: float
    error: Optional[str] = None  # this rank's one-line error (rank 0: also the first other rank's, or its own)
    written: threading.Event = dataclasses.field(default_factory=threading.Event)  # this rank's files are written
    finished: Optional[float] = None  # when this rank's part ended (rank 0: the checkpoint complete)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)  # rank 0: stop waiting for markers


@dataclasses.dataclass
class TrainCheckpointer:
    """Saves and finds the training checkpoints of one run under `root`.

    With `async_save`, `save` returns once this rank's state is copied out (training goes on) and the checkpoint
    completes in the background (`background.py`); the next `save`, and `wait` (the job calls it when it ends),
    wait for it and raise its failure in one line. Without, `save` returns when the checkpoint is complete."""

    root: Path
    keep_last: int = 2
    log: Optional[Callable[[str], None]] = None  # rank 0's notes (unfinished saves removed)
    async_save: bool = False

    def __post_init__(self):
        self.root = Path(self.root)
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        self._verified: set[Path] = set()  # checkpoints whose checksums `verify` has read (find, then load)
        self._staging = background.HostStaging(keep=self.async_save)
        self._pending: Optional[_Pending] = None
        self.last_save_s = self.last_blocking_s = 0.0
        self.last_staged_bytes = 0  # the tensor bytes this rank copied out (and writes) in the last save

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self, step: int, engine=None, *, reference=None, layout=None, model_cfg=None,
             rl_state: Optional[dict] = None, tokenizer: Optional[dict] = None, extra: Optional[dict] = None) -> Path:
        """Collective over the world. Trainer ranks pass their TrainEngine (and the layout / model shape, and the
        KL reference model when the run has one: `RLTrainer.reference`); the controller (rank 0) passes
        `rl_state`. `tokenizer` is the metadata entry, or {"source": PATH} to copy a tokenizer (HF directory,
        .gguf, sentencepiece .model) into the checkpoint. Returns the final path (complete once `wait` returns).

        When the filesystem refuses the save (full, read-only, permissions, gone), CheckpointError in one line that
        names the directory, the cause, what to do and the checkpoint kept; the unfinished write is removed."""
        self.wait()  # the previous save completes first (and its failure is raised here)
        name = step_dir_name(step)
        try:
            with _writer_logs_captured() as records:
                final = self._save(step, name, engine, reference=reference, layout=layout, model_cfg=model_cfg,
                                   rl_state=rl_state, tokenizer=tokenizer, extra=extra)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - Megatron-Core's CheckpointException is a BaseException
            self._staging.release()
            problem = storage.diagnose(self.root, e)
            if problem is None:
                raise
            shutil.rmtree(self.root / f"{name}.tmp", ignore_errors=True)  # it must not hold the next save's space
            raise CheckpointError(self._not_saved(name, problem) + "".join(f"\n  {r}" for r in records)) from e
        if not self.async_save:
            self.wait()
        return final

    def _not_saved(self, name: str, problem: str) -> str:
        return storage_fault_line(self.root, f"{name} not saved", problem)

    def _save(self, step: int, name: str, engine, *, reference, layout, model_cfg, rl_state, tokenizer,
              extra) -> Path:
        """The foreground of a save: checks, copies of the state, the plan, the small files; then the background
        thread (`_complete`) writes and completes it."""
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
            for sub in (MODEL_DIR, OPTIMIZER_DIR, RNG_DIR, background.MARKERS):
                (tmp / sub).mkdir(parents=True)
        dist.barrier()
        # Ranks without trainer state (generators) hold no common state either: skip the cross-rank comparison
        # of common state dicts, which would only report that.
        plan = functools.partial(background.PlannedWrite, thread_count=_writer_count(engine),
                                 preprocess_common=_no_common)
        writes = {}
        model_sd = _model_sharded_state_dict(engine) if engine is not None else {}
        if engine is not None:
            _spread_replicas(model_sd, engine.pgs.dp_cp)
        staged = self._staging.stage(model_sd)
        writes[MODEL_DIR] = plan(model_sd, tmp / MODEL_DIR)
        failpoint("checkpoint_between_model_and_optimizer", name)
        optim_sd = {}
        if engine is not None:
            optim_sd = _optimizer_sharded_state_dict(engine, _model_sharded_state_dict(engine), is_loading=False,
                                                     with_state=_has_optimizer_state(engine.optimizer))
            if reference is not None:
                optim_sd["reference"] = _reference_sharded_state_dict(reference, engine)
                _spread_replicas(optim_sd["reference"], engine.pgs.dp_cp)
            torch.save(_rng_state(), tmp / RNG_DIR / f"rank_{rank:05d}.pt")
        staged += self._staging.stage(optim_sd)
        self.last_staged_bytes = staged
        writes[OPTIMIZER_DIR] = plan(optim_sd, tmp / OPTIMIZER_DIR)
        meta = None
        if rank == 0:
            if rl_state is not None:
                torch.save(rl_state, tmp / RL_STATE)
            if tokenizer is not None and "source" in tokenizer:
                # The checkpoint carries its tokenizer's files, so that it stands on its own (eval, convert, resume).
                tokenizer = save_tokenizer(Path(tokenizer["source"]), tmp / TOKENIZER_DIR)
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
                "optimizer_format": optimizer_state.FORMAT,
                **(extra or {}),
            }
        blocking = time.perf_counter() - t0
        self.last_blocking_s = blocking
        thread = threading.Thread(target=self._complete, args=(name, tmp, final, writes, meta),
                                  name=f"checkpoint-{name}", daemon=True)
        self._pending = _Pending(name, tmp, thread, t0, blocking)
        thread.start()
        return final

    def _complete(self, name: str, tmp: Path, final: Path, writes: dict, meta: Optional[dict]) -> None:
        """The background of a save, on every rank: write this rank's files, their checksums, post the marker; on
        rank 0 then wait for every rank's, complete the format's metadata and the checkpoint (rename, `latest`,
        prune). No collective (see background.py); errors end up in `_pending.error`."""
        pending = self._pending
        try:
            self._write_and_complete(pending, name, tmp, final, writes, meta)
        finally:
            pending.finished = time.perf_counter()

    def _write_and_complete(self, pending: _Pending, name: str, tmp: Path, final: Path, writes: dict,
                            meta: Optional[dict]) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            results = {sub: w.write() for sub, w in writes.items()}
            self._staging.release()
            failpoint("checkpoint_background_write", name)
            mine = file_checksums(tmp, [rel for rel in _files(tmp)
                                        if _writer_rank(Path(rel).name, world) == rank])
            background.post(tmp, rank, {"results": results, "checksums": mine}, None)
        except BaseException as e:  # noqa: BLE001 - reported by `wait` or `raise_if_failed`, in one line
            self._staging.release()
            pending.error = self._failure(name, rank, e)
            with contextlib.suppress(OSError):  # on a full disk even the marker may not fit: `wait` also gathers
                background.post(tmp, rank, None, pending.error)
            return
        finally:
            pending.written.set()
        if rank != 0:
            return
        try:
            values, error = background.gather(tmp, world, pending.abort)
            if error is not None:  # the unfinished write is removed before the next save (other ranks may
                pending.error = error  # still be writing into it now), or by the launcher once the job has ended
                return
            for sub, w in writes.items():
                w.finish([values[r]["results"][sub] for r in range(world)])
            shutil.rmtree(tmp / background.MARKERS)
            checksums = {rel: c for v in values.values() for rel, c in v["checksums"].items()}
            checksums.update(file_checksums(tmp, [rel for rel in _files(tmp) if rel not in checksums]))
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
        except BaseException as e:  # noqa: BLE001
            pending.error = self._failure(name, rank, e)

    def _failure(self, name: str, rank: int, e: BaseException) -> str:
        """The one line for a save that failed on `rank` in the background. Its unfinished write is left to the
        next save or the launcher: removing it now would pull the directory from under ranks still writing."""
        problem = storage.diagnose(self.root, e)
        if problem is None:
            return f"{self.root}: {name} not saved: rank {rank}: {type(e).__name__}: {e}"
        return self._not_saved(name, problem)

    def raise_if_failed(self) -> None:
        """Not collective, cheap: raise CheckpointError now if this rank's part of the save in the background has
        failed (the job then ends with that line instead of training on until the next save)."""
        pending = self._pending
        if pending is not None and pending.error is not None:
            self._pending = None
            raise CheckpointError(pending.error)

    @property
    def pending_name(self) -> Optional[str]:
        """The step directory of the save not yet waited for (None when there is none)."""
        return self._pending.name if self._pending is not None else None

    def wait(self) -> None:
        """Collective over the world: wait until the save in the background is complete on every rank. Raises
        CheckpointError with one line (rank 0's, which names the first rank that failed) when it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        # First every rank's own writes, then their errors (a marker that did not fit on a full disk is not waited
        # for), then rank 0's completion of the checkpoint.
        pending.written.wait()
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, pending.error)
        if any(errors) and dist.get_rank() == 0:
            pending.abort.set()
        pending.thread.join()
        if not any(errors):
            errors = [pending.error]
            dist.broadcast_object_list(errors, src=0)
        error = errors[0] or next((e for e in errors if e), None)
        if error is not None:
            raise CheckpointError(error)
        took = [(pending.finished or time.perf_counter()) - pending.started]
        dist.broadcast_object_list(took, src=0)  # rank 0's: from the save's start until the checkpoint was complete
        self.last_save_s = took[0]

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
        """`verify(path, checksums=True)`, and every pickled file checked to hold only data (`safe_load`; nothing
        in it runs), collective when torch.distributed is initialized: each rank reads a share of the files, and
        every rank gets the same answer. Remembered, so that `load` after `find` reads the files once."""
        path = Path(path)
        meta = verify(path)
        if path in self._verified:
            return meta
        files, pickled = sorted(meta.get(CHECKSUMS) or {}), safe_load.pickled_files(path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank, world = dist.get_rank(), dist.get_world_size()
            parts: list = [None] * world
            dist.all_gather_object(parts, (checksum_mismatches(path, meta, files[rank::world]),
                                           safe_load.problems(path, pickled[rank::world])))
            mismatches = sorted(rel for part, _ in parts for rel in part)
            refused = [line for _, part in parts for line in part]
        else:
            mismatches, refused = checksum_mismatches(path, meta, files), safe_load.problems(path, pickled)
        _raise_mismatch(path, mismatches)
        if refused:
            raise CheckpointError(refused[0])
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
            model_sd = _model_sharded_state_dict(engine)
            optim_sd = _optimizer_sharded_state_dict(engine, model_sd, is_loading=True, with_state=with_state)
            if reference is not None:
                optim_sd["reference"] = _reference_sharded_state_dict(reference, engine)
            ostate = dist_checkpointing.load(optim_sd, str(path / OPTIMIZER_DIR))
            if reference is not None:
                reference.load_state_dict(ostate["reference"])
            if with_state:
                _load_optimizer(engine, model_sd, ostate["optimizer"])
                _unshare_adam_steps(engine.optimizer)
            else:  # saved before the first update: the main parameters are still copies of the old weights
                engine.optimizer.reload_model_params()
            engine.scheduler.load_state_dict(ostate["scheduler"])
            for k, v in ostate["engine"].items():
                setattr(engine, k, v)
            rng = path / RNG_DIR / f"rank_{dist.get_rank():05d}.pt"
            same_world = meta.get("world_size") == dist.get_world_size()
            if same_world and rng.exists():
                _set_rng_state(safe_load.load_data(rng, numpy_arrays=True))
        else:
            dist_checkpointing.load({}, str(path / MODEL_DIR))
            dist_checkpointing.load({}, str(path / OPTIMIZER_DIR))
        rl = path / RL_STATE
        meta["rl_state"] = safe_load.load_data(rl) if rl.exists() else {}
        dist.barrier()
        return meta
