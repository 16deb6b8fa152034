"""Start N local processes in one gloo (or NCCL) world and run a function on each rank.

Used by the tests, the reshard verifier, `megatron-rl eval` and the local launcher. Without CUDA, processes come
from a fork server that has already imported torch and Megatron-Core, so an 8-rank world starts in about a second
instead of paying the import on every rank. With CUDA they are spawned (fresh interpreters: a process must not
inherit CUDA state through fork, and importing Megatron-Core or a preloaded extension may touch it), rank r takes
GPU r, and the default backend is NCCL.

Each rank leads a process group of its own, which every process it starts joins (reward workers): a terminal's
Ctrl-C reaches only this process, which decides what the ranks do, and ending a rank's group ends all it started.
With `stop_grace_s`, SIGTERM, SIGINT and SIGHUP (a closed terminal) are forwarded to the ranks, which note them
(`launch/signals.py`) and stop at their next consistent point; past the grace time, or at a second SIGINT, the
ranks' groups are killed. If this process ends without ending them (SIGKILL, a crash), each rank's lifeline
(`launch/lifeline.py`) ends its group at once: no rank outlives the process that started it.

However the ranks end, `run_local` returns every rank's result or raises `RanksFailed` with every rank that failed,
the likely cause first (`launch/failures.py`, which also words the report). A rank that has reported its result
stays until every rank has, and the ranks then leave together: a rank that left early could fail a peer still
setting up a process group with it (gloo connects a new group's pairs one at a time, and a rank that initiated its
connections is done before its peers are; a peer already holding its pair to the rank that left reads end-of-file,
"Gloo connectFullMesh failed ... Connection closed by peer", a CI run of 2026-11-27). The price: a rank left in a
collective that a returned rank never joins (a mismatched collective, a bug) fails at the process group's timeout,
not at once. A rank learns where it meets the others from `launch/world.py: set_rendezvous_env`, as a rank of a
torchrun/srun world does.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

from megatron_rl import quiet
from megatron_rl.launch import console, lifeline, signals
from megatron_rl.launch.failures import (HUNG, KILLED_AFTER, RankFailure, RanksFailed, cause_of, death, is_peer_error,
                                         likely_cause_first)
from megatron_rl.launch.world import LaunchError, set_rendezvous_env
from megatron_rl.parallel import liveness

log = logging.getLogger(__name__)

# How long a rank that has reported its result is given to exit before its process group is killed.
EXIT_WAIT_S = 5.0

# What the fork server imports once for all the ranks it forks: torch's dynamo (the CPU layer imports it before it
# patches torch.cuda, `compat/cpu.py`), then Megatron-Core through the module that leaves out its unused
# import-time costs (`compat/megatron_core.py`).
_PRELOAD = ["torch", "torch._dynamo", "megatron_rl.compat.megatron_core", "megatron_rl.launch.spawn",
            "megatron_rl.compat"]
_FREEZE = "megatron_rl.launch.preloaded"  # imported last: gc.freeze() of everything preloaded


def reserve_port() -> socket.socket:
    """A free TCP port for a local world's rendezvous, held by the returned socket until its owner closes it (when
    the world has ended): bound with SO_REUSEADDR and not listening, so that no other process on this machine is
    handed the port by a `bind` to port 0 while the ranks start, and rank 0's store (which sets SO_REUSEADDR too)
    can still listen on it. A port only found free and then released could be taken in between: two test workers
    starting worlds at once met on one (EADDRINUSE, 2026-11-27), as two jobs started together on one node could."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", 0))
    return s


def local_gpus() -> int:
    """GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def bind_device(local_rank: int) -> None:
    """Give this rank its GPU: local rank r takes device r of its node (both launchers; NCCL needs one GPU per rank,
    which `resolve_backend` checks for the local launcher and `env_backend` for torchrun/srun). Without CUDA, none."""
    import torch

    if not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise LaunchError(f"local rank {local_rank} has no GPU of its own: this node shows {n}")
    torch.cuda.set_device(local_rank)


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """torch.distributed's world for this rank; in the CUDA-rules test mode gloo then keeps NCCL's rules."""
    import torch.distributed as dist

    from megatron_rl.compat import cuda_rules

    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    if backend == "gloo" and cuda_rules.enabled():
        cuda_rules.install_nccl_rules()


def job_backend(backend: str, world_size: int, cuda_devices: int) -> str:
    """`resolve_backend` for a training job's `run.backend`: gloo is refused where the job's tensors live on GPUs
    (gloo has no CUDA all_gather_into_tensor, reduce_scatter or batched point-to-point, which the trainer and DDMA
    use). Tools that run a world of their own (conversion) keep `resolve_backend`."""
    backend = resolve_backend(backend, world_size, cuda_devices)
    if backend == "gloo" and cuda_devices:
        raise LaunchError(f"run.backend=gloo cannot carry the GPU tensors of a job on this machine's "
                          f"{cuda_devices} GPU{'s' if cuda_devices != 1 else ''}: use run.backend=nccl (or auto), "
                          f"or CUDA_VISIBLE_DEVICES= to run on the CPU")
    return backend


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_rank(world_size: int, environ: Optional[dict] = None) -> int:
    """CPU threads for each of `world_size` local ranks: OMP_NUM_THREADS where it is set, else this machine's usable
    cores shared out, at least one.

    OMP_NUM_THREADS counts one process's threads, as torchrun sets it for each of its ranks; whoever set it knows
    what else shares the cores (pytest-xdist's workers, other jobs on the node), so it wins. Without it a world of
    one rank (`megatron-rl eval` at TP1, a test's reference world) uses every core: the bf16 SmolLM2 test took
    26.7 s with it, against 33.6 s with one thread per rank, on the 2-core test machine. LaunchError for a value
    that is not a positive whole number (OpenMP's list form `4,2` gives the first level)."""
    env = os.environ if environ is None else environ
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value:
        first = value.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise LaunchError(f"OMP_NUM_THREADS={value!r} is not a positive whole number of threads")
        return int(first)
    return max(1, usable_cores() // world_size)


def _lead_own_group(owner: lifeline.Owner) -> None:
    """Make this rank the leader of a process group of its own, and end that group (SIGKILL) when `owner`, the
    launcher, ends: a rank whose launcher was killed must not train on as an orphan (`launch/lifeline.py`). Where
    the parent is the launcher (spawned ranks), its death signal also ends the rank, at once.
    (PR_SET_PDEATHSIG is Linux's; elsewhere a no-op.)"""
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    lifeline.watch(owner, lifeline.end_this_rank)


def _worker(rank: int, world_size: int, port: int, backend: str, dist_timeout_s: float, note_signals: bool,
            fn: Callable, args: tuple, queue, all_reported, beats: Optional[liveness.LocalBeats], beat_s: float,
            threads: int, owner: lifeline.Owner) -> None:
    import megatron_rl.compat.megatron_core  # noqa: F401 - a spawned rank's first import of it (the fork server's did)

    quiet.install()  # the warnings' filters came through the environment; the loggers' are set in each process
    _lead_own_group(owner)
    console.survive_hangup()  # a rank's output is its launcher's terminal, which may hang up
    heartbeat = beats.heartbeat(rank, beat_s).start() if beats is not None else None
    if note_signals:
        signals.install()
    import torch
    import torch.distributed as dist

    from megatron_rl.compat import activate

    set_rendezvous_env("127.0.0.1", port, rank, world_size, rank)
    torch.set_num_threads(threads)
    reported = False
    try:
        bind_device(rank)
        activate()
        init_process_group(backend, rank, world_size, dist_timeout_s)
        result = fn(rank, world_size, *args, **({"heartbeat": heartbeat} if heartbeat is not None else {}))
        # Serialize by value: tensors put on a queue are shared through file descriptors that die with this
        # process, which may exit before the parent reads them.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
        reported = True
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent, with its traceback
        queue.put((rank, False, (cause_of(e), traceback.format_exc())))
    finally:
        if reported:
            all_reported.wait()  # set by the launcher once every rank has reported; a failure ends them all instead
        if dist.is_initialized():
            dist.destroy_process_group()


def _end_all(procs, gone_within_s: float = 5.0) -> None:
    """Kill every rank's process group, reap the ranks, and wait (at most `gone_within_s`) until their groups are
    empty: a killed process that a rank started stays a member, as a zombie, until its new parent reaps it, and
    until then it has outlived the world."""
    _end_groups(procs)
    for p in procs:
        if p.pid is not None:
            p.join()
    deadline = time.monotonic() + gone_within_s
    for p in procs:
        while p.pid is not None and time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except OSError:  # ProcessLookupError: the group is empty
                break
            time.sleep(0.01)


def _end_groups(procs) -> None:
    """SIGKILL every rank's process group: the rank and all it started."""
    for p in procs:
        if p.pid is None:
            continue
        for kill in (os.killpg, os.kill):
            try:
                kill(p.pid, signal.SIGKILL)
            except OSError:
                pass


class _Forwarder:
    """The launcher's SIGTERM, SIGINT and SIGHUP handlers while its ranks run: the first signal goes on to every
    rank and starts the grace time; a second SIGINT (Ctrl-C twice) asks for the ranks to be killed at once. A
    signal this process ignores stays ignored (SIGHUP under `nohup`)."""

    def __init__(self, procs, grace_s: float, on_signal: Optional[Callable[[int], None]]):
        self.procs, self.grace_s, self.on_signal = procs, grace_s, on_signal
        self.signal, self.deadline, self.now = 0, None, False
        self._old: dict = {}

    def __enter__(self) -> "_Forwarder":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in signals.STOP_SIGNALS
                         if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signal:
            self.now = self.now or signum == signal.SIGINT
            return
        self.signal, self.deadline = signum, time.monotonic() + self.grace_s
        for p in self.procs:
            if p.pid is not None:  # (a rank not started yet gets nothing: it is killed with the others)
                try:
                    os.kill(p.pid, signum)
                except OSError:
                    pass
        if self.on_signal is not None:
            self.on_signal(signum)

    def must_kill(self) -> bool:
        return self.now or (self.deadline is not None and time.monotonic() > self.deadline)


def start_method(cuda: int) -> str:
    """How ranks start: forkserver on CPUs (a warm server with torch and Megatron-Core imported), spawn where CUDA is
    present; MEGATRON_RL_START_METHOD=spawn runs the GPU machines' method on a CPU (the tests use it). LaunchError
    for any other value."""
    method = os.environ.get("MEGATRON_RL_START_METHOD") or ("spawn" if cuda else "forkserver")
    if method not in ("spawn", "forkserver"):
        raise LaunchError(f"MEGATRON_RL_START_METHOD={method!r} is not one of spawn, forkserver")
    return method


def _preload_list(preload: Sequence[str]) -> list[str]:
    """What the fork server imports: torch and the launcher's own modules, then `preload`, then `preloaded` (which
    freezes them all out of the garbage collector's reach: see its docstring)."""
    return _PRELOAD + [m for m in preload if m not in _PRELOAD] + [_FREEZE]


def _start_context(cuda: int, preload: Sequence[str] = ()):
    """The multiprocessing context of `start_method` (torch's, whose pickler sends tensors). The dependency warnings
    are filtered first (`quiet.py`): the fork server and the spawned ranks inherit the filters through the
    environment, before they import Megatron-Core."""
    import torch.multiprocessing as mp

    quiet.install()
    method = start_method(cuda)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_preload_list(preload))
    return ctx


def start_fork_server(preload: Sequence[str] = ()) -> None:
    """Start this process's fork server now, where ranks start from one (CPUs): it imports torch, Megatron-Core and
    `preload` once, and every rank it forks starts with them imported instead of importing them itself. It imports
    them in the background: started before this process's own imports and checks, the two overlap.

    A process has one fork server for its life (Python's), and the first start decides what it imports: a later
    `preload`, and this call where a server already runs, change nothing. Its ranks also see the environment as it
    was when it started. Where NVIDIA devices are present (ranks are spawned) this does nothing, without importing
    torch; LaunchError for a bad MEGATRON_RL_START_METHOD."""
    if quiet.cuda_devices_present() or start_method(0) != "forkserver":
        return
    import multiprocessing
    from multiprocessing import forkserver

    quiet.install()
    multiprocessing.get_context("forkserver").set_forkserver_preload(_preload_list(preload))
    forkserver.ensure_running()


class _Ranks:
    """The processes of one `run_local` world and what each has reported: a result, or a failure (its own report,
    a death, a silent heartbeat)."""

    def __init__(self, procs: list, queue):
        self.procs, self.queue = procs, queue
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}

    def take(self, rank: int, ok: bool, payload) -> None:
        if ok:
            self.results[rank] = payload
        else:
            self.failures[rank] = RankFailure(rank, *payload)

    def open(self) -> list[int]:
        """Ranks that have reported nothing yet."""
        return [r for r in range(len(self.procs)) if r not in self.results and r not in self.failures]

    def dead(self) -> list[int]:
        """Ranks whose process ended without a report."""
        return [r for r in self.open() if self.procs[r].exitcode is not None]

    def drain(self) -> None:
        import queue as queue_mod

        while True:
            try:
                self.take(*self.queue.get_nowait())
            except queue_mod.Empty:
                return


def _wait(ranks: _Ranks, forward: Optional["_Forwarder"], deadline: Optional[float], timeout: Optional[float],
          beats, hang_timeout_s: Optional[float]) -> str:
    """Collect the ranks' reports until all have reported or one has failed (died, hung, or reported a failure);
    returns how a forwarded stop ended the world ("twice", "grace"), else "". TimeoutError past `deadline`."""
    import queue as queue_mod

    started = time.monotonic()
    while ranks.open():
        if forward is not None and forward.must_kill():
            _end_groups(ranks.procs)
            return "twice" if forward.now else "grace"
        remaining = 1.0 if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {ranks.open()} did not finish within {timeout:.0f} s")
        try:
            ranks.take(*ranks.queue.get(timeout=min(remaining, 1.0)))
        except queue_mod.Empty:
            for r in ranks.dead():
                ranks.failures[r] = RankFailure(r, death(ranks.procs[r].exitcode), death(ranks.procs[r].exitcode))
            if beats is not None and not ranks.failures:
                running = [r for r in ranks.open() if ranks.procs[r].exitcode is None]
                for r, silent in beats.silent(running, started, hang_timeout_s):
                    cause = liveness.hung_cause(silent, beats.label(r))
                    ranks.failures[r] = RankFailure(r, cause, cause)
        if ranks.failures:
            # Give the other ranks a moment to report (they are often blocked on the failed one).
            time.sleep(0.5)
            ranks.drain()
            return ""
    return ""


def _end_world(ranks: _Ranks, killed: str) -> dict[int, str]:
    """However the run ended: join the ranks briefly, note which died on their own (and, when every failure is a
    peer's timeout or lost connection, which still run: those are what the others waited for), then kill every
    rank's process group. Returns those causes by rank."""
    procs, failures = ranks.procs, ranks.failures
    deadline = time.monotonic() + (EXIT_WAIT_S if not failures and not killed else 0.1)
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    lingering = sorted(r for r in ranks.results if procs[r].exitcode is None)
    if lingering and not failures and not killed:
        # A rank that reported and still runs waits for something it started (a child that blocks the terminate
        # its exit sends, a non-daemon thread): every run would end this much later than it should.
        log.warning("megatron-rl: %s %s had not exited %.0f s after finishing (a process or thread it started "
                    "still ran); killed", "ranks" if len(lingering) > 1 else "rank", ", ".join(map(str, lingering)),
                    EXIT_WAIT_S)
    died_alone = {r: death(procs[r].exitcode) for r in ranks.dead()}  # before the launcher ends the rest
    if failures and all(is_peer_error(f.cause) for f in failures.values()):
        died_alone.update({r: HUNG for r, p in enumerate(procs)
                           if p.pid is not None and p.exitcode is None and r not in ranks.results})
    _end_all(procs)
    return died_alone


def run_local(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
              timeout: Optional[float] = 300.0, dist_timeout_s: float = 120.0,
              stop_grace_s: Optional[float] = None, on_signal: Optional[Callable[[int], None]] = None,
              hang_timeout_s: Optional[float] = None, preload: Sequence[str] = (),
              on_started: Optional[Callable[[list[int]], None]] = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return the results in rank order.

    `fn` must be importable (a module-level function). `backend`: gloo, nccl, or auto (NCCL when CUDA is present).
    `timeout`: seconds for the whole run, None for no limit; `dist_timeout_s`: the process group's timeout for one
    collective or message. `hang_timeout_s`: a rank whose heartbeat (`parallel/liveness.py`) has not moved for that
    long is hung, and the world is ended (None: not watched); in a watched world `fn` is also given its rank's
    started `liveness.Heartbeat` as `heartbeat=` (its `doing(label)` names the action a hang is reported in).
    `stop_grace_s`: forward SIGTERM and SIGINT to the ranks (`on_signal(signum)` is called
    then) and kill them that many seconds later if they have not ended. Raises LaunchError when the machine cannot
    host the world, RanksFailed (a RuntimeError) when a rank fails, dies or is killed, TimeoutError past the
    timeout. However it ends, every rank's process group is killed before it returns: nothing a rank started
    outlives it, and if this process ends first (SIGKILL), each rank ends with it (`launch/lifeline.py`).
    `preload`: modules the ranks import, imported once by the fork server where this call starts it
    (`start_fork_server`). `on_started(pids)`: called with the ranks' pids once all have started.
    """
    import torch

    cuda = local_gpus()
    backend = resolve_backend(backend, world_size, cuda)
    threads = threads_per_rank(world_size)  # read here: a fork server's ranks see the environment of its start
    ctx = _start_context(cuda, preload)
    queue, all_reported = ctx.Queue(), ctx.Event()
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    # Not daemonic: ranks may start processes of their own (dist_checkpointing's writer does).
    note = stop_grace_s is not None
    watched = hang_timeout_s is not None
    beats = liveness.LocalBeats(ctx, world_size) if watched else None  # unwatched worlds run no heartbeat thread
    beat_s = liveness.beat_interval_s(hang_timeout_s) if watched else 0.0
    owner = lifeline.Owner.this_process()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, dist_timeout_s, note, fn, args, queue,
                                               all_reported, beats, beat_s, threads, owner), daemon=False)
             for r in range(world_size)]
    ranks = _Ranks(procs, queue)
    forward = _Forwarder(procs, stop_grace_s or 0.0, on_signal)
    deadline = None if timeout is None else time.monotonic() + timeout
    killed = ""
    try:
        with forward if note else contextlib.nullcontext():
            for p in procs:
                p.start()
            if on_started is not None:
                on_started([p.pid for p in procs])
            killed = _wait(ranks, forward if note else None, deadline, timeout, beats, hang_timeout_s)
            if not ranks.open() and not ranks.failures:
                all_reported.set()  # the ranks leave together
    finally:
        died_alone = _end_world(ranks, killed)
        reservation.close()
    if ranks.failures or killed:
        ranks.drain()
        for r in ranks.dead():
            cause = "killed" if killed else died_alone.get(r, KILLED_AFTER)
            ranks.failures[r] = RankFailure(r, cause, cause)
        raise RanksFailed(likely_cause_first(list(ranks.failures.values())), world_size, signal=forward.signal,
                          killed=killed)
    results = ranks.results
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
