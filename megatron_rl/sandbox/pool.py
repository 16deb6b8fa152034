"""Run user code in worker processes, each call under a time limit: the sandbox of reward functions, environments
and agents.

User code is the least trusted code in a run: reward functions and environments can hang, crash the interpreter or
raise, and even our own sympy-based checks can spin for minutes on an adversarial expression. None of that may stop
training. So such code runs in separate processes that the controller can kill: the calls of a batch run on all
workers at once, every call has a deadline and so does the batch (a function that hangs costs a batch its batch
timeout, not one call timeout per response), a worker that misses a deadline is killed and replaced, and a worker
that dies is replaced too. The caller always gets one `Outcome` per call.

Workers are started with the `forkserver` (or `spawn`) method, never plain `fork`: the controller process holds
torch threads and process groups, and forking a threaded process is unsafe. Because nothing is inherited, what a
worker runs travels as its `target`: a `module:function` spec, or a picklable callable (a module-level function or
a `functools.partial` of one, such as `environments.pool.Runner.build` with the class's spec) that each worker
calls once at start-up to build the function it then runs, importing the user's code itself. A target that cannot
be built is reported back at start-up (a `SpecError`'s line as it is), so a bad spec fails fast in the parent with
one clear line.
"""

from __future__ import annotations

import collections
import functools
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Sequence, Union

from megatron_rl.sandbox.imports import SpecError, resolve
from megatron_rl.sandbox.log import LOG_MAX_BYTES, bound_log, write_to_log

log = logging.getLogger(__name__)

Target = Union[str, Callable[[], Callable]]  # a `module:function` spec, or what builds the function in the worker


def start_worker(conn, log_path: Optional[str], label: str) -> bool:
    """A sandboxed worker's first steps, before it imports anything of the user's: Ctrl-C ignored (it goes to the
    whole process group; the parent decides what happens to its workers), and with `log_path` its standard output
    and error pointed at the run's workers' log. False (with the reason sent to the parent) if the log cannot be
    written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_path is not None:
        try:
            write_to_log(log_path, label)
        except OSError as e:
            conn.send(("error", f"cannot write the workers' log {log_path}: {e}"))
            return False
    return True


def messages(conn):
    """A worker's messages from its pool, until the pool says stop (None) or the pipe closes."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        yield msg


def _worker_main(target: Target, conn, log_path: Optional[str] = None, label: str = "") -> None:
    """Worker loop: build the function once, then answer (call_id, args) messages until None or the pipe closes.
    With `log_path`, what the worker writes goes there (`write_to_log`), and so does the traceback of every call
    that raised (its one line goes to the pool)."""
    if not start_worker(conn, log_path, label):
        return
    try:
        fn = resolve(target) if isinstance(target, str) else target()
    except BaseException as e:  # noqa: BLE001 - everything must be reported, nothing may escape
        conn.send(("error", str(e) if isinstance(e, SpecError) else f"{label}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    for call_id, args in messages(conn):
        try:
            value = fn(*args)
            conn.send((call_id, "ok", value))
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from user code included
            if log_path is not None:  # in one write: the pool's workers share the file
                sys.stderr.write(f"{label} raised:\n{''.join(traceback.format_exception(e))}")
            try:
                conn.send((call_id, "error", f"{type(e).__name__}: {e}"))
            except (OSError, EOFError):
                return


@dataclass
class Outcome:
    """What happened to one call: `ok` with `value`, or not ok with `error` (raised, timed out, worker died)."""

    ok: bool
    value: Any = None
    error: Optional[str] = None
    seconds: float = 0.0
    worker: Optional[int] = None  # the index of the worker that ran it (None: it never reached one)


@dataclass
class _Worker:
    process: Any
    conn: Any
    state: str  # "starting" | "idle" | "busy"
    deadline: float = 0.0
    call: Optional[int] = None
    started: float = 0.0


def default_start_method() -> str:
    """forkserver where the platform has it (cheap restarts, no inherited threads), else spawn."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def default_batch_timeout(timeout_s: float) -> float:
    """The deadline of a whole batch when none is given: as long as four calls that time out."""
    return 4 * timeout_s


def _name_of(target: Callable) -> str:
    fn = target.func if isinstance(target, functools.partial) else target
    args = target.args if isinstance(target, functools.partial) else ()
    return f"{getattr(fn, '__qualname__', repr(fn))}{args!r}" if args else getattr(fn, "__qualname__", repr(fn))


class _Queue:
    """A batch's calls that wait for a worker, by the worker each prefers (None: any). An idle worker takes the
    oldest call that prefers it, else the oldest that prefers none; else it steals the newest call of the longest
    other queue, when that call would otherwise wait for a whole call of its worker to end (two or more queued
    there) or when its worker is not running (dead, or starting again: what it held is gone anyway). Stealing
    trades what a preference saves (a worker that keeps state between calls, such as a live environment) for not
    leaving a worker idle while calls wait."""

    def __init__(self, prefer: Sequence[Optional[int]], num_workers: int):
        self.by_worker: dict[Optional[int], deque] = collections.defaultdict(deque)
        for k, i in enumerate(prefer):
            self.by_worker[i if i is not None and 0 <= i < num_workers else None].append(k)

    def __bool__(self) -> bool:
        return any(self.by_worker.values())

    def take(self, i: int, workers: list) -> Optional[int]:
        for key in (i, None):
            if self.by_worker.get(key):
                return self.by_worker[key].popleft()
        others = [j for j, q in self.by_worker.items() if j is not None and q]
        if not others:
            return None
        j = max(others, key=lambda j: len(self.by_worker[j]))
        w = workers[j]
        if len(self.by_worker[j]) >= 2 or w is None or w.state == "starting":
            return self.by_worker[j].pop()
        return None

    def drain(self) -> list[int]:
        left = sorted(k for q in self.by_worker.values() for k in q)
        self.by_worker.clear()
        return left


class WorkerPool:
    """N worker processes running one function, built in each worker from `target` (the module's docstring); `map`
    runs a batch of calls with a per-call and a per-batch timeout (`batch_timeout_s`, None for
    `default_batch_timeout(timeout_s)`).

    `log_path`: a file the workers' standard output and error are appended to (a job's `workers.log` in its run
    directory), with the traceback of each call that raised; None leaves them where this process's go. Before each
    batch it is emptied once past `log_max_bytes` (`bound_log`).

    Not thread-safe: one controller thread drives it. A pool is cheap to keep and costly to start (each worker
    imports the function's module), so keep one per run and `close()` it at the end (or use `with`).
    """

    def __init__(self, target: Target, num_workers: int = 1, timeout_s: float = 5.0, start_method: Optional[str] = None,
                 startup_timeout_s: float = 120.0, batch_timeout_s: Optional[float] = None,
                 label: Optional[str] = None, log_path: Optional[str] = None, log_max_bytes: int = LOG_MAX_BYTES):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if batch_timeout_s is not None and not batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s={batch_timeout_s} must be > 0")
        if not isinstance(target, str) and not callable(target):
            raise TypeError(f"target must be a 'module:function' spec or a callable, not {type(target).__name__}")
        self.target = target
        # What the log lines and the process names call what the workers run (the caller's words: "reward function
        # 'mod:f'", "env 'mod:Class'"; by default the spec, or the name of what builds the function).
        self.label = label or (f"function {target!r}" if isinstance(target, str) else _name_of(target))
        # Where the workers' standard output and error go (appended; None: where this process's go).
        self.log_path = None if log_path is None else str(log_path)
        self.log_max_bytes = log_max_bytes
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = float(batch_timeout_s if batch_timeout_s is not None
                                     else default_batch_timeout(self.timeout_s))
        self.startup_timeout_s = float(startup_timeout_s)
        self.start_method = start_method or default_start_method()
        self._ctx = mp.get_context(self.start_method)
        self.stats = {"calls": 0, "errors": 0, "timeouts": 0, "crashes": 0, "restarts": 0}
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        self._closed = False
        # Start all workers at once and wait for their handshakes: a bad spec fails here, in the caller.
        for i in range(num_workers):
            self._workers[i] = self._spawn()
        try:
            self._await_startup(fail_fast=True)
        except BaseException:
            self.close()
            raise

    # ---- process management ------------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(self.target, child, self.log_path, self.label), daemon=True,
                                 name=f"worker[{self.label}]")
        proc.start()
        child.close()  # keep only the worker's copy, so its death shows up as EOF on ours
        now = time.monotonic()
        return _Worker(proc, parent, "starting", deadline=now + self.startup_timeout_s, started=now)

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            w.conn.close()
        except OSError:
            pass
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)

    def _handle_startup_message(self, i: int, w: _Worker, fail_fast: bool) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            msg = ("error", f"{self.label}: a worker exited with code {w.process.exitcode} during start-up")
        if msg[0] == "ready":
            w.state = "idle"
            return
        self._kill(w)
        self._workers[i] = None
        if fail_fast:
            raise SpecError(msg[1])
        log.error("a worker of %s could not restart: %s", self.label, msg[1])

    def _await_startup(self, fail_fast: bool) -> None:
        while True:
            starting = {w.conn: (i, w) for i, w in enumerate(self._workers) if w is not None and w.state == "starting"}
            if not starting:
                return
            remaining = min(w.deadline for _, w in starting.values()) - time.monotonic()
            for conn in wait(list(starting), timeout=max(0.0, remaining)):
                i, w = starting[conn]
                self._handle_startup_message(i, w, fail_fast)
            now = time.monotonic()
            for i, w in starting.values():
                if w.state == "starting" and self._workers[i] is w and now >= w.deadline:
                    self._kill(w)
                    self._workers[i] = None
                    message = f"{self.label}: worker did not start within {self.startup_timeout_s:g} s"
                    if fail_fast:
                        raise SpecError(message)
                    log.error("%s", message)

    def _replace(self, i: int) -> None:
        old = self._workers[i]
        if old is not None:
            self._kill(old)
        self.stats["restarts"] += 1
        self._workers[i] = self._spawn()

    # ---- calls -------------------------------------------------------------------------------------------------

    def map(self, calls: Sequence[tuple], prefer: Optional[Sequence[Optional[int]]] = None) -> list[Outcome]:
        """Run fn(*args) for each args tuple, spread over the workers; one Outcome per call, in order, each naming
        the worker that ran it.

        `prefer`: per call, the index of the worker it should run on where it can (its `Outcome.worker` from an
        earlier batch, for a function that keeps state in its worker), or None for any; see `_Queue` for when a
        call runs elsewhere. Never raises for anything the function does. A call that exceeds `timeout_s` (measured
        from when a worker receives it) gets ok=False and its worker is killed and replaced; the other calls carry
        on. When the batch exceeds `batch_timeout_s`, the calls still running or waiting get ok=False and the
        workers running them are replaced.
        """
        if self._closed:
            raise RuntimeError("WorkerPool is closed")
        if prefer is not None and len(prefer) != len(calls):
            raise ValueError(f"prefer has {len(prefer)} entries for {len(calls)} calls")
        bound_log(self.log_path, self.log_max_bytes)
        results: list[Optional[Outcome]] = [None] * len(calls)
        pending = _Queue(prefer if prefer is not None else [None] * len(calls), self.num_workers)
        batch_deadline = time.monotonic() + self.batch_timeout_s
        # Workers that could not be restarted earlier get another chance now.
        for i, w in enumerate(self._workers):
            if w is None:
                self._workers[i] = self._spawn()
        while pending or any(w is not None and w.state == "busy" for w in self._workers):
            if time.monotonic() >= batch_deadline:
                self._end_batch(results, pending)
                break
            if all(w is None for w in self._workers):
                for k in pending.drain():  # nothing can run: fail what is left, do not hang or raise
                    results[k] = Outcome(False, error="no worker could be started")
                break
            for i, w in enumerate(self._workers):
                if w is not None and w.state == "idle" and (k := pending.take(i, self._workers)) is not None:
                    try:
                        w.conn.send((k, tuple(calls[k])))
                    except (OSError, EOFError, ValueError) as e:
                        results[k] = Outcome(False, error=f"could not send the call to the worker: {e}", worker=i)
                        self.stats["crashes"] += 1
                        self._replace(i)
                        continue
                    now = time.monotonic()
                    w.state, w.call, w.started, w.deadline = "busy", k, now, now + self.timeout_s
            live = {w.conn: i for i, w in enumerate(self._workers) if w is not None and w.state in ("busy", "starting")}
            if not live:
                continue
            deadline = min(min(self._workers[i].deadline for i in live.values()), batch_deadline)
            for conn in wait(list(live), timeout=max(0.0, deadline - time.monotonic())):
                i = live[conn]
                w = self._workers[i]
                if w.state == "starting":
                    self._handle_startup_message(i, w, fail_fast=False)
                    continue
                self._collect(i, w, results)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w is None or now < w.deadline:
                    continue
                if w.state == "busy":
                    if w.conn.poll():  # finished while we were busy elsewhere: take the answer
                        self._collect(i, w, results)
                        continue
                    results[w.call] = Outcome(False, error=f"timed out after {self.timeout_s:g} s",
                                              seconds=now - w.started, worker=i)
                    self.stats["timeouts"] += 1
                    self._replace(i)
                elif w.state == "starting":
                    self._kill(w)
                    self._workers[i] = None
                    log.error("a worker of %s did not restart within %g s", self.label, self.startup_timeout_s)
        self.stats["calls"] += len(calls)
        self.stats["errors"] += sum(1 for r in results if r is not None and not r.ok)
        return results  # type: ignore[return-value]

    def _end_batch(self, results: list, pending: _Queue) -> None:
        """The batch's deadline has passed: answers already sent are taken, the rest fail; busy workers are
        replaced (they may be stuck, and the next batch needs them idle)."""
        error = f"batch timed out after {self.batch_timeout_s:g} s"
        for i, w in enumerate(self._workers):
            if w is None or w.state != "busy":
                continue
            if w.conn.poll():  # answered (or died) in the meantime
                self._collect(i, w, results)
                continue
            results[w.call] = Outcome(False, error=error, seconds=time.monotonic() - w.started, worker=i)
            self.stats["timeouts"] += 1
            self._replace(i)
        for k in pending.drain():
            results[k] = Outcome(False, error=error)

    def _collect(self, i: int, w: _Worker, results: list) -> None:
        elapsed = time.monotonic() - w.started
        try:
            call_id, status, value = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            results[w.call] = Outcome(False, error=f"worker died (exit code {w.process.exitcode})", seconds=elapsed,
                                      worker=i)
            self.stats["crashes"] += 1
            self._replace(i)
            return
        except Exception as e:  # an answer that cannot be unpickled here
            results[w.call] = Outcome(False, error=f"unreadable result: {type(e).__name__}: {e}", seconds=elapsed,
                                      worker=i)
            self._replace(i)
            return
        if call_id != w.call:  # cannot happen with one call in flight per worker; do not trust the worker
            results[w.call] = Outcome(False, error="worker answered the wrong call", seconds=elapsed, worker=i)
            self._replace(i)
            return
        results[w.call] = (Outcome(True, value=value, seconds=elapsed, worker=i) if status == "ok"
                           else Outcome(False, error=value, seconds=elapsed, worker=i))
        w.state, w.call = "idle", None

    # ---- lifetime ----------------------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w is None:
                continue
            try:
                w.conn.send(None)
            except (OSError, EOFError, ValueError):
                pass
        for w in self._workers:
            if w is None:
                continue
            w.process.join(timeout=1)
            self._kill(w)
        self._workers = [None] * self.num_workers

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
