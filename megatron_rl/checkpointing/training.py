"""Training checkpoints: one sharded, reshardable checkpoint per saved step, written atomically.

Layout of a run's checkpoint root (see checkpoints/README.md):

    ROOT/step_00000042/           one complete checkpoint (the name is the number of trainer steps done)
        megatron_rl.json          format, step, weight version, the layout it was written with, model shape,
                                  tokenizer, and a manifest (every file with its size and CRC-32) written last
        model/                    Megatron-Core dist_checkpointing (torch_dist) of the GPTModel: the same as a
                                  converted checkpoint, so `convert --to hf`, `eval` and `inspect` read it
        optimizer/                dist_checkpointing of the optimizer in model space (the distributed
                                  optimizer's state per parameter, each rank writing the pieces it owns:
                                  `optimizer_state`; it loads at any TP/PP/DP), the LR scheduler, the trainer's
                                  counters and, in runs with a KL penalty, the frozen reference model's weights
                                  (keys `reference.*`)
        rng/rank_00000.pt         per-rank RNG states (`rng.py`; restored when the world size is unchanged)
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

Here: `TrainCheckpointer` (save in the background, find, load) and the save's own bookkeeping (writer threads, which
rank checksums which file). The format itself (names, metadata, manifest, `verify`, `latest`, the step directories,
removing unfinished writes) is `layout.py`'s; the leases of other processes reading a step, which retention
(`_prune`) honours, `leases.py`'s; the sharded state dicts handed to Megatron-Core and the workarounds
around its save and load are `megatron_state.py`'s; how a load reads the files (each byte once, by one rank)
`loader.py`'s; the RNG states `rng.py`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.checkpointing.layout import (CHECKSUMS, LATEST, MANIFEST, MODEL_DIR, OPTIMIZER_DIR, RL_STATE,
                                              RNG_DIR, TOKENIZER_DIR, CheckpointError, CheckpointMeta,
                                              checksum_mismatches, file_checksums, list_checkpoints, manifest,
                                              mismatch_line, publish, read_latest, remove_unfinished, retire,
                                              retired, rng_file, step_dir_name, training_meta, verify, write_meta)
from megatron_rl.checkpointing import background, leases, megatron_state, optimizer_state, rng, safe_load, storage
from megatron_rl.checkpointing.reads import ReadCount, read_owners
from megatron_rl.checkpointing.tokenizer import save_tokenizer
from megatron_rl.failpoints import failpoint

# Megatron-Core is imported by the functions that use it: importing this module (the controller does) needs only torch.

# A rank whose weights are smaller than this saves with one writer thread (`_writer_count`).
ONE_WRITER_BELOW_BYTES = 64 << 20


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
    from megatron_rl.training.engine import current_device  # Megatron-Core: imported on use (see above)

    bad = torch.zeros(1, device=current_device())
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


def _share_by_bytes(files: list[str], pickled: list[str], sizes: dict, world: int) -> list[tuple[list, list]]:
    """Each rank's share of a checkpoint's checks: (files whose checksum it reads, pickled files it checks), split
    by the manifest's sizes with `read_owners`' rule (largest first, to the least-loaded rank)."""
    # The offset field tells a file's two checks apart: 0 its checksum, 1 its pickles.
    work = [(rel, (kind,), sizes.get(rel, 0)) for kind, rels in enumerate((files, pickled)) for rel in rels]
    shares: list = [([], []) for _ in range(world)]
    for (rel, (kind,), _), owner in zip(work, read_owners(work, world)):
        shares[owner][kind].append(rel)
    return shares


def _files(tmp: Path) -> list[str]:
    """Every file under `tmp`, relative, sorted (the markers of a background save excluded)."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p.is_file() and background.MARKERS not in p.relative_to(tmp).parts)


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
        self.last_load_read = ReadCount()  # the bytes this rank read in the last load (trainer ranks)

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
            with megatron_state.writer_logs_captured() as records:
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
        return storage.storage_fault_line(self.root, f"{name} not saved", problem)

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
                                 preprocess_common=megatron_state.no_common)
        writes = {}
        model_sd = megatron_state.sharded_model(engine) if engine is not None else {}
        if engine is not None:
            megatron_state.spread_replicas(model_sd, engine.pgs.dp_cp, engine.pgs.expt_dp)
        staged = self._staging.stage(model_sd)
        writes[MODEL_DIR] = plan(model_sd, tmp / MODEL_DIR)
        failpoint("checkpoint_between_model_and_optimizer", name)
        optim_sd = {}
        if engine is not None:
            optim_sd = megatron_state.sharded_optimizer(
                engine, megatron_state.sharded_model(engine), is_loading=False,
                with_state=megatron_state.has_optimizer_state(engine.optimizer))
            if reference is not None:
                optim_sd["reference"] = megatron_state.sharded_reference(reference, engine)
                megatron_state.spread_replicas(optim_sd["reference"], engine.pgs.dp_cp, engine.pgs.expt_dp)
            torch.save(rng.rng_state(), rng_file(tmp, rank))
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
            meta = training_meta(
                step=step, weight_version=(rl_state or {}).get("weight_version", step), layout=layout,
                world_size=dist.get_world_size(),
                dtype=(str(next(engine.model.module.parameters()).dtype).replace("torch.", "")
                       if engine is not None else None),
                model=model_cfg, tokenizer=tokenizer,
                optimizer_state=megatron_state.has_optimizer_state(engine.optimizer) if engine is not None else None,
                optimizer_format=optimizer_state.FORMAT, extra=extra)
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
            write_meta(tmp, {**meta, MANIFEST: manifest(tmp), CHECKSUMS: checksums})
            failpoint("checkpoint_before_rename", name)
            self._publish(tmp, final)
            self._prune(keep=final)
        except BaseException as e:  # noqa: BLE001
            pending.error = self._failure(name, rank, e)

    def _publish(self, tmp: Path, final: Path) -> None:
        """`publish` the finished write `tmp` as step directory `final`. Where `final` exists (a resume from an older
        checkpoint saves its steps again), the old directory is renamed away and replaced only while no reader's
        lease holds it (`leases.unread`: waiting for the reader), then deleted."""
        if not final.exists():
            publish(tmp, final)
            return

        def waiting() -> None:
            if self.log is not None:
                self.log(f"checkpoint {final.name}: an earlier {final.name} is being read (a lease in "
                         f"{self.root / leases.READERS_DIR}); it is replaced once its reader is done")

        with leases.unread(self.root, final.name, waiting):
            old = retire(final)
            publish(tmp, final)
        shutil.rmtree(old, ignore_errors=True)

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
        names, freed = remove_unfinished(self.root)
        if names and self.log is not None:
            self.log(f"removed {len(names)} unfinished checkpoint write{'s' if len(names) > 1 else ''} "
                     f"({', '.join(names)}): {storage.human_bytes(freed)} freed in {self.root}")

    def _prune(self, keep: Path) -> None:
        """Remove the checkpoints past the newest `keep_last`, except those another process reads (`leases.py`:
        kept until their lease is gone, then removed by a later prune)."""
        complete = [p for _, p in list_checkpoints(self.root)]
        with leases.readers_lock(self.root):
            leased = leases.leased_steps(self.root)
            for p in complete[: max(len(complete) - self.keep_last, 0)]:
                if p != keep and p.name not in leased:
                    with contextlib.suppress(OSError):  # removed meanwhile, or not removable: the next prune's
                        retire(p)
        for p in retired(self.root):
            shutil.rmtree(p, ignore_errors=True)
        remove_unfinished(self.root)

    # ---- find and load ---------------------------------------------------------------------------------------
    def verify(self, path: Path) -> CheckpointMeta:
        """`verify(path, checksums=True)`, and every pickled file checked to hold only data (`safe_load`; nothing
        in it runs), collective when torch.distributed is initialized: each rank reads a share of the files (an
        even share of the bytes: `_share_by_bytes`), and every rank gets the same answer. Remembered, so that
        `load` after `find` reads the files once."""
        path = Path(path)
        meta = verify(path)
        if path in self._verified:
            return meta
        files, pickled = sorted(meta.checksums), safe_load.pickled_files(path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank, world = dist.get_rank(), dist.get_world_size()
            files, pickled = _share_by_bytes(files, pickled, meta.files, world)[rank]
            parts: list = [None] * world
            dist.all_gather_object(parts, (checksum_mismatches(path, meta, files),
                                           safe_load.problems(path, pickled)))
            mismatches = sorted(rel for part, _ in parts for rel in part)
            refused = [line for _, part in parts for line in part]
        else:
            mismatches, refused = checksum_mismatches(path, meta, files), safe_load.problems(path, pickled)
        if mismatches:
            raise CheckpointError(mismatch_line(path, mismatches))
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
        when the world and layout are those it was written with, the RNG states. Returns `rl_state.pt`'s content
        (the controller's state, on every rank; {} when the checkpoint has none)."""
        from megatron.core import dist_checkpointing

        from megatron_rl.checkpointing.loader import resume_read_ahead, resume_strategy

        path = Path(path)
        meta = self.verify(path)
        if reference is not None and not megatron_state.saved_with_reference(path):
            raise CheckpointError(f"{path}: saved without a KL reference model, which this run needs (it was "
                                  f"written by a run with algorithm.kl_coef = 0?)")
        if engine is not None:
            with_state = meta.optimizer_state is not False
            if with_state:
                megatron_state.ensure_optimizer_state(engine.optimizer)
            # Each replicated tensor read by one DP rank and broadcast, each chunk only as far as needed, the
            # files read ahead of the two loads (`resume_read_ahead`).
            strategy = resume_strategy(engine.pgs.dp_cp, read_ahead=resume_read_ahead(
                path, (MODEL_DIR, OPTIMIZER_DIR), meta, engine.pgs))
            try:
                model_sd = megatron_state.sharded_model(engine)
                state = dist_checkpointing.load(model_sd, str(path / MODEL_DIR), sharded_strategy=strategy)
                engine.model.module.load_state_dict(state)
                model_sd = megatron_state.sharded_model(engine)
                optim_sd = megatron_state.sharded_optimizer(engine, model_sd, is_loading=True, with_state=with_state)
                if reference is not None:
                    optim_sd["reference"] = megatron_state.sharded_reference(reference, engine)
                ostate = dist_checkpointing.load(optim_sd, str(path / OPTIMIZER_DIR), sharded_strategy=strategy)
            finally:
                strategy.close()
            self.last_load_read = strategy.read
            if reference is not None:
                reference.load_state_dict(ostate["reference"])
            if with_state:
                megatron_state.load_optimizer(engine, model_sd, ostate["optimizer"])
                megatron_state.unshare_adam_steps(engine.optimizer)
            else:  # saved before the first update: the main parameters are still copies of the old weights
                engine.optimizer.reload_model_params()
            engine.scheduler.load_state_dict(ostate["scheduler"])
            engine.load_counters(ostate["engine"])
            rng_path = rng_file(path, dist.get_rank())
            same_world = meta.world_size == dist.get_world_size()
            if same_world and rng_path.exists():
                rng.set_rng_state(safe_load.load_data(rng_path, numpy_arrays=True))
        else:
            dist_checkpointing.load({}, str(path / MODEL_DIR))
            dist_checkpointing.load({}, str(path / OPTIMIZER_DIR))
        rl = path / RL_STATE
        rl_state = safe_load.load_data(rl) if rl.exists() else {}
        dist.barrier()
        return rl_state
