"""Training checkpoints against the disk: save (blocking part and whole), load, host memory (issue 30).

    python benchmarks/checkpoint.py --dp 1            # SmolLM2-135M shape, trainer TP1, one gloo rank
    python benchmarks/checkpoint.py --dp 2 --preset tiny

Each rank builds the trainer (Megatron-Core DDP, distributed optimizer with Adam state, bf16 weights) and saves two
checkpoints with `TrainCheckpointer.save`, the job's own call (the figures are the second's: the first also allocates
the host buffers a run keeps, and is reported beside), then loads the last back (`verify` reads every file's
checksum, then `load`). The page cache is emptied of the checkpoint's files before the load (posix_fadvise
DONTNEED after fsync), so the load reads the disk. In the same run it times the references on the same
filesystem: a durable raw write of the checkpoint's bytes (64 MiB writes, fsync) and a raw read of them after the
same eviction, before and after the checkpoints, and a raw read of the checkpoint's own files just before the load
(evicted again after it): the load's reference. The load is repeated (`--loads`, each after its own checksum pass,
eviction and raw read): the figures are the medians. Every time is reported as a ratio to its reference.

Host memory: a thread samples each rank's proportional set size (PSS, its own pages plus its share of pages shared
with its forked writer processes, which are counted too) every 10 ms; `host_peak_bytes` is the largest rank's
peak during the save above its size before it, beside that rank's own shard of the checkpoint.

Ends with one JSON line: checkpoint_bytes, save_s, save_blocking_s, load_s, loads_s_raw_s, verify_s, raw_write_s, raw_read_s,
host_peak_bytes, shard_bytes and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

CHUNK = 64 << 20


def _pss(pid: int) -> int:
    """Proportional set size of `pid` and its children (bytes): shared pages split between their sharers."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration):
            continue
    return total


class PeakMemory:
    """Samples `_pss` of this process (and children) every 10 ms while active."""

    def __init__(self):
        self.base = _pss(os.getpid())
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _pss(os.getpid()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _pss(os.getpid()))


def evict(paths) -> None:
    """Drop the files' clean pages from the page cache, so that the next read goes to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()]


def rank_main(rank, world_size, preset, root, sync, n_loads):
    import torch
    import torch.distributed as dist

    from megatron_rl.checkpointing.megatron_state import ensure_optimizer_state
    from megatron_rl.checkpointing.training import TrainCheckpointer
    from megatron_rl.controller.rank import freeze_startup_objects
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import TrainEngine
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    cfg = get_preset(preset)
    layout = ParallelLayout(tp=1, pp=1, dp=world_size)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", params_dtype=torch.bfloat16)
    engine = TrainEngine.create(model, g.pgs, TrainerSettings(), LRSchedule(lr=1e-5))
    ensure_optimizer_state(engine.optimizer)  # Adam moments allocated, as after a step
    freeze_startup_objects()  # as the job does once its executors exist: a full GC pass does not re-read them
    ck = TrainCheckpointer(root, keep_last=1, async_save=not sync)
    saves = []
    for step in (1, 2):  # the first save allocates the host buffers (pinned on a GPU); the second is every later one
        dist.barrier()
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            path = ck.save(step, engine, layout=layout, model_cfg=cfg, tokenizer={"type": "byte"},
                           rl_state={"step": step, "weight_version": step} if rank == 0 else None)
            blocking = time.perf_counter() - t0
            ck.wait()
            saves.append((blocking, time.perf_counter() - t0, mem))
    (first_blocking, first_total, first_mem), (blocking, total, mem) = saves
    own = sum(p.stat().st_size for p in files_under(path) if f"__{rank}_" in p.name)
    loads, verify_s = [], None  # (load s, the raw read of its files just before it; rank 0 times that)
    for _ in range(n_loads):
        dist.barrier()
        if rank == 0:
            evict(files_under(path))
        dist.barrier()
        fresh = TrainCheckpointer(root)
        t0 = time.perf_counter()
        fresh.verify(path)  # the checksum pass, remembered: the load after it does not read the files for it
        verify_s = verify_s or time.perf_counter() - t0
        own_read_s = None
        if rank == 0:  # the reference beside the load: its own files read raw from the disk, in the disk's state now
            evict(files_under(path))
            own_read_s = read_raw(files_under(path))
            evict(files_under(path))
        dist.barrier()
        t0 = time.perf_counter()
        fresh.load(path, engine)
        loads.append((time.perf_counter() - t0, own_read_s))
        dist.barrier()
    return {"path": str(path), "save_s": total, "save_blocking_s": blocking, "verify_s": verify_s,
            "loads": loads, "host_peak_bytes": mem.peak - mem.base, "shard_bytes": own,
            "first_save_s": first_total, "first_save_blocking_s": first_blocking,
            "first_host_peak_bytes": first_mem.peak - first_mem.base}


def read_raw(paths) -> float:
    """Seconds to read `paths` whole, one after another, 64 MiB at a time (after `evict`: from the disk)."""
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def raw_write_read(directory: Path, nbytes: int) -> tuple[float, float]:
    """Seconds to write `nbytes` durably (64 MiB writes, fsync) into one file under `directory`, and to read them
    back after evicting them from the page cache."""
    block = os.urandom(1 << 20) * (CHUNK >> 20)
    path = directory / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(block)[: min(left, CHUNK)])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    evict([path])
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s


def _estimate_bytes(preset: str) -> int:
    """The checkpoint's size before it exists (bf16 weights, fp32 main weights and two Adam moments)."""
    from megatron_rl.models import get_preset

    return get_preset(preset).num_parameters() * 14


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (gloo processes)")
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--dir", default="runs/checkpoint_bench", help="where to write (the filesystem measured)")
    p.add_argument("--sync", action="store_true", help="checkpoint.async_save=false: the save completes before "
                   "training goes on")
    p.add_argument("--loads", type=int, default=3, help="cold loads, each after a raw read of the checkpoint's "
                   "files (its reference); the figures are their medians")
    args = p.parse_args(argv)

    from megatron_rl.checkpointing.layout import dir_bytes
    from megatron_rl.launch.spawn import run_local

    root = Path(args.dir) / f"dp{args.dp}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # A VM's disk moves between runs (bursts, then writeback throttling): the raw write and read are timed before
    # and after the checkpoints, and the reference is their mean; both are printed.
    before = raw_write_read(root, _estimate_bytes(args.preset))
    ranks = run_local(rank_main, args.dp, args.preset, str(root), args.sync, args.loads, timeout=1800)
    nbytes = dir_bytes(Path(ranks[0]["path"]))
    after = raw_write_read(root, nbytes)
    raw_write_s, raw_read_s = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    worst = max(ranks, key=lambda r: r["host_peak_bytes"])
    out = {
        "preset": args.preset, "dp": args.dp, "async_save": not args.sync, "checkpoint_bytes": nbytes,
        "save_s": max(r["save_s"] for r in ranks), "save_blocking_s": max(r["save_blocking_s"] for r in ranks),
        "verify_s": max(r["verify_s"] for r in ranks),
        "raw_write_s": raw_write_s, "raw_read_s": raw_read_s, "raw_write_before_after_s": [before[0], after[0]],
        "raw_read_before_after_s": [before[1], after[1]],
        "host_peak_bytes": worst["host_peak_bytes"], "shard_bytes": worst["shard_bytes"],
        "first_save_s": max(r["first_save_s"] for r in ranks),
        "first_save_blocking_s": max(r["first_save_blocking_s"] for r in ranks),
        "first_host_peak_bytes": max(r["first_host_peak_bytes"] for r in ranks),
    }
    out["save_vs_raw_write"] = out["save_s"] / raw_write_s
    out["blocking_share"] = out["save_blocking_s"] / out["save_s"]
    # Each load's own reference: its files read raw just before it, in the same state of the disk (this VM's disk
    # moves 3x within minutes, so the before/after file above can be in another phase than the load). The load's
    # time is its slowest rank's.
    loads = [(max(r["loads"][i][0] for r in ranks), ranks[0]["loads"][i][1]) for i in range(args.loads)]
    out["loads_s_raw_s"] = [[round(a, 3), round(b, 3)] for a, b in loads]
    out["load_s"] = statistics.median(a for a, _ in loads)
    out["own_raw_read_s"] = statistics.median(b for _, b in loads)
    out["load_vs_own_raw_read"] = statistics.median(a / b for a, b in loads)
    out["load_vs_raw_read"] = out["load_s"] / raw_read_s
    out["host_peak_vs_shard"] = out["host_peak_bytes"] / max(out["shard_bytes"], 1)
    print(f"checkpoint {nbytes / 1e9:.2f} GB at DP{args.dp} ({args.preset}): save {out['save_s']:.2f} s "
          f"({out['save_vs_raw_write']:.2f}x a durable raw write, {raw_write_s:.2f} s: {before[0]:.2f} s before, "
          f"{after[0]:.2f} s after), blocking "
          f"{out['save_blocking_s']:.2f} s ({out['blocking_share']:.0%}); load {out['load_s']:.2f} s, the median of "
          f"{args.loads} ({out['load_vs_own_raw_read']:.2f}x a raw read of its files just before, the median ratio; "
          f"the reads {out['own_raw_read_s']:.2f} s; "
          f"{out['load_vs_raw_read']:.2f}x the before/after file's, {raw_read_s:.2f} s) after checksums "
          f"{out['verify_s']:.2f} s; "
          f"host peak during the save {out['host_peak_bytes'] / 1e9:.2f} GB "
          f"({out['host_peak_vs_shard']:.2f}x the rank's shard, {out['shard_bytes'] / 1e9:.2f} GB); the first save "
          f"(host buffers allocated): {out['first_save_s']:.2f} s, blocking {out['first_save_blocking_s']:.2f} s, "
          f"host peak {out['first_host_peak_bytes'] / 1e9:.2f} GB")
    emit(out)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
