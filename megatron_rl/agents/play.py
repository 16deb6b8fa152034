"""Agent episodes on a generator replica (`env.agent`): the user's agent drives each episode through an OpenAI client,
the replica's endpoint answers it from the generator, and the job trains on exactly the ids the endpoint saw.

    GeneratorExecutor.generate / evaluate (controller/executors.py)
      Agents.requests        every episode's agent started in the agent workers (`agents/workers.py`) with its own
                             base URL (`/s/<session>/v1` on the leader's endpoint, `serving/server.py`) and the run's
                             key; its first chat request's messages (and tools) rendered into the prompt's ids
      Generator.generate     with `AgentTurns` (`inference/episodes.py`): at a turn's end the reply is the pending
                             request's response (content and tool calls parsed, the sampled ids and log-probs in
                             it); at the next decode iteration the agent's next request is its observation: the
                             messages after the conversation so far, rendered as new turns (`tokenizers/turns.py`)
      AgentTurns.returns     each episode's reward: what the agent returned (a number, or per-turn numbers summed)

Token in, token out: a request that repeats the conversation so far (the assistant's messages as the endpoint
returned them) and adds messages after it has those new messages alone rendered, so nothing sampled is decoded and
encoded again. A request that rewrites the conversation (drops or edits an earlier message, as agents that summarize
or trim their context do) splits the episode, as prime-rl and SkyRL do: what it held so far becomes a sample of its
own, and the episode goes on from the request rendered whole, in the same cache slot (`Sequence.restart`); every
part is trained with the episode's return and its advantage (`controller/collector.py`), and
`episode/rewritten` counts the splits.

The timing is an environment's (`inference/episodes.py`): the replica waits for the agent's next request at the
decode iteration after the reply, up to `env.timeout_s`, so a batch is a pure function of its records, seeds and
agents, and a resumed run replays it, when the agent is deterministic given (record, seed, replies). An episode the
job ends (its `env.max_turns` or `env.max_tokens` spent) answers the agent's next request with an empty reply,
`finish_reason` "length" and `episode_done: true`; the agent then returns its reward. An agent that raises, returns
something that is not a reward, makes no request or does not return within `env.timeout_s`, or whose worker dies,
ends its episode with reward 0 and one line (in the run's `workers.log`); more than half of a batch failing three
batches in a row stops the run, as with environments.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.environments.play import EpisodeTurns, Episodes, _Episode
from megatron_rl.environments.pool import episode_failure_rule
from megatron_rl.inference import SamplingParams
from megatron_rl.inference.episodes import Turns
from megatron_rl.inference.sequence import Restart
from megatron_rl.serving.protocol import ChatRequest, ProtocolError, chat_body, normalize_message, reply_body


@dataclass
class _AgentEpisode(_Episode):
    """One agent episode: its session, its conversation so far (messages as the endpoint saw them, and every id the
    model read or wrote), the request waiting for its reply, and what the agent's call ended with."""

    session: str = ""
    model: str = "policy"  # the served model's name, in its replies
    events: "queue.Queue" = field(default_factory=queue.Queue)  # ("request", ChatRequest, Future) | ("end", ok, value)
    messages: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    request: Optional[ChatRequest] = None
    pending: Optional[Future] = None  # the response the agent waits for
    asking: bool = False  # a request is queued or waits for its reply
    over: bool = False  # the generator is done with the episode: later requests get the done reply
    ended: bool = False  # the agent's call has ended (returned or failed)
    rewritten: int = 0
    turns: int = 0  # replies sent
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- the endpoint's thread ------------------------------------------------------------------------------------
    def handle(self, kind: str, body: dict) -> Future:
        if kind != "chat":
            raise ProtocolError(404, "an agent episode takes chat completions (/chat/completions)")
        req = ChatRequest.parse(body)
        with self.lock:
            if self.over:
                return _done(self.done_body())
            if self.asking:
                raise ProtocolError(409, "one request at a time per episode: wait for the reply to the last one")
            self.asking = True
        fut: Future = Future()
        self.events.put(("request", req, fut))
        return fut

    def done_body(self) -> dict:
        return {**chat_body(self.model, self.ids, [], [], "length", "", []), "episode_done": True}

    # ---- the generator's thread ---------------------------------------------------------------------------------
    def answer(self, body=None, error: Optional[ProtocolError] = None) -> None:
        fut, self.pending = self.pending, None
        with self.lock:
            self.asking = False
        if fut is not None:
            fut.set_exception(error) if error is not None else fut.set_result(body)

    def wait(self, timeout_s: float):
        """The agent's next event, or ("timeout",) after `timeout_s`; the time counts as the environment's."""
        t0 = time.perf_counter()
        try:
            return self.events.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return ("timeout",)
        finally:
            self.env_s += time.perf_counter() - t0

    def fail(self, line: str) -> None:
        self.failures += 1
        self.error = self.error or line

    def end(self, ok: bool, value) -> None:
        self.ended = True
        if ok:
            self.rewards = [float(value)]
        else:
            self.fail(str(value))

    def close(self) -> None:
        """The generator is done with this episode: a request waiting is answered with the done reply."""
        with self.lock:
            self.over = True
        if self.pending is not None:
            self.answer(self.done_body())


def _done(body: dict) -> Future:
    fut: Future = Future()
    fut.set_result(body)
    return fut


class Agents(Episodes):
    """The agents of one generator replica: the endpoint and the agent workers on its leader, the rendering of turns,
    and the replica's group over which the leader shares what it renders (as `Episodes`, whose sharing and
    batch-end rule it keeps)."""

    def __init__(self, env, tokenizer, chat: bool, replica_group, is_leader: bool, sampling: SamplingParams,
                 log_path: Optional[str] = None, model: str = "policy"):
        self.model, self.key = model, secrets.token_urlsafe(18)
        self.endpoint = None
        self._live: dict[str, _AgentEpisode] = {}
        self._batches = 0
        self.failing_batches = 0
        super().__init__(env, tokenizer, chat, replica_group, is_leader, sampling, log_path)

    def _start_pool(self) -> None:
        from megatron_rl.agents.workers import AgentWorkers
        from megatron_rl.serving.server import Endpoint

        try:
            self.endpoint = Endpoint(self.model, self.key).start()
            self._pool = AgentWorkers(self.env.agent, self.env.num_workers, self._on_end, log_path=self.log_path)
        except BaseException as e:  # noqa: BLE001 - raised where the pool is first used
            self._pool_error = e

    def _on_end(self, session: str, ok: bool, value) -> None:
        ep = self._live.get(session)
        if ep is not None:
            ep.events.put(("end", ok, value))

    def close(self) -> None:
        super().close()
        if self.endpoint is not None:
            self.endpoint.close()

    _episode = _AgentEpisode

    def _first_prompts(self, episodes: list) -> list[Optional[list[int]]]:
        """Every episode's agent started with its own session (`Episodes.requests` seeds them as environments),
        and the ids of each one's first chat request."""
        self._batches += 1
        pool = self.pool
        for i, e in enumerate(episodes):
            e.session, e.model = f"{self._batches}-{i}-{secrets.token_hex(4)}", self.model
            self._live[e.session] = e
            self.endpoint.open_session(e.session, e.handle)
            pool.run(e.session, e.record, e.seed, self.endpoint.session_url(e.session), self.key)
        deadline = time.monotonic() + self.env.timeout_s
        return [self._first(e, deadline - time.monotonic()) for e in episodes]

    def _turns(self, episodes: list) -> "AgentTurns":
        return AgentTurns(self, episodes)

    def _first(self, e: _AgentEpisode, timeout_s: float) -> Optional[list[int]]:
        """The ids of an episode's first request, or None (the agent returned, failed or made none in time)."""
        event = e.wait(timeout_s)
        if event[0] == "request":
            _, req, fut = event
            try:
                e.ids = self.template.prompt(req.messages, req.tools)
            except (ValueError, KeyError, TypeError) as err:
                fut.set_exception(ProtocolError(400, f"the chat template cannot render these messages: {err}"))
                e.fail(f"agent {self.env.agent!r}: its first request cannot be rendered: {err}")
                return None
            e.messages, e.request, e.pending = list(req.messages), req, fut
            return list(e.ids)
        if event[0] == "end":
            e.end(*event[1:])
        else:
            e.fail(f"agent {self.env.agent!r} made no request within env.timeout_s={self.env.timeout_s:g} s")
        e.close()
        return None

    def end_batch(self, turns: "AgentTurns") -> None:
        """The environments' failure rule over the batch's agents (`EnvironmentPool.end_batch`)."""
        turns.settle()
        errors = [e.error for e in turns.episodes if e.error is not None]
        self.failing_batches = episode_failure_rule("agent", "agent", self.env.agent, errors, len(turns.episodes),
                                                    self.failing_batches, self.log_path, "env.timeout_s")


class AgentTurns(EpisodeTurns):
    """`inference.episodes.Turns` for one batch of agent episodes (module docstring)."""

    owner: Agents

    def __init__(self, owner: Agents, episodes: list[_AgentEpisode]):
        super().__init__(owner, episodes)
        self._settled = False

    def empty(self):
        """Agents play batch by batch (the config refuses rollout.in_flight with env.agent): an agent's episode may
        be split by a rewritten conversation, which a live engine's checkpoint does not store mid-flight."""
        return Turns.empty(self)

    def start(self, ended) -> None:
        self._ended = ended
        if not self.owner.is_leader:
            return
        for turn in ended:
            e = self.episodes[turn.request]
            reply = list(turn.reply)
            body = reply_body(self.owner.model, self.owner.tok, "chat", e.request, e.ids, reply, list(turn.logprobs),
                              turn.reason, f"call_{turn.request}_{e.turns}")
            e.ids = e.ids + reply
            e.messages.append(normalize_message(body["choices"][0]["message"], "reply"))
            e.turns += 1
            e.answer(body)

    def finish(self) -> list:
        observations = None
        if self.owner.is_leader:
            observations = [self._observation(self.episodes[t.request]) for t in self._ended]
        return self.owner.share(observations)

    def _observation(self, e: _AgentEpisode):
        """The ids of the agent's next request after the conversation so far, a `Restart` from the whole request
        where it rewrote the conversation, or None (its episode is over)."""
        agent, timeout = self.owner.env.agent, self.owner.env.timeout_s
        event = e.wait(timeout)
        if event[0] == "end":
            e.end(*event[1:])
            return None
        if event[0] == "timeout":
            e.fail(f"agent {agent!r} made no request and did not return within env.timeout_s={timeout:g} s")
            return None
        _, req, fut = event
        e.pending, e.request = fut, req
        new = _after(e.messages, req.messages)
        try:
            if new is None:  # rewritten: the episode goes on as a new part, from the conversation rendered whole
                prompt = self.owner.template.prompt(req.messages, req.tools)
                e.rewritten += 1
                e.messages, e.ids = list(req.messages), list(prompt)
                return Restart(prompt)
            obs = self.owner.template.observation(new)
        except (ValueError, KeyError, TypeError) as err:
            e.answer(error=ProtocolError(400, f"the chat template cannot render these messages: {err}"))
            e.fail(f"agent {agent!r}: a request cannot be rendered: {err}")
            return None
        e.messages = list(req.messages)
        e.ids = e.ids + obs
        return obs

    def closed(self, request: int, finish: str) -> None:
        if self.owner.is_leader:
            self.episodes[request].close()

    def settle(self) -> None:
        """On the leader, once the batch has been generated: wait for every agent's return (each bounded by
        env.timeout_s; a request meanwhile gets the done reply), close the sessions, and retire the workers of the
        agents that are late."""
        if self._settled or not self.owner.is_leader:
            return
        self._settled = True
        late = set()
        deadline = time.monotonic() + self.owner.env.timeout_s
        for e in self.episodes:
            e.close()
            while not e.ended:
                event = e.wait(deadline - time.monotonic())
                if event[0] == "request":
                    event[2].set_result(e.done_body())
                    with e.lock:
                        e.asking = False
                elif event[0] == "end":
                    e.end(*event[1:])
                else:  # (an agent already failed for being late is not counted twice)
                    if e.error is None:
                        e.fail(f"agent {self.owner.env.agent!r} did not return within env.timeout_s="
                               f"{self.owner.env.timeout_s:g} s of its episode's end")
                    e.ended = True
                    late.add(e.session)
        for e in self.episodes:
            self.owner.endpoint.close_session(e.session)
            self.owner._live.pop(e.session, None)
        if late:
            self.owner.pool.retire(late)

    def returns(self) -> list[float]:
        self.settle()
        return super().returns()

    def statistics(self, outputs: list) -> dict:
        self.settle()
        return {**super().statistics(outputs), "rewritten": sum(e.rewritten for e in self.episodes)}


def _after(known: list, messages: list) -> Optional[list]:
    """The messages of a request after the conversation so far, or None where it does not extend it (an earlier
    message changed or dropped, nothing new, or an assistant's message among the new ones)."""
    if len(messages) <= len(known) or any(_key(a) != _key(b) for a, b in zip(known, messages)):
        return None
    new = messages[len(known):]
    return None if any(m["role"] == "assistant" for m in new) else new


def _key(m: dict) -> tuple:
    calls = tuple((c.get("id"), c["function"].get("name"), c["function"].get("arguments"))
                  for c in m.get("tool_calls") or ())
    return m["role"], m["content"], calls, m.get("tool_call_id")
