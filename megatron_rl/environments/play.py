"""Episodes on a generator replica: the environments' side of multi-turn rollouts (`env.cls`), for the job's
generator executors and for `megatron-rl eval`.

    GeneratorExecutor.generate / evaluate (controller/executors.py), eval's worker (evaluation/eval.py)
      Episodes.requests      the first message of each episode (its environment's `reset`, on the replica's
                             leader), rendered into prompt ids once and shared with the replica's other ranks
      Generator.generate     with `EpisodeTurns` (`inference/episodes.py`): each reply decoded to text, the
                             environments stepped in their worker processes while the replica decodes (a thread of
                             the leader), each observation rendered into the ids of one turn once, as it arrives,
                             and shared with the other ranks
      EpisodeTurns.returns   each episode's return (the sum of its turns' rewards) and the batch's statistics, on
                             the leader, for scoring (`controller/scoring.py`)

Token in, token out: an episode's tokens are the prompt's ids, then each reply's sampled ids and each
observation's ids as they were rendered; nothing is decoded and encoded again, so the trainer learns from exactly
the ids the generator sampled (`TurnTemplate` renders one new turn at a time).

An environment must be deterministic given (record, seed, replies): its calls replay it from them where a worker
lost it (`environments/pool.py`), and so does a resumed run.
"""

from __future__ import annotations

import collections
import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.inference.episodes import EndedTurn, Turns
from megatron_rl.inference.sampling import stream_seed
from megatron_rl.tokenizers.turns import TurnTemplate


@dataclass
class _Episode:
    record: dict
    seed: int
    prompt: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    failures: int = 0
    error: Optional[str] = None  # the one line of its call that failed (which ended it)
    env_s: float = 0.0

    def took(self, turn) -> None:
        """Count an environment call's `Turn` (`environments/pool.py`)."""
        self.env_s += turn.seconds or 0.0
        if turn.error is not None:
            self.failures += 1
            self.error = self.error or turn.error


class Episodes:
    """The environments of one generator replica: their worker processes on its leader (`pool`, None on the other
    ranks), the rendering of turns, and the replica's group (all its ranks, TP and pipeline stages: `pgs.mp`), over
    which the leader, its first rank, shares what it renders. `log_path`: where the workers' output and tracebacks go
    (a job's `workers.log`; None: the console).

    The failure rule is the batch's (`end_batch`, on the leader after each training batch): an environment that
    fails on more than half of the episodes of MAX_FAILING_BATCHES batches in a row stops the run with one line."""

    def __init__(self, env, tokenizer, chat: bool, replica_group, is_leader: bool, sampling: SamplingParams,
                 log_path: Optional[str] = None):
        self.env, self.tok, self.is_leader, self.group = env, tokenizer, is_leader, replica_group
        self.log_path = log_path
        self.template = TurnTemplate(tokenizer, chat)
        self.sampling = sampling
        # The leader's workers start in the background (an interpreter each, and the class's imports), while the job
        # warms up and pushes its first weights; the first batch waits for them if it comes first.
        self._pool, self._pool_error = None, None
        self._starting = threading.Thread(target=self._start_pool, name="megatron-rl-env-start", daemon=True)
        if is_leader:
            self._starting.start()
        self.calls = PoolCalls(lambda: self.pool)  # on the leader: the one thread that drives the workers

    def _start_pool(self) -> None:
        from megatron_rl.environments.pool import EnvironmentPool

        try:
            self._pool = EnvironmentPool(self.env.cls, num_workers=self.env.num_workers, timeout_s=self.env.timeout_s,
                                         log_path=self.log_path)
        except BaseException as e:  # noqa: BLE001 - raised where the pool is first used
            self._pool_error = e

    @property
    def pool(self):
        """The leader's environment workers, once started (their start's error, raised here)."""
        self._starting.join()
        if self._pool_error is not None:
            raise self._pool_error
        return self._pool

    def close(self) -> None:
        if self.is_leader:
            self.calls.close()
            self._starting.join()
            if self._pool is not None:
                self._pool.close()

    def share(self, obj):
        """The leader's `obj` on every rank of the replica (a broadcast over its group, where it has several ranks)."""
        if self.group is None or self.group.size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def requests(self, records: list, base_seeds: list[int], n: int) -> tuple[list[GenerationRequest], "EpisodeTurns"]:
        """One request per episode: `n` episodes of each record, episode k of record i seeded stream_seed(base_seeds
        [i], k) (its environment and its sampling alike), each prompt its environment's first message; and the
        `Turns` that plays them."""
        episodes = [self._episode(rec.as_dict(), stream_seed(base, k)) for rec, base in zip(records, base_seeds)
                    for k in range(n)]
        reqs = []
        for e, prompt in zip(episodes, self.share(self._first_prompts(episodes) if self.is_leader else None)):
            # An episode that failed to start (one line in the log) samples nothing: a request the generator refuses
            # (no new token), with its stop token as the prompt; its return is 0 (an agent's: what it returned).
            e.prompt = prompt if prompt is not None else [self.tok.eos_id]
            params = {**self.sampling.__dict__, "n": 1, "seed": e.seed, **({} if prompt else {"max_new_tokens": 0})}
            reqs.append(GenerationRequest(e.prompt, SamplingParams(**params)))
        return reqs, self._turns(episodes)

    # What differs between environments and agents (`agents/play.py: Agents`): an episode's record, its first
    # prompts (on the leader), and the `Turns` that plays a batch.
    _episode = _Episode

    def _first_prompts(self, episodes: list) -> list[Optional[list[int]]]:
        firsts = self.calls.submit("first", [(e.record, e.seed) for e in episodes]).result()
        for e, t in zip(episodes, firsts):
            e.took(t)
        return [self.template.prompt(t.message) if t.error is None else None for t in firsts]

    def _turns(self, episodes: list) -> "EpisodeTurns":
        return EpisodeTurns(self, episodes)

    def restored(self, state: list[dict]) -> "EpisodeTurns":
        """A batch's `EpisodeTurns` as a checkpoint saved it (`EpisodeTurns.state`), mid-flight."""
        return self._turns([self._episode(**e) for e in state])

    def end_batch(self, turns: "EpisodeTurns") -> None:
        """On the leader, once a training batch's episodes are over: the environment's failure rule over them
        (`EnvironmentPool.end_batch`: one line for the batch's failures; EnvironmentFailureError, which stops the
        run, after MAX_FAILING_BATCHES batches in a row failing on more than half)."""
        errors = [e.error for e in turns.episodes if e.error is not None]
        self.pool.end_batch(errors, len(turns.episodes))


class EpisodeTurns(Turns):
    """`inference.episodes.Turns` for one batch of episodes (see the module docstring)."""

    def __init__(self, owner: Episodes, episodes: list[_Episode]):
        self.owner, self.episodes = owner, episodes  # `episodes`: the batch's, in request order (its returns)
        self.playing: dict[int, _Episode] = dict(enumerate(episodes))  # request -> the episode `start` answers
        self.max_turns, self.max_tokens = owner.env.max_turns, owner.env.max_tokens
        self.answer_steps = owner.env.answer_steps
        self._ended: list[EndedTurn] = []  # the turns of the last `start` (agents' `finish` reads them)
        self._rounds: collections.deque = collections.deque()  # outstanding starts: (their turns, the call or None)

    def start(self, ended: list[EndedTurn]) -> None:
        if self.owner.is_leader:
            tok, stops = self.owner.tok, self.owner.tok.stop_ids
            for turn in ended:
                reply = list(turn.reply)
                while reply and reply[-1] in stops:
                    reply.pop()
                self.playing[turn.request].replies.append(tok.decode(reply))
        self._ended = ended
        self.resume(ended)

    def resume(self, ended: list[EndedTurn]) -> None:
        """The environment calls for `ended`, whose replies the episodes hold already (`start`, or a checkpoint):
        queued on the leader's one thread that drives the workers (`PoolCalls`), and answered, in order, by
        `finish` (up to `answer_steps` of them outstanding)."""
        call = None
        if self.owner.is_leader:
            calls = [(e.record, e.seed, list(e.replies)) for e in (self.playing[turn.request] for turn in ended)]
            call = self.owner.calls.submit("step", calls)
        self._rounds.append((ended, call))

    def finish(self) -> list[Optional[list[int]]]:
        ended, call = self._rounds.popleft()
        observations = None
        if self.owner.is_leader:
            observations = []
            for turn, answer in zip(ended, call.result(), strict=True):
                e = self.playing[turn.request]
                e.rewards.append(answer.reward)
                e.took(answer)
                done = answer.done or answer.message is None
                observations.append(None if done else self.owner.template.observation(answer.message))
        return self.owner.share(observations)

    def closed(self, request: int, finish: str) -> None:
        self.playing.pop(request, None)

    # ---- a live engine's (`inference.episodes.Turns`: `empty`, `join`) and its checkpoints ------------------------
    def empty(self) -> "EpisodeTurns":
        return EpisodeTurns(self.owner, [])

    def join(self, batch: "EpisodeTurns", requests: list[Optional[int]]) -> None:
        if batch.owner is not self.owner:
            raise ValueError("a live engine's batches of episodes must share their environments")
        self.playing.update({r: e for r, e in zip(requests, batch.episodes, strict=True) if r is not None})

    def state(self) -> list[dict]:
        """The batch's episodes as plain containers (a checkpoint of a live engine; `Episodes.restored` reads it)."""
        return [copy.deepcopy(e.__dict__) for e in self.episodes]

    # ---- on the leader, once the batch has been generated ----------------------------------------------------------
    def returns(self) -> list[float]:
        """Each episode's return: the sum of its turns' rewards (0 for an episode whose environment failed at its
        start)."""
        return [float(sum(e.rewards)) for e in self.episodes]

    def statistics(self, outputs: list) -> dict:
        """The batch's episode statistics (`collector.episode_metrics`) from the generator's outputs."""
        every = [x for o in outputs for x in [*(getattr(o, "parts", None) or []), o]]  # an agent's split parts too
        policy = sum(sum(o.policy_mask or []) for o in every)
        total = sum(len(o.token_ids) for o in every)
        return {"episodes": len(outputs), "turns": sum(o.turns for o in outputs), "policy_tokens": policy,
                "env_tokens": total - policy, "env_s": sum(e.env_s for e in self.episodes),
                "failures": sum(e.failures for e in self.episodes)}


class PoolCalls:
    """The one thread that drives a replica's environment workers (`EnvironmentPool` is not thread-safe): what is
    `submit`ted runs in order, off the decode loop's thread. The step calls queued while an earlier batch runs go to
    the workers together, as one batch (an episode has at most one call outstanding, so they never collide): a slow
    environment answers the turns that ended at nearby decode steps side by side (`env.answer_steps`), and a live
    engine's answers never overlap the next batch's `first` calls. `pool()`: the workers, once started."""

    def __init__(self, pool):
        self._pool = pool
        self._cv = threading.Condition()
        self._queue: list[tuple[str, list, Future]] = []  # (method, calls, their future)
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, method: str, calls: list) -> Future:
        """Queue `calls` to `EnvironmentPool.<method>` ("first" or "step"); the future's result is their `Turn`s (or
        what the pool raised)."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the environments are closed")
            self._queue.append((method, calls, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, name="megatron-rl-environments", daemon=True)
                self._thread.start()
            self._cv.notify()
        return future

    def _drive(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.pop(0)]
                while batch[0][0] == "step" and self._queue and self._queue[0][0] == "step":
                    batch.append(self._queue.pop(0))
            try:
                turns = getattr(self._pool(), batch[0][0])([c for _, calls, _ in batch for c in calls])
            except BaseException as e:  # noqa: BLE001 - raised again where the answer is taken (`result`)
                for _, _, future in batch:
                    future.set_exception(e)
                continue
            for _, calls, future in batch:
                future.set_result(turns[:len(calls)])
                turns = turns[len(calls):]

    def close(self) -> None:
        """Stop the thread once the calls queued are done."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
