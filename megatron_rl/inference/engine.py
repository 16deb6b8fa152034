"""The one-stage generator's request-level engine: add sequences, run one step, abort one; it owns who runs where.

`Engine` is the scheduler and runner of one generator replica (every rank of it runs the same engine on the same
sequences and takes the same decisions). Its state is four places a sequence can be: `waiting` for a cache slot,
`running` in one, `held` (an episode whose turn ended keeps its slot and cache while its environment answers), and
`resumed` (an episode whose observation was appended, to be prefilled into its own slot at the next step). Every
step:

1. resumed episodes run again; with a paged cache every running sequence gets the blocks for its next position, the
   one admitted last preempted where the cache runs out (back to the front of `waiting`, nothing cached);
2. waiting sequences take free slots (with a paged cache, where blocks remain for their history);
3. the sequences just admitted are prefilled (one right-padded chunk, `sequence.Prefill`), and one decode step runs
   for every running sequence (`decode_step.DecodeStep`, a CUDA graph where captured);
4. a decode step's tokens are appended (this step's, or with lookahead the previous step's, so the host reads step t
   while step t + 1 runs); a sequence that stops frees its slot and blocks at once, so a long tail does not idle the
   batch, or, an episode, holds its slot. `step` returns the sequences that ended there (whole sequences, or
   episodes' turns).

A client answers episodes between steps (`inference/episodes.py: EpisodeLoop`): `resume` an episode whose
observation it appended, `release` one that is over. `abort` ends a sequence wherever it is and frees what it
holds.

With a paged cache the host decides between steps which sequence holds which block, so nothing runs ahead (no
lookahead). A pipelined generator (pp > 1) has its own loop of lanes (`inference/pipeline.py`) over the same
`Sequence` and its rules.

Weights that change under running sequences (`rollout.in_flight`): with `version` set, every sampled token records
the weight version that sampled it (`Sequence.versions`). `switch(version, recompute)` lands new weights between two
steps; every sequence holding a slot keeps its slot, blocks and sampling stream, and either

- keeps its cache (the default, as PipelineRL and the others do): the positions fed before the switch hold keys and
  values the old weights wrote, and the tokens after it are sampled by the new weights attending to them. Each
  token's behaviour log-prob is that of the distribution it was drawn from, which the trainer's correction needs;
  a token after the switch is tagged with the new version, but its log-prob is the new weights' over a prefix
  cached by the old ones, which a trainer forward under either version does not reproduce exactly; or
- has its cache recomputed under the new weights (`recompute`: one prefill of each one's history), so from the
  switch on it decodes as a sequence prefilled under them: every token's log-prob is exactly its version's.

`snapshot` / `restore` carry the engine's sequences and decisions over a checkpoint as plain containers, not the
caches (a 405B replica's would be hundreds of GB): a restored engine's caches are filled by the next `switch`, which
must recompute; the job recomputes at the push right after every checkpoint (`Job.push_weights`), so the resumed
run's first push does exactly what the uninterrupted run's did there.
"""

from __future__ import annotations


from typing import Optional

import torch

from megatron_rl.inference.decode_step import DecodeStep, to_device
from megatron_rl.inference.kv_forward import IncrementalForward, PagedKVCache
from megatron_rl.inference.paging import BlockPool
from megatron_rl.inference.routes import RouteRecorder
from megatron_rl.inference.sequence import Prefill, Sequence, StopRule


class Engine:
    """The sequences of one replica over its cache (module docstring); `step` until `busy` is False."""

    def __init__(self, forward: IncrementalForward, step: DecodeStep, cache, routes: RouteRecorder,
                 stops: StopRule, device: torch.device, lookahead: bool, cuda_rules_on: bool):
        self.forward, self.decode, self.cache, self.routes, self.stops = forward, step, cache, routes, stops
        self.device, self.cuda_rules_on = device, cuda_rules_on
        self.pool = BlockPool(cache) if isinstance(cache, PagedKVCache) else None
        self.lookahead = lookahead and self.pool is None
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}  # slot -> a sequence decoding there (not known to have finished)
        self.held: dict[int, Sequence] = {}  # slot -> an episode waiting for its environment's answer
        self.resumed: list[Sequence] = []  # episodes to run again in their own slots at the next step
        self.free = list(range(cache.slots))
        self.steps = 0  # decode steps launched
        self.batched = 0  # sequences over the decode steps
        self.preempted = 0  # sequences preempted (paged cache)
        # Two host buffers (pinned on GPUs) for the tokens and log-probs of consecutive steps: step t's are read while
        # step t + 1 copies into the other one.
        self._pin = device.type == "cuda"
        self._host = [(torch.empty(cache.slots, dtype=torch.long, pin_memory=self._pin),
                       torch.empty(cache.slots, dtype=torch.float32, pin_memory=self._pin)) for _ in range(2)]
        self._in_flight = None  # a launched step not read yet (lookahead): `_launch`'s tuple
        self.version: Optional[int] = None  # the weights' version, recorded with every sampled token when set
        self.switched_tokens = 0  # cache positions recomputed at switches (`switch(recompute=True)`)
        self._cold = False  # restored: the caches are empty until the next `switch`

    @property
    def busy(self) -> bool:
        """Whether any sequence is still waiting, running, held or about to resume."""
        return bool(self.waiting or self.running or self._in_flight or self.held or self.resumed)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for a slot (admitted in order)."""
        self.waiting.append(seq)

    def add_ahead(self, seqs: list[Sequence]) -> None:
        """Queue sequences, in their order, ahead of every sequence waiting (a batch's refills, which the trainer
        waits for, before the next batch's prompts)."""
        self.waiting[:0] = seqs

    def step(self) -> list[Sequence]:
        """One engine step (module docstring); returns the sequences that ended in the step read here."""
        if self._cold:
            raise RuntimeError("a restored engine steps before a switch() recomputed its caches")
        admitted, self.resumed = self.resumed, []
        for seq in admitted:
            del self.held[seq.slot]
            self.running[seq.slot] = seq
        if self.pool is not None:
            self._grow(admitted)
        while (self.waiting and self.free
               and (self.pool is None or self.pool.admits(self.waiting[0].length, len(self.running)))):
            seq = self.waiting.pop(0)
            seq.slot = self.free.pop(0)
            seq.admitted_at = self.steps
            self.running[seq.slot] = seq
            admitted.append(seq)
            if self.pool is not None:
                self.pool.grow(seq.slot, seq.length)
        if not (self.running or self._in_flight or self.held):  # nothing runs and nothing could start: never spin
            raise RuntimeError(self._stuck())
        self.prefill(admitted)
        self.decode.admit(admitted)
        current = self._launch() if self.running else None
        if self.lookahead:
            done, self._in_flight = self._in_flight, current
        else:
            done = current
        return self._take(done) if done is not None else []

    def resume(self, seq: Sequence) -> None:
        """A held episode whose observation is appended (`Sequence.observe`): it runs again at the next step."""
        self.resumed.append(seq)

    def release(self, seq: Sequence) -> None:
        """A held episode that is over: its slot (and blocks) are free again."""
        del self.held[seq.slot]
        self._free(seq.slot)

    def abort(self, seq: Sequence) -> None:
        """End `seq` now (finish "abort"), wherever it is, freeing its slot and blocks. A step already launched with it
        (lookahead) is read as usual, its token for `seq` dropped."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.resumed:
            self.resumed.remove(seq)
            self.release(seq)
        elif self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self._free(seq.slot)
        elif self.held.get(seq.slot) is seq:
            self.release(seq)
        seq.finish = "abort"

    def drain(self) -> list[Sequence]:
        """Read the step launched ahead (lookahead), if any: the sequences it ended. Afterwards every running
        sequence's tokens are on the host."""
        done, self._in_flight = self._in_flight, None
        return self._take(done) if done is not None else []

    def switch(self, version: int, recompute: bool = False) -> list[Sequence]:
        """New weights are in the model (module docstring): the step launched ahead is read first; with `recompute`,
        the cache of every sequence in a slot is then recomputed under them, in slot order. Returns the sequences
        the read ended."""
        ended = self.drain()
        if self._cold and not recompute:
            raise RuntimeError("a restored engine's caches are empty: its first switch() must recompute them")
        self.version, self._cold = version, False
        if not recompute:
            return ended
        seqs = [q for _, q in sorted({**self.running, **self.held}.items())]
        for q in seqs:
            q.cached = 0
        chunk = Prefill.of(seqs, self.cache.max_len)
        if chunk is not None:
            c = chunk.to(lambda t: to_device(t, self.device, self.cuda_rules_on))
            # Routes are not recorded again: each position keeps the experts of the forward that sampled after it.
            self.forward(c.tokens, c.positions, c.slots, self.cache, kv_len=c.kv_len, logits=False)
            self.switched_tokens += sum(q.length - 1 for q in seqs)
        # The held episodes' slots too: a step over every slot feeds them (its results unread), writing at their
        # positions, which must lie past what their caches hold (a restored engine's step buffers say position 0).
        self.decode.admit(seqs)
        return ended

    def holds(self, seq: Sequence) -> bool:
        """Whether `seq` is still in the engine: waiting, in a slot (an episode held for its answer or about to
        resume, too)."""
        return (self.running.get(seq.slot) is seq or self.held.get(seq.slot) is seq
                or any(q is seq for q in self.waiting))

    def sequences(self) -> list[Sequence]:
        """Every sequence the engine holds (waiting, in a slot, or about to resume)."""
        return [*self.waiting, *self.running.values(), *self.held.values()]

    def snapshot(self, index: dict) -> dict:
        """The engine's scheduling state as plain containers, after `drain`, each sequence named by its number in
        `index` (id(sequence) -> int; the caller stores the sequences themselves, `Sequence.state`): what `restore`
        needs to go on exactly where this engine is."""
        assert self._in_flight is None, "drain() before snapshot()"
        pool = None
        if self.pool is not None:
            pool = {"free": list(self.pool.free), "held": {int(k): list(v) for k, v in self.pool.held.items()},
                    "peak": self.pool.peak}
        return {"waiting": [index[id(q)] for q in self.waiting],
                "running": [[slot, index[id(q)]] for slot, q in self.running.items()],
                "held": [[slot, index[id(q)]] for slot, q in self.held.items()],
                "resumed": [index[id(q)] for q in self.resumed], "free": list(self.free), "pool": pool,
                "version": self.version, "steps": self.steps, "batched": self.batched, "preempted": self.preempted}

    def restore(self, state: dict, seqs: list[Sequence]) -> None:
        """Go on from a `snapshot` (of an engine over a cache of the same shape), its sequences numbered as in
        `seqs`, with every cache empty until the next `switch` recomputes it."""
        if self.busy:
            raise RuntimeError("restore() into an engine that holds sequences")
        slots = len(state["free"]) + len(state["running"]) + len(state["held"])
        if slots != self.cache.slots or (self.pool is None) != (state["pool"] is None):
            raise ValueError("the saved generator state is of another cache (generator.max_batch_size or "
                             "generator.kv_cache_tokens changed): resume with the settings it was saved with")
        self.waiting = [seqs[i] for i in state["waiting"]]
        self.running = {int(slot): seqs[i] for slot, i in state["running"]}
        self.held = {int(slot): seqs[i] for slot, i in state["held"]}
        self.resumed = [seqs[i] for i in state["resumed"]]
        self.free = list(state["free"])
        self.version, self.steps = state["version"], state["steps"]
        self.batched, self.preempted = state["batched"], state["preempted"]
        if self.pool is not None:
            self.pool.restore(state["pool"])
        for q in (*self.running.values(), *self.held.values()):
            q.cached = 0
        self._cold = True

    def stats(self) -> dict:
        """The decode batch size over this engine's steps and the fraction of slot-steps it occupied; with a paged
        cache, its blocks' use and preemptions."""
        slot_steps = self.steps * self.cache.slots
        out = {"mean_batch": self.batched / max(self.steps, 1), "slot_steps": slot_steps,
               "occupancy": self.batched / max(slot_steps, 1)}  # occupied slot-steps
        if self.pool is not None:
            out.update(kv_blocks_peak=self.pool.peak, kv_blocks=self.cache.blocks, preempted=self.preempted)
        return out

    def prefill(self, admitted: list[Sequence]) -> None:
        """Fill the cache of newly admitted sequences (`Prefill`: a new sequence's prompt but its last token; an
        episode's turn that resumes, its last reply token and the observation but its last token)."""
        chunk = Prefill.of(admitted, self.cache.max_len)
        if chunk is None:
            return
        # kv_len given: no device-to-host read, so a step launched ahead keeps running meanwhile.
        c = chunk.to(lambda t: to_device(t, self.device, self.cuda_rules_on))
        self.forward(c.tokens, c.positions, c.slots, self.cache, kv_len=c.kv_len, logits=False)
        routes = self.routes.take()
        if routes is not None:
            self.routes.prefilled(admitted, routes)

    def _launch(self):
        """Launch one decode step for the running slots and start copying its results to the host: (tokens,
        log-probs, ready event or None, {slot: sequence} at launch, routes or None, the weights' version)."""
        self.batched += len(self.running)
        tokens, logprobs, routes = self.decode(sorted(self.running))
        parity = self.steps % 2
        toks_h, lps_h = self._host[parity]
        routes_h = self.routes.to_host(routes, parity, self._pin)
        self.steps += 1
        toks_h.copy_(tokens, non_blocking=True)
        lps_h.copy_(logprobs, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return toks_h, lps_h, ready, dict(self.running), routes_h, self.version

    def _take(self, done) -> list[Sequence]:
        """Append a finished step's tokens to its sequences; a sequence that stops frees its slot (and its cache
        blocks), or, an episode, holds it. Returns the sequences that ended."""
        toks_h, lps_h, ready, slots, routes_h, version = done
        if ready is not None:
            ready.synchronize()
        tokens, logprobs = toks_h.tolist(), lps_h.tolist()
        ended = []
        for slot, s in slots.items():
            if s.finish is not None:  # ended (or aborted) before: this step ran ahead for nothing
                continue
            if routes_h is not None:  # the routes of the token this step fed (its last, at len(history) - 1)
                s.routes.append(routes_h[slot][None])
            if s.append(tokens[slot], logprobs[slot], self.stops, version):
                del self.running[slot]
                if s.episode:
                    self.held[slot] = s
                else:
                    self._free(slot)
                ended.append(s)
        return ended

    def _free(self, slot: int) -> None:
        self.free.append(slot)
        if self.pool is not None:
            self.pool.release(slot)

    def _grow(self, resumed: list[Sequence]) -> None:
        """Give every running sequence the blocks for its next decode position (and a resumed episode those of its
        observation); where the cache runs out, preempt the sequence admitted last (its blocks freed, its slot too,
        back to the front of `waiting` with nothing cached)."""
        pool = self.pool
        while sum(pool.missing(slot, q.length) for slot, q in self.running.items()) > len(pool.free):
            if len(self.running) == 1 and set(pool.held) <= set(self.running):  # alone in the cache, still too long
                (q,) = self.running.values()
                raise RuntimeError(f"a sequence of {q.length} tokens does not fit the paged KV cache of "
                                   f"{pool.cache.blocks * pool.block_size} tokens (generator.kv_cache_tokens)")
            # (Alone but beside episodes that hold blocks while their environments answer: it waits for them.)
            slot, victim = max(self.running.items(), key=lambda item: item[1].admitted_at)
            del self.running[slot]
            if victim in resumed:
                resumed.remove(victim)
            self._free(slot)
            victim.cached, victim.slot = 0, -1
            self.waiting.insert(0, victim)
            self.preempted += 1
        for slot, q in self.running.items():
            pool.grow(slot, q.length)

    def _stuck(self) -> str:
        """Why no sequence can start although some wait (the error `step` raises instead of spinning)."""
        first = self.waiting[0]
        if self.pool is not None and not self.pool.fits(first.length):
            return (f"a sequence of {first.length} tokens does not fit the paged KV cache of "
                    f"{self.cache.blocks * self.pool.block_size} tokens (generator.kv_cache_tokens)")
        return f"{len(self.waiting)} sequences wait for a cache of {self.cache.slots} slots"
