"""Liveness: a rank is hung when it stops beating, not when a peer's work takes long.

Every rank runs a heartbeat thread (`Heartbeat`) that publishes, once a second, a beat and the action of the schedule
the rank is in: the launcher starts it and hands it to the loop, which names each action as it starts it
(`heartbeat.doing("Train(step=12)")`). The thread needs nothing from the main thread but the interpreter: it beats
while the rank computes, while it waits in a collective for a slow peer (gloo and NCCL release the GIL), while it loads
or saves a checkpoint. It stops when the process stops: SIGSTOP, a frozen or swapped-out node, a C call that holds
the GIL forever, a dead interpreter. A rank whose beat has not moved for `hang_timeout_s()` is hung; the job ends
within that time plus a few beats, in one line naming the rank and its last action. A healthy job is never ended for
being slow: a warm start or checkpoint load of any length beats all along, and so do the ranks waiting for it.

Who watches:
    local launcher  the launcher process (`launch/spawn.py:run_local`) reads the beats from shared memory
                    (`LocalBeats`) and ends every rank's process group.
    torchrun/srun   each rank's thread also watches the two ranks after it in the ring through the rendezvous store
                    (`StoreBeats`); the first to find a hung rank reports it once (the store counts reporters), and
                    every rank's thread, seeing the verdict, ends its process; a rank on the stopped one's host
                    SIGKILLs it first (elsewhere srun --kill-on-bad-exit ends it).

Process groups keep a timeout of their own, `collective_timeout_s()` (default 2 h, at least the hang timeout): the
backstop for live ranks that wait on each other forever (a deadlock). It no longer has to be short, because a dead
or stopped rank is found by its beats.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Callable, Optional

HANG_TIMEOUT_ENV = "MEGATRON_RL_DIST_TIMEOUT_S"
COLLECTIVE_TIMEOUT_ENV = "MEGATRON_RL_COLLECTIVE_TIMEOUT_S"
DEFAULT_HANG_TIMEOUT_S = 600.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 7200.0
LABEL_BYTES = 96  # an action's label in shared memory


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be > 0 seconds")
    return value


def hang_timeout_s() -> float:
    """Seconds without a heartbeat after which a rank is hung (MEGATRON_RL_DIST_TIMEOUT_S, default 600)."""
    return _env_seconds(HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT_S)


def collective_timeout_s() -> float:
    """The process groups' timeout for one collective or message between live ranks (MEGATRON_RL_COLLECTIVE_TIMEOUT_S,
    default 7,200 s, never below the hang timeout)."""
    return max(_env_seconds(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S), hang_timeout_s())


def beat_interval_s(timeout_s: float) -> float:
    """One beat a second, more often under a short timeout, so that a hang is found within timeout + 2 beats."""
    return max(0.05, min(1.0, timeout_s / 10))


class Heartbeat:
    """This rank's beat: a daemon thread calling `publish(count, label)` every `interval_s` from `start()` to
    `stop()`. `label` is what the main thread last said it was doing (`doing`); `show_label`, where cheap (shared
    memory), publishes it at once, so that the line names the action the rank stopped in, not one from up to a beat
    before. One per rank process, made and started by the launcher, which passes it to the loop."""

    def __init__(self, publish: Callable[[int, str], None], interval_s: float,
                 show_label: Optional[Callable[[str], None]] = None):
        self.publish, self.interval_s, self.show_label = publish, interval_s, show_label
        self.label = "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-rl-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def doing(self, label: str) -> None:
        """Name what this rank does now (the schedule's action); shown in the line if the rank hangs."""
        self.label = label
        if self.show_label is not None:
            self.show_label(label)

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self.publish(count, self.label)
            except Exception:  # noqa: BLE001 - a beat that cannot be published is a missed beat, not a crash
                pass
            self._stop.wait(self.interval_s)


# ---- the local launcher: beats in shared memory, watched by the launcher process -----------------------------------
class LocalBeats:
    """Shared memory for a local world's beats: the time (CLOCK_MONOTONIC, one clock for all processes of a
    machine) and the label of each rank's last beat. Made by the launcher, handed to each rank at its start."""

    def __init__(self, ctx, world_size: int):
        self.world_size = world_size
        self.times = ctx.RawArray("d", world_size)
        self.labels = ctx.RawArray("c", world_size * LABEL_BYTES)

    def heartbeat(self, rank: int, interval_s: float) -> Heartbeat:
        def show_label(label: str) -> None:
            data = label.encode()[: LABEL_BYTES - 1].ljust(LABEL_BYTES, b"\0")
            self.labels[rank * LABEL_BYTES:(rank + 1) * LABEL_BYTES] = data

        def publish(count: int, label: str) -> None:
            self.times[rank] = time.monotonic()

        return Heartbeat(publish, interval_s, show_label)

    def label(self, rank: int) -> str:
        return bytes(self.labels[rank * LABEL_BYTES:(rank + 1) * LABEL_BYTES]).rstrip(b"\0").decode(errors="replace")

    def silent(self, ranks, started: float, timeout_s: float) -> list[tuple[int, float]]:
        """(rank, seconds since its last beat) for each of `ranks` silent for longer than `timeout_s`; a rank that
        has not beaten yet counts from `started` (its process's start)."""
        now = time.monotonic()
        out = []
        for r in ranks:
            since = now - max(self.times[r], started)
            if since > timeout_s:
                out.append((r, since))
        return out


def hung_cause(silent_s: float, label: str) -> str:
    """The cause of a hung rank, as the failure line shows it."""
    return f"hung: no heartbeat for {silent_s:.0f} s (MEGATRON_RL_DIST_TIMEOUT_S), last in {label}"


# ---- torchrun / srun: beats through the rendezvous store, watched by the ranks --------------------------------------
class StoreBeats:
    """A launched world's beats in the rendezvous store (its own connection: `store.clone()`). Each rank beats under
    `hb/<rank>` and watches the `watchers` ranks after it in the ring; a rank whose beat count has not changed for
    `timeout_s` by the watcher's own clock (no clock is shared between nodes) is hung. `report(line)` is called once
    in the whole world, by the first watcher to find it; `end()` on every rank once a verdict exists."""

    PREFIX = "megatron-rl/liveness/"

    def __init__(self, store, rank: int, world_size: int, timeout_s: float,
                 describe: Callable[[int, float, str], str], report: Callable[[str], None],
                 end: Callable[[], None], watchers: int = 2):
        import torch.distributed as dist

        self.store = dist.PrefixStore(self.PREFIX, store.clone())
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.describe, self.report, self.end = describe, report, end
        self.watched = sorted({(rank + i) % world_size for i in range(1, watchers + 1)} - {rank})
        self.seen: dict[int, tuple[bytes, float]] = {}
        self.started = time.monotonic()
        self.ended = False
        self.store.set(f"where/{rank}", f"{socket.gethostname()}|{os.getpid()}")

    def publish(self, count: int, label: str) -> None:
        self.store.set(f"hb/{self.rank}", f"{count}|{label}")
        if not self.ended:
            self.watch()

    def _finish(self) -> None:
        """End this rank; first, a rank on the hung rank's host SIGKILLs it (a stopped process takes no SIGTERM, and
        torchrun waits 30 s before its own SIGKILL; on other hosts srun --kill-on-bad-exit ends it)."""
        self.ended = True
        try:
            hung = int(self.store.get("hung"))
            host, _, pid = self.store.get(f"where/{hung}").decode().partition("|")
            if host == socket.gethostname() and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, RuntimeError):  # gone already, or the store is: ending is what matters
            pass
        self.end()

    def watch(self) -> None:
        if self.store.check(["verdict"]):
            self._finish()
            return
        now = time.monotonic()
        for r in self.watched:
            key = f"hb/{r}"
            value = self.store.get(key) if self.store.check([key]) else b""
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
                continue
            since = now - last[1]
            if since > self.timeout_s:
                label = value.decode(errors="replace").partition("|")[2] or "starting"
                if self.store.add("reporters", 1) == 1:  # the first watcher in the world reports it
                    line = self.describe(r, since, label)
                    self.store.set("hung", str(r))
                    self.store.set("verdict", line)
                    self.report(line)
                self._finish()
                return
