"""Start N local processes in one gloo (or NCCL) world and run a function on each rank.

Used by the tests, the reshard verifier and the local launcher. Processes come from a fork server that has
already imported torch and Megatron-Core, so an 8-rank world starts in about a second instead of paying the
import on every rank.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

_PRELOAD = ["torch", "megatron.core", "megatron_rl.compat"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.compat import activate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    activate()
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
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


def run_local(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout: float = 300.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return the results in rank order.

    `fn` must be importable (a module-level function). Raises RuntimeError with the failing ranks' tracebacks.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: ranks may start processes of their own (dist_checkpointing's writer does). The finally
    # clause below kills any rank left behind.
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
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
    import torch

    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
