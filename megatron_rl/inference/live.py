"""A generator replica's engine kept across batches, with weights that change under its running sequences
(`rollout.in_flight`).

`Generator.generate` builds an engine, runs one batch to its last sequence and drops it: slots idle while the batch
drains to its longest sequence, and new weights wait for the batch's end. `LiveGeneration` keeps one engine over one
cache for the whole run: a client `add`s requests whenever it has them (the next batch's prompts while the current
batch drains: its sequences take the slots that free up), `run`s until the sequences it names have finished (the
others go on running, and stay in their slots), and `switch`es to new weights between two steps, each running
sequence's cache kept or recomputed under them (`Engine.switch`). Every token records the weight version that
sampled it (`SampledResponse.versions`).

`snapshot` / `restore` carry the whole state across a checkpoint: every sequence a client still holds (running,
waiting, or finished but not yet taken), the engine's slots, blocks and counters, as plain containers that
`torch.load(weights_only=True)` reads. A restored engine has empty caches; the next `switch` (the resumed run's
first weight push) recomputes them, as the uninterrupted engine's `switch` at the same point did (the job recomputes
at the push after every checkpoint), so a killed run resumes to the same tokens.

Episodes (`env.cls`) run in it too: each batch's `Turns` is `join`ed into one that answers every batch's turns that
end at a step with one `start` (`Turns.empty`/`join`), and the engine's steps keep `Turns`' timing contract
(`inference/episodes.py`) across batches and across `run` calls, the steps counted over them: a turn that ended at
the last step of a `run` is answered `answer_steps` steps into the next one, the environment working meanwhile
(beside the trainer's step). A snapshot holds the outstanding starts, each with its episodes and the steps it has
left; a restored engine starts those calls again (`Turns.resume`; an environment is deterministic given its
replies). An episode's observation tokens carry the version of the reply
before them.

On a generator of one pipeline stage: pipelined decoding runs batch by batch (`Generator.generate`), and so do
agents (`env.agent`).
"""

from __future__ import annotations

import time
from typing import Optional

from megatron_rl.inference.episodes import EpisodeLoop, Turns
from megatron_rl.inference.generator import Generator
from megatron_rl.inference.sequence import GenerationRequest, SampledResponse, Sequence


class LiveGeneration:
    """One replica's live engine (module docstring). Every rank of the replica makes the same calls."""

    def __init__(self, gen: Generator, max_len: int, *, filtering: bool, noise: bool, version: int):
        if gen.pipeline is not None:
            raise ValueError("a live generator (rollout.in_flight) needs generator.pp=1")
        self.gen = gen
        self.cache = gen._cache_for(gen.max_batch_size, gen.cache_length(max_len))
        self.engine = gen.engine(self.cache, filtering, noise)
        self.engine.version = version
        gen.live = self
        self._n = 0  # handles added so far (a sequence's `req` is its handle's number: unique over the run)
        self.episodes: Optional[EpisodeLoop] = None  # with episodes: the loop over every joined batch's `Turns`
        self._ended: list[Sequence] = []  # episodes whose turns ended in a step read outside `run` (lookahead)
        self._resumed: Optional[list] = None  # restored: the outstanding starts (`EpisodeLoop.answering`), to redo

    def add(self, requests: list[GenerationRequest], turns: Optional[Turns] = None, ahead: bool = False) -> list:
        """Queue the requests' samples (with `turns`, episodes), behind the sequences waiting or, `ahead`, in front
        of them; returns their handles (n per request), for `run`."""
        handles = self.gen.sequences(requests, turns)
        first, self._n = self._n, self._n + len(handles)
        seqs = [h for h in handles if isinstance(h, Sequence)]
        for k, h in enumerate(handles):
            if isinstance(h, Sequence):
                h.req = first + k
        if ahead:
            self.engine.add_ahead(seqs)
        else:
            for h in seqs:
                self.engine.add(h)
        if turns is not None:
            self._join(turns, [h.req if isinstance(h, Sequence) else None for h in handles])
        return handles

    def rejoin(self, handles: list, turns: Turns) -> None:
        """After `restore`: the restored `handles`' episodes are played by `turns` (the batch's, as the checkpoint
        saved them), those still in the engine."""
        self._join(turns, [h.req if isinstance(h, Sequence) and self.engine.holds(h) else None for h in handles])

    def _join(self, turns: Turns, requests: list) -> None:
        if self.episodes is None:
            self.episodes = EpisodeLoop(turns.empty(), self.gen.max_len)
        self.episodes.turns.join(turns, requests)

    def _over(self, s: Sequence) -> bool:
        return s.finish is not None and not self.engine.holds(s)

    def run(self, handles: list) -> list[SampledResponse]:
        """Step the engine until every sequence of `handles` has finished (other sequences step with them and may
        stay in the engine, an episode's answer outstanding); their outputs, in order. Nothing is left launched
        ahead when it returns."""
        t0, steps, batched = time.perf_counter(), self.engine.steps, self.engine.batched
        mine = [h for h in handles if isinstance(h, Sequence)]
        with self.gen.decoding(self.cache):
            if self._resumed is not None:  # the restored answers, started again before the first step
                if self.episodes is None:
                    raise RuntimeError("a restored live engine with episodes runs before rejoin() gave it their turns")
                self.episodes.answering, self._resumed = self._resumed, None
                for _, seqs in self.episodes.answering:
                    self.episodes.turns.resume([q.ended_turn() for q in seqs])
            while not all(self._over(s) for s in mine):
                ended, self._ended = self._ended + self.engine.step(), []
                if self.episodes is not None:
                    self.episodes.after_step(self.engine, ended)
            self._held(self.engine.drain())
        steps = self.engine.steps - steps
        # (None over no step: every sequence of `handles` had finished while an earlier batch ran.)
        batched, slot_steps = self.engine.batched - batched, steps * self.cache.slots
        stats = {"mean_batch": batched / max(steps, 1), "slot_steps": slot_steps,
                 "occupancy": batched / slot_steps if steps else None}
        self.gen.stats = self.gen.run_stats(sum(s.sampled for s in mine), time.perf_counter() - t0, stats)
        return [self.gen.response(h) if isinstance(h, Sequence) else h for h in handles]

    def _held(self, ended: list[Sequence]) -> None:
        """Episodes whose turns ended in a step read between two `run`s: handed to `start` at the next step."""
        self._ended += [s for s in ended if s.episode]

    def switch(self, version: int, recompute: bool = False) -> None:
        """New weights are in the model: the running sequences go on under them, their caches kept or recomputed
        (`Engine.switch`)."""
        with self.gen.decoding(self.cache):
            self._held(self.engine.switch(version, recompute))

    def snapshot(self, groups: dict) -> dict:
        """Plain containers for `restore`: `groups` (the client's name -> handles, say a batch's) and the engine."""
        seqs: list[Sequence] = []
        index: dict = {}
        for q in [h for hs in groups.values() for h in hs if isinstance(h, Sequence)] + self.engine.sequences():
            if id(q) not in index:
                index[id(q)] = len(seqs)
                seqs.append(q)
        encode = lambda h: index[id(h)] if isinstance(h, Sequence) else _response_state(h)  # noqa: E731
        answering = self._resumed if self._resumed is not None else (self.episodes.answering if self.episodes else [])
        return {"sequences": [q.state() for q in seqs], "added": self._n, "engine": self.engine.snapshot(index),
                "groups": {k: [encode(h) for h in hs] for k, hs in groups.items()},
                "answering": [[left, [index[id(q)] for q in seqs]] for left, seqs in answering],
                "ended": [index[id(q)] for q in self._ended]}

    def restore(self, state: dict) -> dict:
        """Go on from a `snapshot`: returns its groups, with handles to the restored sequences."""
        seqs = [Sequence.from_state(d) for d in state["sequences"]]
        self.engine.restore(state["engine"], seqs)
        self._n = state["added"]
        self._ended = [seqs[i] for i in state.get("ended", [])]
        answering = state.get("answering", [])
        if answering and isinstance(answering[0], int):  # saved before env.answer_steps: one start, due next
            answering = [[1, answering]]
        self._resumed = [[left, [seqs[i] for i in ix]] for left, ix in answering] or None
        decode = lambda h: seqs[h] if isinstance(h, int) else SampledResponse(**h)  # noqa: E731
        return {k: [decode(h) for h in hs] for k, hs in state["groups"].items()}


def _response_state(r: SampledResponse) -> dict:
    """A bad request's "error" response as plain containers."""
    return {"request_id": r.request_id, "sample_index": r.sample_index, "prompt_ids": list(r.prompt_ids),
            "token_ids": [], "logprobs": [], "finish_reason": r.finish_reason, "error": r.error}
