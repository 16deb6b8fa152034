"""What the generator is asked for and what it returns, and the one place that holds a sequence's state while it runs.

A request (`GenerationRequest`) is expanded into `n` sequences (`Sequence`), each with its own sampling stream. A
sequence's state is all here: its prompt, the tokens sampled and appended so far with their behaviour log-probs,
which of them the policy sampled (an episode appends observations too), its cache slot, why it ended, and the
episode's counters. The engine (`inference/engine.py`) schedules sequences over cache slots; the cache blocks a slot
holds are the block pool's (`inference/paging.py`); routes are recorded into the sequence's `RouteLog`
(`inference/routes.py`). What ends a sequence or a turn (`StopRule`) and how an environment's answer is applied to an
episode (`Sequence.observe`) are decided here, for the one-stage engine and the pipelined decode alike.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_rl.inference.episodes import EndedTurn
from megatron_rl.inference.routes import RouteLog
from megatron_rl.inference.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Optional[str] = None


@dataclass
class SampledResponse:
    request_id: Optional[str]
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log mu(token) under softmax(logits / T), T = 1 for greedy
    finish_reason: str  # "stop" (stop token or string), "length", or "error"; an episode's: "done", "turns" too
    text: Optional[str] = None
    error: Optional[str] = None
    policy_mask: Optional[list[bool]] = None  # an episode's: True at sampled tokens, False at observations
    turns: int = 1  # an episode's model turns
    # With the weights' version known (`rollout.in_flight`): the version that sampled each of `token_ids`.
    versions: Optional[list[int]] = None
    # With `Generator(record_routes=True)`: each token's experts [len(prompt_ids + token_ids), layers, k]
    # (`inference/routes.py`); None otherwise.
    routes: Optional[torch.Tensor] = None
    # An agent episode split where its conversation was rewritten: the parts before this one, in order, each a
    # response of its own (finish_reason "rewritten"); None otherwise.
    parts: Optional[list["SampledResponse"]] = None


@dataclass
class Sequence:
    """One sample of one request, from the moment it waits for a slot to its output."""

    req: int  # its output's index
    sample: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    request_id: Optional[str] = None
    episode: bool = False  # a turn that ends holds the slot for the environment's answer (`inference/episodes.py`)
    budget: Optional[int] = None  # an episode's most tokens after its prompt (`Turns.max_tokens`)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    finish: Optional[str] = None
    # Episodes: False where `tokens` holds an observation's ids; where this turn's tokens start; model turns so far;
    # tokens sampled so far (the sampling stream's counter); cache positions filled before the slot was
    # (re)admitted.
    policy: list[bool] = field(default_factory=list)
    turn_start: int = 0
    turns: int = 0
    sampled: int = 0
    cached: int = 0
    admitted_at: int = 0  # the engine step at which it last got a slot (a paged cache preempts the latest first)
    routes: RouteLog = field(default_factory=RouteLog)  # recorded routes of positions 0, 1, ...
    versions: list[int] = field(default_factory=list)  # each token's weight version, where the engine knows it
    # An agent episode whose conversation was rewritten (`Restart`): what it held before each rewrite, a part of its
    # own (prompt, tokens, logprobs, policy, versions, routes), trained as a sample with the episode's return.
    parts: list[dict] = field(default_factory=list)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def length(self) -> int:
        """len(history), without building it."""
        return len(self.prompt) + len(self.tokens)

    @property
    def last(self) -> int:
        """The last token of `history`, without building it."""
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    def ended_turn(self) -> EndedTurn:
        """The turn that has just ended, for `Turns.start`."""
        return EndedTurn(self.req, self.sample, tuple(self.tokens[self.turn_start:]), self.finish,
                         tuple(self.logprobs[self.turn_start:]))

    def append(self, token: int, logprob: float, stops: "StopRule", version: Optional[int] = None) -> bool:
        """Append a token this sequence sampled (with weights `version`, when known); True when it ends the sequence
        or, in an episode, its turn (`finish` then says why)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.policy.append(True)
        if version is not None:
            self.versions.append(version)
        self.sampled += 1
        self.finish = stops(self, token)
        if self.finish is None:
            return False
        self.turns += 1
        return True

    def observe(self, obs, max_turns: int, max_len: int) -> bool:
        """Apply an environment's answer to the turn that ended: True when the episode goes on (the observation's
        ids appended, to be prefilled from the last reply token, which was sampled but never fed; or, for a
        `Restart`, a new part begun from its prompt); False when it is over (`finish`: its environment said so, or
        its turns, token budget or context are used up)."""
        if isinstance(obs, Restart):
            if self.turns >= max_turns:
                self.finish = "turns"
                return False
            if not obs.prompt or len(obs.prompt) + 1 >= max_len:
                self.finish = "length"
                return False
            self.restart(obs.prompt)
            return True
        used = len(self.tokens) + (len(obs) if obs is not None else 0)
        if obs is None:
            self.finish = "done"
        elif self.turns >= max_turns:
            self.finish = "turns"
        elif not obs or used + 1 > self.budget or len(self.prompt) + used + 1 >= max_len:
            self.finish = "length"
        else:
            self.cached = self.length - 1
            self.tokens += obs
            self.logprobs += [0.0] * len(obs)
            self.policy += [False] * len(obs)
            if self.versions:  # an observation is tagged with the version of the reply before it
                self.versions += [self.versions[-1]] * len(obs)
            self.turn_start = len(self.tokens)
            self.finish = None
            return True
        return False

    def restart(self, prompt: list[int]) -> None:
        """The episode's conversation was rewritten: what it holds so far becomes one of its `parts`, and it goes on
        from `prompt` in its slot, prefilled from position 0 (nothing of the old history is kept in the cache's
        use: the prefill overwrites it)."""
        self.parts.append({"prompt": self.prompt, "tokens": self.tokens, "logprobs": self.logprobs,
                           "policy": self.policy, "versions": self.versions, "routes": self.routes})
        self.prompt, self.tokens, self.logprobs, self.policy, self.versions = list(prompt), [], [], [], []
        self.routes, self.cached, self.turn_start, self.finish = RouteLog(), 0, 0, None

    def state(self) -> dict:
        """Everything this sequence is, as plain containers (what a checkpoint stores; `from_state` reads it). Only
        a live engine's sequences are stored, never an agent episode's (episodes run batch by batch): no parts."""
        if self.parts:
            raise ValueError("an episode split by a rewritten conversation is not stored mid-flight")
        out = {f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("params", "routes")}
        out["params"] = dataclasses.asdict(self.params)
        routes = self.routes.recorded()
        out["routes"] = None if routes is None else routes.clone()
        return out

    @classmethod
    def from_state(cls, state: dict) -> "Sequence":
        fields = dict(state)
        params = fields.pop("params")
        routes = fields.pop("routes")
        seq = cls(params=SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}),
                  **fields)
        if routes is not None:
            seq.routes.append(routes)
        return seq


@dataclass(frozen=True)
class Restart:
    """An answer to an episode's turn that begins a new part of it from `prompt` (an agent that rewrote its
    conversation: `agents/play.py`), instead of observation ids appended to its history."""

    prompt: list[int]


@dataclass(frozen=True)
class StopRule:
    """What ends a sequence (or an episode's turn) after it sampled `token`: "stop" at a stop token or string,
    "length" at the turn's `max_new_tokens`, the context's end or an episode's budget; None: it goes on."""

    max_len: int
    tokenizer: object = None  # decodes the tail for stop strings

    def __call__(self, seq: Sequence, token: int) -> Optional[str]:
        p = seq.params
        if token in p.stop_token_ids:
            return "stop"
        if p.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(seq.tokens[-16:])
            if any(s in tail for s in p.stop_strings):
                return "stop"
        if (len(seq.tokens) - seq.turn_start >= p.max_new_tokens or seq.length >= self.max_len
                or (seq.budget is not None and len(seq.tokens) >= seq.budget)):
            return "length"
        return None


@dataclass(frozen=True)
class Prefill:
    """What newly admitted sequences write into their cache slots before their first decode there: each one's
    history from position `cached` up to its last token, exclusive (that one is the decode's input), in one
    right-padded chunk. For a new sequence, its prompt but the last token; for an episode resuming its turn, its last
    reply token (sampled, never fed) and the observation but its last token. The one-stage generator and every
    pipeline stage build their prefills with this one rule."""

    tokens: torch.Tensor  # [n, width]
    positions: torch.Tensor  # [n, width]: row j from its sequence's `cached` on (padding clamped to the cache)
    slots: torch.Tensor  # [n]
    kv_len: int  # the cache prefix the chunk's attention reads

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def of(cls, admitted: list, max_len: int) -> Optional["Prefill"]:
        """The prefill of `admitted` (the generator's sequences) into a cache of `max_len` positions, on the host;
        None when none has anything to prefill (a one-token prompt)."""
        rows = [q for q in admitted if len(q.prompt) + len(q.tokens) - 1 > q.cached]
        if not rows:
            return None
        width = max(len(q.prompt) + len(q.tokens) - 1 - q.cached for q in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for j, q in enumerate(rows):
            chunk = q.history[q.cached:-1]
            tokens[j, : len(chunk)] = torch.tensor(chunk)
        # Padding sits at positions past its own row's tokens: decoding overwrites those cache entries before any
        # query attends to them (clamped to the cache: an episode resuming near its end pads at its last position).
        start = torch.tensor([q.cached for q in rows])
        positions = (start[:, None] + torch.arange(width)[None, :]).clamp_(max=max_len - 1)
        return cls(tokens, positions, torch.tensor([q.slot for q in rows]), min(int(start.max()) + width, max_len))

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "Prefill":
        """The same prefill with its tensors moved by `move` (to the device)."""
        return dataclasses.replace(self, tokens=move(self.tokens), positions=move(self.positions),
                                   slots=move(self.slots))
