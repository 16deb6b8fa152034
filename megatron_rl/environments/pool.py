"""Environments of multi-turn episodes, run in worker processes with the guarantees reward functions have.

An environment is a user class given as `module:Class` (or `path/file.py:Class`), built per episode as
`Class(record, seed)` (`record`: every field of the prompt record). `reset()` returns the first user message;
`step(response)` takes the model's reply as text and returns `(message, reward, done)`: the next message (a str for
the user's turn, or a {"role", "content"} dict such as a tool result; None when done), the turn's reward (a finite
number) and whether the episode is over. `Environment` writes the interface down as a typing Protocol; a class is
checked against its calls' signatures when the job's configuration is (`environment_problem`), before any process
starts.

Environment code is as untrusted as reward code, so it runs in the sandbox's worker processes (`sandbox.WorkerPool`):
per-call and per-batch deadlines, a hung or dead worker killed and replaced, every call answered. Each worker imports
the class when it starts, so a spec that cannot be used fails at construction with one line. Whatever an
environment does wrong in a call (raises, hangs, kills its process, returns something ill-typed) ends that episode
with an error `Turn` whose one line names the class and the method; the other episodes of the batch are unaffected.
An environment that fails on more than half of a rollout batch's episodes, MAX_FAILING_BATCHES batches in a row (the
rule of `FunctionReward`; the caller says where a batch ends, `EnvironmentPool.end_batch`), is broken, not unlucky:
EnvironmentFailureError, one line. What the workers print, and each failure's traceback, go to `log_path` (a job's
`workers.log`), not the console.

The worker side is stateless: a call carries (record, seed, the model's responses so far), and the environment after
them is `Class(record, seed)`, reset and stepped through those responses. Environments must therefore be
deterministic given (record, seed, responses) (draw any randomness from `seed`); then a replaced worker loses
nothing and a resumed run redraws exactly. Replaying costs O(turns^2) steps per episode, so each worker keeps the
instances it stepped last (up to LIVE_PER_WORKER, keyed by the episode and its responses so far), and the pool
sends each call to the worker that answered the episode's previous one (`WorkerPool.map(prefer=)`): a call finds its
episode live and steps it once, and replays only when it ran elsewhere (its worker was busy with two or more calls
waiting and another was idle, see `sandbox.pool._Queue`), or the instance was evicted, or its worker replaced. A
call's deadline covers its replay.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import math
import numbers
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

from megatron_rl.sandbox import MAX_FAILING_BATCHES, SpecError, WorkerPool, failing_batches, resolve

log = logging.getLogger(__name__)

LIVE_PER_WORKER = 256  # environment instances a worker keeps between calls (least recently stepped evicted first)


class EnvironmentSpecError(SpecError):
    """An environment spec that cannot be used (bad form, import fails, not a class, no `reset` or `step`)."""


class EnvironmentFailureError(RuntimeError):
    """The environment failed on most episodes, batch after batch; the message is one line."""


# ---- the class and its messages -----------------------------------------------------------------------------------


def spec_problem(spec: str) -> Optional[str]:
    """What is wrong with the form of an environment spec (`module:Class` or `path/file.py:Class`), or None."""
    module, _, attr = spec.rpartition(":")
    return None if module and attr else "must look like 'module:Class' (or 'path/file.py:Class')"


class Environment(Protocol):
    """What `env.cls` names: a class built per episode as `Class(record, seed)`, whose `reset()` returns the first
    message and `step(reply)` the next one, the turn's reward and whether the episode is over (the module docstring
    says what each may be). `environment_problem` checks a class against it before any process starts."""

    def __init__(self, record: dict, seed: int) -> None: ...

    def reset(self) -> Union[str, dict]: ...

    def step(self, reply: str) -> tuple[Union[str, dict, None], float, bool]: ...


def _takes(fn, *args) -> bool:
    """Whether `fn` can be called with these positional arguments (True where its signature cannot be read)."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def episode_failure_rule(what: str, name: str, spec: str, errors: list[str], episodes: int, streak: int,
                         log_path: Optional[str], remedy: str) -> int:
    """The failure rule of a batch of `episodes` episodes, `errors` the one line of each that failed, for the
    environments' pool and the agents alike (`what`: "environment" or "agent", `name` as the spec is shown): the
    failures logged in one line, and EnvironmentFailureError once more than half failed in MAX_FAILING_BATCHES
    batches in a row. Returns the new count of such batches (`streak` before this one)."""
    where = f" (tracebacks and output: {log_path})" if log_path else ""
    streak = failing_batches(
        errors, episodes, streak,
        lambda text: log.warning("%s %s failed on %d of %d episodes, which end with reward 0%s: %s", what, spec,
                                 len(errors), episodes, where, text))
    if streak >= MAX_FAILING_BATCHES:
        raise EnvironmentFailureError(
            f"{name} {spec!r} failed on {len(errors)} of {episodes} episodes, and on more than half in each of the "
            f"last {streak} batches (last error: {errors[-1]}); stopping: fix the {what}{where}, or raise {remedy}")
    return streak


def environment_problem(spec: str) -> Optional[str]:
    """What stops `spec` from naming an environment class, found by importing it in this process (None: nothing):
    a bad form, a module or file that cannot be imported, a missing attribute, not a class, no callable `reset` or
    `step`. One line, without the spec (the caller names it)."""
    problem = spec_problem(spec)
    if problem:
        return problem
    try:
        cls = resolve(spec, "env")
    except SpecError as e:
        return e.reason
    attr = spec.rpartition(":")[2]
    if not isinstance(cls, type):
        return f"{attr!r} is {_a(type(cls).__name__)}, not a class"
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        return f"class {attr} has no callable {' or '.join(missing)}"
    # The `Environment` protocol's calls, bound to the class's signatures (self given as None).
    for call, fn, args in ((f"{attr}(record, seed)", cls, ({}, 0)), (f"{attr}.reset()", cls.reset, (None,)),
                           (f"{attr}.step(reply)", cls.step, (None, ""))):
        if not _takes(fn, *args):
            return f"{call} does not match its signature {_signature(fn)} (the interface: environments.pool." \
                "Environment)"
    return None


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def agent_problem(spec: str) -> Optional[str]:
    """What stops `spec` from naming an agent function (found by importing it here), or None; one line without the
    spec."""
    module, _, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not module or not attr:
        return "must look like 'module:function' (or 'path/file.py:function')"
    try:
        fn = resolve(spec, "agent")
    except SpecError as e:
        return e.reason
    if isinstance(fn, type):
        return f"{attr!r} is a class: an agent is a function (record, seed, client) -> reward"
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError):
        return f"{attr!r} does not take (record, seed, client)"
    if importlib.util.find_spec("openai") is None:
        return "agents get an OpenAI client: pip install openai"
    return None


def resolve_environment(spec: str) -> type:
    """The environment class `spec` names, imported; EnvironmentSpecError (one line) when it cannot be used."""
    problem = environment_problem(spec) if isinstance(spec, str) else "must be a string 'module:Class'"
    if problem:
        raise EnvironmentSpecError.of("env", spec, problem)
    return resolve(spec, "env")


def as_message(value: Any) -> Optional[dict]:
    """An environment's message as a chat message: a str is the user's turn, a dict must be exactly {"role": str,
    "content": str} (a non-empty role), None stays None. ValueError, saying what it got, for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"role": "user", "content": value}
    if (isinstance(value, dict) and set(value) == {"role", "content"} and isinstance(value["role"], str)
            and value["role"] and isinstance(value["content"], str)):
        return {"role": value["role"], "content": value["content"]}
    shown = f"{value!r:.80}" if isinstance(value, dict) else f"{value!r:.50} ({_a(type(value).__name__)})"
    raise ValueError(f"{shown}, expected a str or a {{'role', 'content'}} dict of strings")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in tuple('aeiou') else 'a'} {noun}"


def _one_line(text: str) -> str:
    return (str(text).splitlines() or [""])[0][:300]


@dataclass
class Turn:
    """What the environment answered to one call: after `reset` (the first message; reward 0, not done) or after
    the model's latest response.

    message: the next chat message, {"role", "content"} (a str given here becomes the user's turn); None when the
        episode is over. A message given with done=True is kept, but no model turn follows it.
    reward: the turn's reward; the episode's return is the sum over its turns.
    done: whether the episode is over.
    error: one line when the call failed (raised, timed out, worker died, ill-typed result); the episode is then
        over: done=True, reward 0.0, no message.
    seconds: how long the call took in its worker (replay included).
    """

    message: Optional[dict]
    reward: float = 0.0
    done: bool = False
    error: Optional[str] = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.message = as_message(self.message)
        if self.message is None and not self.done:
            raise ValueError("a Turn without a message must end the episode (done=True)")
        if self.error is not None and (self.message is not None or not self.done or self.reward != 0.0):
            raise ValueError("a failed Turn has no message, done=True and reward 0.0")

    @classmethod
    def failed(cls, error: str, seconds: float = 0.0) -> "Turn":
        return cls(None, 0.0, True, _one_line(error), seconds)


def episode_key(record: dict, seed: int) -> bytes:
    """What names one episode, in the workers (their live instances) and in the pool (where each episode lives)."""
    return hashlib.sha1(pickle.dumps((record, seed), protocol=4)).digest()


# ---- the worker side ----------------------------------------------------------------------------------------------


class _Failed(Exception):
    """A call of the environment went wrong; the message is the error Turn's line."""


@dataclass
class _Answer:
    """A worker's answer to one call: the Turn, and how many earlier responses it replayed to rebuild the episode."""

    turn: Turn
    replayed: int = 0


class Runner:
    """The worker-side function of one environment class: (record, seed, responses) -> _Answer; reset when
    `responses` is empty. Keeps the instances it stepped last, keyed by (episode, responses so far)."""

    def __init__(self, spec: str, cls: type):
        self.spec, self.cls = spec, cls
        self.live: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def __call__(self, record: dict, seed: int, responses: tuple) -> _Answer:
        episode = episode_key(record, seed)
        env = self.live.pop((episode, responses[:-1]), None) if responses else None
        replayed = 0
        try:
            if env is None:
                env = self._call(f"{self.spec}(record, seed)", self.cls, record, seed)
                first = self._call(f"{self.spec}.reset", env.reset)
                if first is None:
                    raise _Failed(f"env {self.spec}.reset returned None, expected a str or a {{'role', 'content'}} "
                                  f"dict of strings")
                try:
                    first = as_message(first)
                except ValueError as e:
                    raise _Failed(f"env {self.spec}.reset returned {e}") from None
                if not responses:
                    self._keep((episode, ()), env)
                    return _Answer(Turn(first))
                for k, response in enumerate(responses[:-1]):
                    replayed += 1
                    _, _, ended = self._step(env, response)
                    if ended:
                        raise _Failed(f"env {self.spec}.step ended the episode at response {k + 1} of "
                                      f"{len(responses)} when replayed: responses after the end, or an environment "
                                      f"that is not deterministic given (record, seed, responses)")
            message, reward, done = self._step(env, responses[-1])
        except _Failed as e:
            return _Answer(Turn.failed(str(e)), replayed)
        if not done:
            self._keep((episode, responses), env)
        return _Answer(Turn(message, reward, done), replayed)

    def _keep(self, key: tuple, env: Any) -> None:
        self.live[key] = env
        while len(self.live) > LIVE_PER_WORKER:
            self.live.popitem(last=False)

    @staticmethod
    def _call(where: str, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the episode fails, not the worker
            # The whole traceback to the worker's standard error (the run's workers.log); its one line to the pool.
            sys.stderr.write(f"env {where} raised:\n{''.join(traceback.format_exception(e))}")  # one write
            raise _Failed(f"env {where} raised {type(e).__name__}: {e}") from None

    def _step(self, env: Any, response: str) -> tuple[Optional[dict], float, bool]:
        value = self._call(f"{self.spec}.step", env.step, response)
        where = f"env {self.spec}.step returned"
        if not isinstance(value, tuple) or len(value) != 3:
            got = f"a tuple of {len(value)}" if isinstance(value, tuple) else (
                "None" if value is None else _a(type(value).__name__))
            raise _Failed(f"{where} {got}, expected (message, reward, done)")
        message, reward, done = value
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise _Failed(f"{where} reward {reward!r:.50} ({_a(type(reward).__name__)}), expected a finite number")
        if not isinstance(done, bool):
            raise _Failed(f"{where} done={done!r:.50} ({_a(type(done).__name__)}), expected a bool")
        if message is None and not done:
            raise _Failed(f"{where} message None with done=False, expected the next message")
        try:
            return as_message(message), float(reward), done
        except ValueError as e:
            raise _Failed(f"{where} message {e}") from None


def runner(spec: str) -> Runner:
    """What each environment worker runs (`WorkerPool`'s target, with the class's spec): the class checked and
    imported in the worker, when it starts (under the start-up deadline, as reward workers import their function;
    a class that cannot be used is one `SpecError` line, which fails the pool at construction), in its `Runner`."""
    problem = environment_problem(spec)
    if problem:
        raise SpecError.of("env", spec, problem)
    return Runner(spec, resolve(spec, "env"))


# ---- the controller side ------------------------------------------------------------------------------------------


class EnvironmentPool:
    """Worker processes running environment class `spec` (`module:Class` or `path/file.py:Class`): `first` starts
    episodes, `step` answers the model's latest responses; one `Turn` per episode, in order, never an exception for
    what the environment does (see the module's docstring). `timeout_s` bounds one call, `batch_timeout_s` (None:
    `sandbox.default_batch_timeout`) a batch.

    Not thread-safe: one thread drives it. Keep one per run and `close()` it at the end (or use `with`)."""

    def __init__(self, spec: str, num_workers: int, timeout_s: float, start_method: Optional[str] = None,
                 batch_timeout_s: Optional[float] = None, log_path: Optional[str] = None):
        problem = spec_problem(spec) if isinstance(spec, str) else "must be a string 'module:Class'"
        if problem:
            raise EnvironmentSpecError(f"env {spec!r} {problem}")
        self.spec = spec
        try:
            self._pool = WorkerPool(functools.partial(runner, spec), num_workers=num_workers, timeout_s=timeout_s,
                                    start_method=start_method, batch_timeout_s=batch_timeout_s, label=f"env {spec!r}",
                                    log_path=log_path)
        except SpecError as e:  # its line names the class ("env 'spec': ...")
            raise EnvironmentSpecError(str(e), e.reason) from None
        self.log_path = log_path
        self.failures = 0  # episodes of the last call that failed
        self.failing_batches = 0  # batches in a row in which more than half of the episodes failed (`end_batch`)
        self._counts = {"calls": 0, "errors": 0, "seconds": 0.0, "replayed_steps": 0}
        # The worker that answered each running episode's last call, where its instance lives: its next call goes
        # there (`WorkerPool.map(prefer=)`), so that it steps once rather than replaying. Oldest forgotten first.
        self._where: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._where_limit = 2 * LIVE_PER_WORKER * num_workers

    @property
    def stats(self) -> dict:
        """Episode calls, the failed ones (errors: raised, ill-typed, timed out or crashed), timeouts, crashes and
        worker restarts, the seconds spent waiting on batches, and the steps replayed to rebuild episodes (0 when
        every call found its episode live)."""
        s = self._pool.stats
        return {"calls": self._counts["calls"], "errors": self._counts["errors"], "timeouts": s["timeouts"],
                "crashes": s["crashes"], "restarts": s["restarts"], "seconds": self._counts["seconds"],
                "replayed_steps": self._counts["replayed_steps"]}

    def first(self, episodes: Sequence[tuple[dict, int]]) -> list[Turn]:
        """Start each (record, seed) episode: `Class(record, seed).reset()`'s message (reward 0, not done)."""
        return self._run("reset", [(record, seed, ()) for record, seed in episodes])

    def step(self, episodes: Sequence[tuple[dict, int, list[str]]]) -> list[Turn]:
        """For each (record, seed, the model's responses so far): the environment's answer to the last response,
        the environment being `Class(record, seed)` after reset and the earlier responses."""
        calls = []
        for record, seed, responses in episodes:
            if not responses:
                raise ValueError("step needs the episode's responses so far, at least one; first() starts episodes")
            calls.append((record, seed, tuple(responses)))
        return self._run("step", calls)

    def _run(self, method: str, calls: list[tuple]) -> list[Turn]:
        if not calls:
            return []
        t0 = time.monotonic()
        episodes = [episode_key(record, seed) for record, seed, _ in calls]
        outcomes = self._pool.map(calls, prefer=[self._where.pop(e, None) for e in episodes])
        self._counts["seconds"] += time.monotonic() - t0
        turns = []
        for episode, outcome in zip(episodes, outcomes):
            if outcome.ok:  # an _Answer: what the environment did wrong is in its Turn
                turns.append(dataclasses.replace(outcome.value.turn, seconds=outcome.seconds))
                self._counts["replayed_steps"] += outcome.value.replayed
            else:  # timed out, or the worker died
                turns.append(Turn.failed(f"env {self.spec}.{method}: {outcome.error}", outcome.seconds))
            if not turns[-1].done:
                self._where[episode] = outcome.worker
        while len(self._where) > self._where_limit:
            self._where.popitem(last=False)
        errors = [t.error for t in turns if t.error is not None]
        self._counts["calls"] += len(calls)
        self._counts["errors"] += len(errors)
        self.failures = len(errors)
        return turns

    def end_batch(self, errors: Sequence[str], episodes: int) -> None:
        """The rule for a batch of `episodes` episodes (all the calls of one rollout batch: its resets and every
        turn's steps), `errors` the one line of each that failed: the failures logged in one line, and
        EnvironmentFailureError once more than half failed in MAX_FAILING_BATCHES batches in a row."""
        self.failing_batches = episode_failure_rule("environment", "env", self.spec, list(errors), episodes,
                                                    self.failing_batches, self.log_path,
                                                    "env.timeout_s / env.num_workers")

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
