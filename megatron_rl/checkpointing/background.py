"""Checkpoint writes that finish off the training thread: staged, planned in the foreground, written behind it.

A save costs training only the time to copy each rank's state out of the training tensors (into reusable host
buffers, pinned on a GPU: `HostStaging`) and to plan the write (the collectives of Megatron-Core's torch_dist
format: validation, the global plan). The rest runs in a thread of each rank (`TrainCheckpointer`), while training
goes on: writing the files (fsynced), their checksums, and on rank 0 the format's metadata, the manifest, the
rename and the `latest` pointer.

The background does no collective. Collectives issued from a second thread would race the training thread's on
the same process groups (NCCL and gloo order a group's collectives by call order, per process), so the ranks meet
through the checkpoint directory instead: each rank drops a marker with its write results and checksums
(`MARKERS/rank_N.ok`, or `.failed` with its one-line error), rank 0 waits for all of them, writes the torch_dist
`.metadata` from every rank's results (`FileSystemWriter.finish`, what Megatron-Core's collective finalize does
after its gather) and completes the checkpoint. The markers live in the step's `.tmp` directory and are removed
before its rename, so a crash at any point leaves `latest` at the previous checkpoint.

Megatron-Core's own asynchronous save (`AsyncCallsQueue`) forks a process per save and finalizes with collectives
that every rank must call at the same points of its loop, and it forks the training process for each save
(copy-on-write: the pages training writes during the save are copied; not measured here). Threads share the staged
copies instead, and the file writes release the GIL.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_rl.compat import cuda_rules

MARKERS = ".background"  # inside the step's .tmp directory; removed before the rename


class HostStaging:
    """Host copies of the tensors a save writes: each ShardedTensor's data is replaced by a contiguous copy, so
    that training may change its tensors while the copy is written (and Megatron-Core's writer, which clones
    views, has nothing left to clone). With `keep`, the buffers are kept for the next save (pinned host memory is
    slow to allocate); the pool then holds one copy of the rank's checkpoint shard."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        # The GPU path: pinned buffers and asynchronous copies (on a CPU in the CUDA-rules test mode, the same
        # path with CUDA's pinned-copy rules, `compat/cuda_rules.py`).
        self.pinned = torch.cuda.is_available() or cuda_rules.enabled()

    def _buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((shape, dtype))
        if free:
            buf = free.pop()
        elif torch.cuda.is_available():
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        elif self.pinned:
            buf = cuda_rules.pin_memory(torch.empty(shape, dtype=dtype))
        else:
            buf = torch.empty(shape, dtype=dtype)
        self._lent.append(buf)
        return buf

    def stage(self, sharded_state_dict: dict) -> int:
        """Replace the data of every main-replica ShardedTensor in `sharded_state_dict` (factories applied first)
        by a host copy; returns the bytes copied. On a GPU the copies are asynchronous into pinned memory and this waits for
        them once at the end: the writer may read them as soon as it returns."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

        apply_factories(sharded_state_dict)
        copied = 0
        for sh in nested_values(sharded_state_dict):
            # Another rank writes a replica that is not main (the torch_dist strategy keeps only main replicas).
            if isinstance(sh, ShardedTensor) and sh.data is not None and is_main_replica(sh.replica_id):
                src = sh.data.detach()
                buf = self._buffer(tuple(src.shape), src.dtype)
                buf.copy_(src, non_blocking=self.pinned)
                sh.data = buf
                copied += buf.numel() * buf.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are asynchronous: the writer thread must not read before they end
        return copied

    def release(self) -> None:
        """The write is done: the buffers go back to the pool (or are dropped)."""
        if self.keep:
            for buf in self._lent:
                self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
        self._lent = []


def _capturing_strategy(thread_count: int):
    """Megatron-Core's torch_dist save strategy, stopped after its planning: `async_save` returns our request
    (the storage writer with its planned buckets, and on rank 0 the global metadata) instead of Megatron-Core's
    (whose finalize is collective)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class Capture(TorchDistSaveShardedStrategy):
        planned = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            self.planned = (writer, save_state_dict_ret[1])
            return AsyncRequest(None, [], [])

    return Capture("torch_dist", 1, thread_count=thread_count)


def _no_results_server() -> None:
    """Give Megatron-Core's torch_dist writer a plain queue for its write results before its first plan here.
    Left alone, its planning starts a `multiprocessing.Manager` server (a fresh interpreter: seconds on a CPU, in
    every rank that writes) to serve that queue to forked writers; `PlannedWrite.write` runs the writers in threads
    with queues of their own, so nothing reads it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class PlannedWrite:
    """One dist_checkpointing directory: planned at construction (collective, in the foreground: common state,
    validation, the global plan), written by `write` (any thread), completed by `finish` on rank 0."""

    def __init__(self, sharded_state_dict: dict, directory: Path, thread_count: int,
                 preprocess_common: Optional[Callable[[dict], dict]] = None):
        from megatron.core import dist_checkpointing

        _no_results_server()
        strategy = _capturing_strategy(thread_count)
        dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=strategy,
                                async_sharded_save=True, preprocess_common_before_consistancy_check=preprocess_common)
        self.writer, self.metadata = strategy.planned
        self.directory = Path(directory)
        self.backend, self.version = strategy.backend, strategy.version

    def write(self) -> list:
        """Write this rank's buckets (one file each, fsynced; one thread per file); their write results."""
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        buckets = list(self.writer.write_buckets or [])
        transforms = [self.writer.transforms] if hasattr(self.writer, "transforms") else []

        def one(i_bucket):
            i, bucket = i_bucket
            results, count = queue.Queue(), queue.Queue()
            count.put(i)
            FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, results, count, True)
            _, out = results.get()
            if isinstance(out, BaseException):
                raise out
            return out

        if len(buckets) <= 1:
            done = [one(b) for b in enumerate(buckets)]
        else:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="checkpoint-write") as pool:
                done = list(pool.map(one, enumerate(buckets)))
        return [r for part in done for r in part]

    def finish(self, all_results: list[list]) -> None:
        """Rank 0, once every rank has written: the torch_dist `.metadata` from every rank's write results (in
        rank order) and Megatron-Core's `metadata.json`."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

        self.writer.finish(self.metadata, all_results)
        save_config(CheckpointingConfig(self.backend, self.version), str(self.directory))


def write_now(sharded_state_dict: dict, directory: Path, thread_count: int = 2) -> None:
    """`dist_checkpointing.save` of one directory, in the foreground, its files (`thread_count` per rank, as
    Megatron-Core's default) written by threads of this rank; collective: every rank of the default group calls it.
    Megatron-Core's own save writes through a forked process per file and collects their results through a
    `multiprocessing.Manager` server that it spawns: a fresh interpreter, 3-5 s of every rank's save on a CPU
    (`megatron-rl convert`, a job's conversion of its initial model), before the first byte is written."""
    import torch.distributed as dist

    write = PlannedWrite(sharded_state_dict, directory, thread_count)
    results = write.write()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if dist.get_rank() == 0:
        write.finish(gathered)
    dist.barrier()


def _atomic_dump(path: Path, value) -> None:
    part = path.with_suffix(".part")
    with open(part, "wb") as f:
        pickle.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def post(tmp: Path, rank: int, value: Optional[dict], error: Optional[str]) -> None:
    """This rank's marker: its write results and checksums, or its one-line error."""
    d = Path(tmp) / MARKERS
    if error is None:
        _atomic_dump(d / f"rank_{rank:05d}.ok", value)
    else:
        _atomic_dump(d / f"rank_{rank:05d}.failed", error)


def gather(tmp: Path, world_size: int, abort: threading.Event,
           poll_s: float = 0.02) -> tuple[dict[int, dict], Optional[str]]:
    """Rank 0: wait for every rank's marker; (the values of the ranks that wrote, the first error in rank order
    or None). Returns at the first error, or when `abort` is set (another rank failed without a marker)."""
    d = Path(tmp) / MARKERS
    values: dict[int, dict] = {}
    while True:
        if abort.is_set():
            return values, "aborted: another rank's write failed"
        names = set(os.listdir(d))
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            with open(d / failed[0], "rb") as f:
                return values, pickle.load(f)
        for r in range(world_size):
            name = f"rank_{r:05d}.ok"
            if r not in values and name in names:
                with open(d / name, "rb") as f:
                    values[r] = pickle.load(f)
        if len(values) == world_size:
            return values, None
        time.sleep(poll_s)
