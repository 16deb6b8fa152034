"""Pipeline-parallel decoding for one generator replica (generator.pp > 1): each stage holds its layers, and the KV
cache of those layers only.

The replica's cache slots are split into `pp` lanes (micro-batches of sequences). Time advances in ticks; at tick t
stage s runs lane (t - s) mod pp: the prefill of the lane's newly admitted sequences, if any, then one decode token
for every slot of the lane. At the end of the tick each rank makes one `batch_isend_irecv`: its output activations
to stage s + 1 and, from stage s - 1, what that stage produced in the same tick (pairing each send with its receive
in one call, as Megatron-Core's schedules do, is what keeps NCCL from deadlocking). The last stage gathers
the vocabulary over TP and samples; then its tokens and log-probs are broadcast over the pipeline group, and every
rank (every stage and TP rank) applies them with the one-stage generator's bookkeeping: stop checks, freed slots,
waiting sequences admitted into the lane, the lane's next inputs. All ranks therefore agree on which slots run, and
every rank ends with the outputs, the replica's leader (stage 0, TP rank 0) among them.

Why pp lanes: a lane's next token needs its previous one, which exists only once the last stage has run, so a lane
is back at the first stage pp ticks after it left it. With pp lanes every stage runs a lane at every tick in steady
state; with fewer some stage idles each tick (one lane: one stage busy at a time); with more, a stage still runs one
lane per tick and each lane is smaller, so it reads its weights more often per token.

Sampling is `sampling.sample` over the lane's slots with each sequence's own (seed, step), so tokens depend neither
on lanes, slots nor stages: they are the one-stage generator's, up to the fp32 rounding of differently batched
matmuls. Decoding here is eager and reads every tick's tokens on the host (no CUDA graph, no lookahead).

Episodes (`turns`, `inference/episodes.py`) follow the `Turns` contract with a lane's round in place of a decode
iteration: the turns that end in a round are handed to `turns.start` when the round comes back from the last stage
(on every rank, at the same tick), and their episodes keep their slots and caches in the lane ("held": a held slot
is fed its last reply token, its result unread, which writes the cache entry its prefill will write again) while the
others decode. Their observations enter the lane's next round, pp ticks later: its prefill writes the last reply
token and the observation but its last token at their positions (`Prefill`: the one-stage generator's rule), and the
observation's last token is the round's decode input. `Turns` has one start outstanding at a time (`EpisodeTurns`
runs one thread of environment calls), so the outstanding one is finished as late as that allows: before the next
start (the next round in which turns end, of any lane), or before its own lane sets up the round its observations
enter. Either way they enter that same round, so which sequences share a round, and every token, depend on the
requests, seeds and environments only, never on how long an environment took; finishing late only gives the
environments more ticks to answer. The loop ends once no lane runs or holds a sequence, so no start is left
outstanding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_rules
from megatron_rl.inference.episodes import Turns
from megatron_rl.inference.kv_forward import IncrementalForward, KVCache
from megatron_rl.inference.sampling import sample
from megatron_rl.inference.sequence import Prefill, StopRule


@dataclass(frozen=True)
class _Round:
    """What every stage runs for one lane to advance each of its sequences by one token (built alike on every rank)."""

    prefill: Optional[Prefill]
    tokens: torch.Tensor  # [slots] each slot's input token (a free or held slot's result is ignored)
    positions: torch.Tensor  # [slots]
    kv_len: int  # the furthest position + 1: the cache prefix attention reads
    seqs: dict  # slot -> the sequence decoding there (not a held episode's)


@dataclass
class _Lane:
    cache: KVCache  # a view of the replica's cache: this lane's slots
    free: list[int]
    running: dict = field(default_factory=dict)  # slot -> running sequence
    # Episodes: slot -> an episode whose turn ended, holding its slot and cache until it resumes or is over; and the
    # held ones whose observations have been appended, which enter the lane's next round.
    held: dict = field(default_factory=dict)
    resumed: list = field(default_factory=list)
    work: Optional[_Round] = None  # the round under way; None while nothing in the lane decodes


@dataclass
class _StageOutput:
    """Activations stage s hands to stage s + 1 for one lane's round: [width, n, h] and [1, slots, h]."""

    prefill: Optional[torch.Tensor]
    decode: torch.Tensor


def _split(slots: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, stop) ranges of `slots` over `parts` lanes (some empty if slots < parts)."""
    bounds = [slots * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class PipelinedDecode:
    """The decode loop of a pipeline stage; every rank of the replica runs `run` with the same sequences."""

    def __init__(self, forward: IncrementalForward, pp_group, full_logits: Callable[[torch.Tensor], torch.Tensor],
                 stops: StopRule):
        self.forward, self.pp_group, self.full_logits = forward, pp_group, full_logits  # full_logits: the TP gather
        self.stops = stops  # what ends a sequence or a turn: the one-stage engine's rule (`inference/sequence.py`)
        self.stage, self.stages = pp_group.rank(), pp_group.size()
        self.last = forward.model.post_process
        self.hidden_size = forward.model.config.hidden_size
        self.dtype = forward.dtype  # of the activations between stages

    def run(self, pending: list, cache: KVCache, device, filtering: bool, noise: bool,
            turns: Optional[Turns] = None) -> None:
        """Decode `pending` (the generator's sequences; episodes with `turns`) to the end, filling in their tokens,
        log-probs, finish."""
        self._check_agreement(len(pending), cache.slots, device)
        pp, s = self.stages, self.stage
        lanes = [_Lane(KVCache(cache.keys[:, a:b], cache.values[:, a:b]), list(range(b - a)))
                 for a, b in _split(cache.slots, pp)]
        waiting = list(pending)
        for lane in lanes:
            self._next_round(lane, waiting, device)
        inbox: dict[int, _StageOutput] = {}  # lane -> the previous stage's activations for its round
        asked = None  # the outstanding `turns.start`: (its lane, its episodes), all held in that lane
        t = 0
        while any(lane.work is not None or lane.held for lane in lanes):
            m = (t - s) % pp
            work = lanes[m].work if t >= s else None
            out = None
            if work is not None:
                out = self._run_stage(work, lanes[m].cache, inbox.pop(m, None), device, filtering, noise)
            # What the previous stage ran this tick: lane (t - (s - 1)) mod pp.
            m_in = (t - s + 1) % pp
            incoming = lanes[m_in].work if s > 0 and t >= s - 1 else None
            received = self._exchange(out if not self.last else None, incoming, device)
            if received is not None:
                inbox[m_in] = received
            # The last stage ran lane (t - (pp - 1)) mod pp this tick: its tokens go to every stage. (A lane whose
            # sequences all wait for their environments has no round, and sets up its next one here all the same.)
            m_out = (t - pp + 1) % pp
            if t >= pp - 1:
                ended = []
                if lanes[m_out].work is not None:
                    tokens, logprobs = self._broadcast(out if self.last else None, lanes[m_out].cache.slots, device)
                    ended = self._finish_round(lanes[m_out], tokens, logprobs, turns is not None)
                asked = self._converse(lanes, m_out, ended, asked, turns)
                self._next_round(lanes[m_out], waiting, device)
            t += 1

    def _check_agreement(self, sequences: int, slots: int, device) -> None:
        """Every stage must run the same sequences over the same slots, or the schedule deadlocks: check first
        (every rank sees every rank's numbers and raises alike)."""
        mine = torch.tensor([sequences, slots], dtype=torch.long, device=device)
        seen = [torch.empty_like(mine) for _ in range(self.stages)]
        dist.all_gather(seen, mine, group=self.pp_group)
        if any(not torch.equal(x, seen[0]) for x in seen):
            got = ", ".join(f"stage {i}: {x[0]} sequences in {x[1]} slots" for i, x in enumerate(seen))
            raise RuntimeError(f"the pipeline stages of a generator replica were given different work ({got})")

    def _next_round(self, lane: _Lane, waiting: list, device) -> None:
        """Set up the lane's next round (None: nothing to decode): the held episodes whose observations came resume
        in their own slots, waiting sequences take its free slots, and both are prefilled."""
        admitted, lane.resumed = lane.resumed, []
        for seq in admitted:
            del lane.held[seq.slot]
            lane.running[seq.slot] = seq
        while waiting and lane.free:
            seq = waiting.pop(0)
            seq.slot = lane.free.pop(0)
            lane.running[seq.slot] = seq
            admitted.append(seq)
        if not lane.running:
            lane.work = None
            return
        # Each slot's input token and its position: a free slot's (0 at 0) is overwritten by its next prefill; a
        # held episode's is its last reply token, at the position where its resumption's prefill starts.
        tokens, positions = [0] * lane.cache.slots, [0] * lane.cache.slots
        for slot, seq in (*lane.running.items(), *lane.held.items()):
            tokens[slot] = seq.last
            positions[slot] = len(seq.prompt) + len(seq.tokens) - 1
        prefill = Prefill.of(admitted, lane.cache.max_len)
        lane.work = _Round(prefill.to(lambda x: x.to(device)) if prefill is not None else None,
                           torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                           max(positions) + 1, dict(lane.running))

    def _converse(self, lanes: list[_Lane], m: int, ended: list, asked: Optional[tuple[int, list]],
                  turns: Optional[Turns]) -> Optional[tuple[int, list]]:
        """Lane m's round has come back, and its turns `ended` (held in the lane): finish the outstanding start
        `asked` if these must be started or lane m sets up the round its observations enter (module docstring),
        then start these. Returns the start now outstanding."""
        if asked is not None and (ended or asked[0] == m):
            lane, episodes = lanes[asked[0]], asked[1]
            for seq, obs in zip(episodes, turns.finish(), strict=True):
                if seq.observe(obs, turns.max_turns, self.stops.max_len):
                    lane.resumed.append(seq)
                else:
                    lane.free.append(seq.slot)
                    turns.closed(seq.req, seq.finish)
            for seq in episodes:
                if seq.finish is not None:  # over: its slot is free again
                    del lane.held[seq.slot]
            asked = None
        if ended:
            turns.start([seq.ended_turn() for seq in ended])
            asked = (m, ended)
        return asked

    def _run_stage(self, work: _Round, cache: KVCache, received: Optional[_StageOutput], device, filtering: bool,
                   noise: bool):
        """This stage's part of a lane's round: activations for the next stage, or (tokens, log-probs) [slots] on
        the last."""
        fwd = self.forward
        prefill = None
        if work.prefill is not None:
            c = work.prefill
            prefill = fwd(c.tokens, c.positions, c.slots, cache, kv_len=c.kv_len, logits=False,
                          hidden=received.prefill if received is not None else None)
        b = work.tokens.shape[0]
        # Pipelined decoding is eager; in the CUDA-rules mode the stage's decode step is still held to what a CUDA
        # graph capture allows, so that it stays capturable.
        capturable = (cuda_rules.CaptureChecker("the pipelined decode step") if device.type != "cuda"
                      and self.forward.cuda_rules_on else contextlib.nullcontext())
        with capturable:
            out = fwd(work.tokens[:, None], work.positions[:, None], torch.arange(b, device=device), cache,
                      kv_len=work.kv_len, all_slots=True, hidden=received.decode if received is not None else None)
        if not self.last:
            return _StageOutput(prefill, out)
        # Per slot: temperature, top_p, top_k, seed and step (the tokens it sampled so far: an episode's stream goes
        # on across its turns); a free or held slot samples greedily.
        rows = [(q.params.temperature, q.params.top_p, q.params.top_k, q.seed, q.sampled)
                if (q := work.seqs.get(slot)) is not None else (0.0, 1.0, 0, 0, 0) for slot in range(b)]
        temperature, top_p, top_k, seeds, steps = (
            torch.tensor(col, dtype=dtype, device=device)
            for col, dtype in zip(zip(*rows), (torch.float32, torch.float32, torch.long, torch.long, torch.long)))
        with capturable:
            return sample(self.full_logits(out[:, 0]), temperature, top_p, top_k, seeds, steps, filtering, noise)

    def _exchange(self, out: Optional[_StageOutput], incoming: Optional[_Round], device) -> Optional[_StageOutput]:
        """Send this tick's activations on and receive the previous stage's (shapes from the round, known alike on
        every rank), in one batch."""
        ops = []
        if out is not None:
            for x in (out.prefill, out.decode):
                if x is not None:
                    ops.append(dist.P2POp(dist.isend, x.to(self.dtype).contiguous(), group=self.pp_group,
                                          group_peer=self.stage + 1))
        received = None
        if incoming is not None:
            empty = lambda *shape: torch.empty(*shape, self.hidden_size, dtype=self.dtype, device=device)  # noqa: E731
            p = incoming.prefill
            received = _StageOutput(empty(p.width, p.tokens.shape[0]) if p is not None else None,
                                    empty(1, incoming.tokens.shape[0]))
            for x in (received.prefill, received.decode):
                if x is not None:
                    ops.append(dist.P2POp(dist.irecv, x, group=self.pp_group, group_peer=self.stage - 1))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def _broadcast(self, sampled, slots: int, device) -> tuple[list[int], list[float]]:
        """The last stage's tokens and log-probs of one lane, on every stage."""
        if sampled is not None:
            tokens, logprobs = (x.contiguous() for x in sampled)
        else:
            tokens = torch.empty(slots, dtype=torch.long, device=device)
            logprobs = torch.empty(slots, dtype=torch.float32, device=device)
        last = self.stages - 1
        dist.broadcast(tokens, group=self.pp_group, group_src=last)
        dist.broadcast(logprobs, group=self.pp_group, group_src=last)
        return tokens.tolist(), logprobs.tolist()

    def _finish_round(self, lane: _Lane, tokens: list[int], logprobs: list[float], episodes: bool) -> list:
        """Append the round's tokens to its sequences; one that stops frees its slot or, an episode, holds it: those
        are returned (their turn has ended)."""
        ended = []
        for slot, seq in lane.work.seqs.items():
            if seq.append(tokens[slot], logprobs[slot], self.stops):
                del lane.running[slot]
                if episodes:
                    lane.held[slot] = seq
                    ended.append(seq)
                else:
                    lane.free.append(slot)
        return ended
