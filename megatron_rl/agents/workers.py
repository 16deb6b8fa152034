"""Agent functions run in worker processes, many episodes at once in each.

An agent (`env.agent=module:function`) is called once per episode as `function(record, seed, client)` and runs the
whole episode: it talks to the generator through `client` (an `openai.OpenAI` bound to its episode's base URL and
the run's key; an `openai.AsyncOpenAI` for an `async def` agent) and returns the episode's reward, a number, or a
list of numbers (one per turn, summed). Unlike an environment's call, an agent's call lasts as long as its episode,
and every episode of a batch must be running at once (the generator decodes them together), so each worker process
runs its episodes in threads of its own; the processes are what the job can kill.

Agent code is as untrusted as reward code: workers start with `forkserver` (never `fork`: the job's process holds
torch threads), import the function themselves (a spec that cannot be used fails at start-up with one line), ignore
Ctrl-C (the job decides), and write their output and each failure's traceback to the run's `workers.log`, as the
sandbox's workers do (`sandbox.start_worker`); they are processes of their own rather than a `sandbox.WorkerPool`
because an agent's call lasts its whole episode and a worker runs many at once. The pool
reports every episode's end once: its reward, or one line (raised, ill-typed result, its worker died). Time limits
are the caller's (`agents/play.py`): it stops waiting for an agent that is late and the pool `retire`s the worker
that still runs it once its batch is over, replacing it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Callable, Optional

from megatron_rl.environments.pool import agent_problem
from megatron_rl.sandbox import SpecError, default_start_method, messages, resolve, start_worker

log = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 3600.0  # the agent's client waits this long for a reply: the job bounds the agent, not the model


def as_reward(value) -> float:
    """An agent's return as the episode's reward: a finite number, or the sum of a list of them; ValueError saying
    what it got otherwise."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                            for v in items):
        raise ValueError(f"returned {value!r:.60}, expected a finite number or a list of them")
    return float(sum(items))


def _run_agent(fn, record, seed, base_url: str, key: str) -> float:
    import openai

    if inspect.iscoroutinefunction(fn):
        async def main():
            async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                          timeout=CLIENT_TIMEOUT_S) as client:
                return await fn(record, seed, client)
        return as_reward(asyncio.run(main()))
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S) as client:
        return as_reward(fn(record, seed, client))


def _worker_main(spec: str, conn, log_path: Optional[str], label: str) -> None:
    """Import the agent, then run each ("run", episode, record, seed, base_url, key) in a thread of its own,
    answering (episode, "ok", reward) or (episode, "error", line)."""
    if not start_worker(conn, log_path, label):
        return
    problem = agent_problem(spec)
    if problem:
        conn.send(("error", f"{label}: {problem}"))
        return
    fn = resolve(spec, "agent")
    import openai  # noqa: F401 - imported before the first episode, whose first request has env.timeout_s
    conn.send(("ready", os.getpid()))
    sending = threading.Lock()

    def run(episode, record, seed, base_url, key):
        try:
            msg = (episode, "ok", _run_agent(fn, record, seed, base_url, key))
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from user code included
            if log_path is not None:  # one write: the workers share the file
                sys.stderr.write(f"{label} raised:\n{''.join(traceback.format_exception(e))}")
            msg = (episode, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300])
        with sending:
            try:
                conn.send(msg)
            except (OSError, EOFError):
                pass

    for msg in messages(conn):
        threading.Thread(target=run, args=msg[1:], daemon=True, name=f"agent-{msg[1]}").start()


class AgentWorkers:
    """`num_workers` processes running agent episodes (module docstring); `on_end(episode, ok, value)` is called,
    from the pool's reader thread, once per episode started: the reward, or one line. Thread-safe."""

    def __init__(self, spec: str, num_workers: int, on_end: Callable[[str, bool, object], None],
                 log_path: Optional[str] = None, startup_timeout_s: float = 120.0):
        import multiprocessing as mp

        self.spec, self.label, self.log_path, self.on_end = spec, f"agent {spec!r}", log_path, on_end
        self._ctx = mp.get_context(default_start_method())
        self._lock = threading.Lock()
        self._workers: list = []  # (process, conn)
        self._running: list[set] = []  # per worker: the episodes it runs
        self._closed = False
        for _ in range(num_workers):
            self._workers.append(self._spawn())
            self._running.append(set())
        deadline = time.monotonic() + startup_timeout_s
        try:
            for proc, conn in self._workers:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise SpecError(f"{self.label}: a worker did not start within {startup_timeout_s:g} s")
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    proc.join(timeout=5)
                    msg = ("error", f"{self.label}: a worker exited with code {proc.exitcode} during start-up")
                if msg[0] != "ready":
                    raise SpecError(msg[1])
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name="megatron-rl-agents", daemon=True)
        self._reader.start()

    def _spawn(self):
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(self.spec, child, self.log_path, self.label), daemon=True,
                                 name=f"worker[{self.label}]")
        proc.start()
        child.close()
        return proc, parent

    def run(self, episode: str, record: dict, seed: int, base_url: str, key: str) -> None:
        """Start one episode's agent on the least busy worker."""
        with self._lock:
            i = min(range(len(self._workers)), key=lambda k: len(self._running[k]))
            self._running[i].add(episode)
            try:
                self._workers[i][1].send(("run", episode, record, seed, base_url, key))
            except (OSError, EOFError):
                pass  # its death is reported by the reader

    def retire(self, episodes: set) -> None:
        """Kill and replace every worker still running one of `episodes` (agents the caller stopped waiting for);
        their other episodes end with one line each."""
        with self._lock:
            doomed = [i for i, eps in enumerate(self._running) if eps & episodes]
        for i in doomed:
            self._replace(i, "was stopped: another episode of its worker ran past env.timeout_s")

    def _replace(self, i: int, why: str) -> None:
        with self._lock:
            proc, conn = self._workers[i]
            lost, self._running[i] = self._running[i], set()
            self._workers[i] = self._spawn() if not self._closed else (proc, conn)
        _kill(proc, conn)
        if not self._closed:  # the new worker's handshake is read by the reader
            for episode in sorted(lost):
                self.on_end(episode, False, f"{self.label}: its worker {why}")

    def _read(self) -> None:
        while not self._closed:
            with self._lock:
                conns = {conn: i for i, (_, conn) in enumerate(self._workers)}
            try:
                ready = wait(list(conns), timeout=0.2)
            except (OSError, ValueError):  # a connection closed by a replacement meanwhile
                continue
            for conn in ready:
                i = conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if not self._closed and self._workers[i][1] is conn:
                        proc = self._workers[i][0]
                        proc.join(timeout=5)
                        self._replace(i, f"died (exit code {proc.exitcode})")
                    continue
                if msg[0] in ("ready", "error") and len(msg) == 2:
                    if msg[0] == "error":
                        log.error("a worker of %s could not restart: %s", self.label, msg[1])
                    continue
                episode, status, value = msg
                with self._lock:
                    self._running[i].discard(episode)
                self.on_end(episode, status == "ok", value)

    def close(self) -> None:
        self._closed = True
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except (OSError, EOFError):
                pass
            _kill(proc, conn)


def _kill(proc, conn) -> None:
    try:
        conn.close()
    except OSError:
        pass
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5)
