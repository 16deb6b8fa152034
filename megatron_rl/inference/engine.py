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
holds. With a paged cache the host decides between steps which sequence holds which block, so nothing runs ahead
(no lookahead). A pipelined generator (pp > 1) has its own loop of lanes (`inference/pipeline.py`) over the same
`Sequence` and its rules.
"""

from __future__ import annotations


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

    @property
    def busy(self) -> bool:
        """Whether any sequence is still waiting, running, held or about to resume."""
        return bool(self.waiting or self.running or self._in_flight or self.held or self.resumed)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for a slot (admitted in order)."""
        self.waiting.append(seq)

    def step(self) -> list[Sequence]:
        """One engine step (module docstring); returns the sequences that ended in the step read here."""
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

    def stats(self) -> dict:
        """The decode batch size over this engine's steps; with a paged cache, its blocks' use and preemptions."""
        out = {"mean_batch": self.batched / max(self.steps, 1)}
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
        log-probs, ready event or None, {slot: sequence} at launch, routes or None)."""
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
        return toks_h, lps_h, ready, dict(self.running), routes_h

    def _take(self, done) -> list[Sequence]:
        """Append a finished step's tokens to its sequences; a sequence that stops frees its slot (and its cache
        blocks), or, an episode, holds it. Returns the sequences that ended."""
        toks_h, lps_h, ready, slots, routes_h = done
        if ready is not None:
            ready.synchronize()
        tokens, logprobs = toks_h.tolist(), lps_h.tolist()
        ended = []
        for slot, s in slots.items():
            if s.finish is not None:  # ended (or aborted) before: this step ran ahead for nothing
                continue
            if routes_h is not None:  # the routes of the token this step fed (its last, at len(history) - 1)
                s.routes.append(routes_h[slot][None])
            if s.append(tokens[slot], logprobs[slot], self.stops):
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
