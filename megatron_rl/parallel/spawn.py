"""Start N local processes in one gloo (or NCCL) world and run a function on each rank.

Used by the tests, the reshard verifier, `megatron-rl eval` and the local launcher. Without CUDA, processes come
from a fork server that has already imported torch and Megatron-Core, so an 8-rank world starts in about a second
instead of paying the import on every rank. With CUDA they are spawned (fresh interpreters: a process must not
inherit CUDA state through fork, and importing Megatron-Core or a preloaded extension may touch it), rank r takes
GPU r, and the default backend is NCCL.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

from megatron_rl import quiet

# Every process that imports this module (the fork server, spawned ranks: the worker function lives here) filters
# the dependency warnings that say nothing on this machine, before Megatron-Core is imported.
quiet.install()
_PRELOAD = ["torch", "megatron_rl.parallel.spawn", "megatron.core", "megatron_rl.compat"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpus() -> int:
    """GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class LaunchError(RuntimeError):
    """The local machine cannot host the requested world (one line, before any process starts)."""


def resolve_backend(backend: str, world_size: int, cuda_devices: int) -> str:
    """"auto" -> NCCL when this machine has GPUs, else gloo. NCCL needs a GPU of its own for every rank (two ranks
    on one device cannot share a communicator)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise LaunchError(f"backend {backend!r} is not one of auto, gloo, nccl")
    if backend == "auto":
        backend = "nccl" if cuda_devices else "gloo"
    if backend == "nccl":
        if not cuda_devices:
            raise LaunchError("the NCCL backend needs CUDA, which this process does not see")
        if world_size > cuda_devices:
            raise LaunchError(f"{world_size} ranks need {world_size} GPUs (one each) but this machine shows "
                              f"{cuda_devices}; use fewer ranks, or CUDA_VISIBLE_DEVICES= to run on the CPU")
    return backend


def _worker(rank: int, world_size: int, port: int, backend: str, dist_timeout_s: float, fn: Callable, args: tuple,
            queue) -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.compat import activate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    activate()
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=dist_timeout_s))
        result = fn(rank, world_size, *args)
        # Serialize by value: tensors put on a queue are shared through file descriptors that die with this
        # process, which may exit before the parent reads them.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent, with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
              timeout: Optional[float] = 300.0, dist_timeout_s: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return the results in rank order.

    `fn` must be importable (a module-level function). `backend`: gloo, nccl, or auto (NCCL when CUDA is present).
    `timeout`: seconds for the whole run, None for no limit; `dist_timeout_s`: the process group's timeout for one
    collective or message. Raises LaunchError when the machine cannot host the world, RuntimeError with the
    failing ranks' tracebacks, TimeoutError past the timeout.
    """
    import torch

    cuda = local_gpus()
    backend = resolve_backend(backend, world_size, cuda)
    # MEGATRON_RL_START_METHOD=spawn: the start method of GPU machines, on a CPU (the tests use it).
    method = os.environ.get("MEGATRON_RL_START_METHOD") or ("spawn" if cuda else "forkserver")
    if method not in ("spawn", "forkserver"):
        raise LaunchError(f"MEGATRON_RL_START_METHOD={method!r} is not one of spawn, forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: ranks may start processes of their own (dist_checkpointing's writer does). The finally
    # clause below kills any rank left behind.
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, dist_timeout_s, fn, args, queue),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results) - set(errors))} "
                                   f"did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in results and r not in errors]
                if dead:
                    for r in dead:
                        errors[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                # Give the other ranks a moment to report (they are often blocked on the failed one).
                time.sleep(0.5)
                while True:
                    try:
                        rank, ok, payload = queue.get_nowait()
                    except queue_mod.Empty:
                        break
                    (results if ok else errors)[rank] = payload
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
