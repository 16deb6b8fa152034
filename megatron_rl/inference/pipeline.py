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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_rules
from megatron_rl.inference.kv_forward import IncrementalForward, KVCache
from megatron_rl.inference.sampling import sample


@dataclass(frozen=True)
class _Chunk:
    """Prompts of newly admitted sequences but their last token, right-padded: tokens, positions [n, width]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor  # [n], in the lane

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class _Round:
    """What every stage runs for one lane to advance each of its sequences by one token (built alike on every rank)."""

    prefill: Optional[_Chunk]
    tokens: torch.Tensor  # [slots] each slot's input token (0 in a free slot: its result is ignored)
    positions: torch.Tensor  # [slots]
    kv_len: int  # the furthest position + 1: the cache prefix attention reads
    seqs: dict  # slot -> the sequence running there


@dataclass
class _Lane:
    cache: KVCache  # a view of the replica's cache: this lane's slots
    free: list[int]
    running: dict = field(default_factory=dict)  # slot -> running sequence
    work: Optional[_Round] = None  # the round under way; None once the lane has nothing left to run


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
                 stopped: Callable):
        self.forward, self.pp_group = forward, pp_group
        self.full_logits, self.stopped = full_logits, stopped  # the generator's TP gather and stop rule
        self.stage, self.stages = pp_group.rank(), pp_group.size()
        self.last = forward.model.post_process
        self.hidden_size = forward.model.config.hidden_size
        self.dtype = forward.dtype  # of the activations between stages

    def run(self, pending: list, cache: KVCache, device, filtering: bool, noise: bool) -> None:
        """Decode `pending` (the generator's sequences) to the end, filling in their tokens, log-probs, finish."""
        self._check_agreement(len(pending), cache.slots, device)
        pp, s = self.stages, self.stage
        lanes = [_Lane(KVCache(cache.keys[:, a:b], cache.values[:, a:b]), list(range(b - a)))
                 for a, b in _split(cache.slots, pp)]
        waiting = list(pending)
        for lane in lanes:
            self._next_round(lane, waiting, device)
        inbox: dict[int, _StageOutput] = {}  # lane -> the previous stage's activations for its round
        t = 0
        while any(lane.work is not None for lane in lanes):
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
            # The last stage ran lane (t - (pp - 1)) mod pp this tick: its tokens go to every stage.
            m_out = (t - pp + 1) % pp
            if t >= pp - 1 and lanes[m_out].work is not None:
                tokens, logprobs = self._broadcast(out if self.last else None, lanes[m_out].cache.slots, device)
                self._finish_round(lanes[m_out], tokens, logprobs)
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
        """Admit waiting sequences into the lane's free slots and set up its next round (None: the lane is done)."""
        admitted = []
        while waiting and lane.free:
            seq = waiting.pop(0)
            seq.slot = lane.free.pop(0)
            lane.running[seq.slot] = seq
            admitted.append(seq)
        if not lane.running:
            lane.work = None
            return
        tokens, positions = [0] * lane.cache.slots, [0] * lane.cache.slots
        for slot, seq in lane.running.items():
            tokens[slot] = seq.tokens[-1] if seq.tokens else seq.prompt[-1]
            positions[slot] = len(seq.prompt) + len(seq.tokens) - 1
        prefill = None
        chunk = [q for q in admitted if len(q.prompt) > 1]
        if chunk:
            width = max(len(q.prompt) - 1 for q in chunk)
            toks = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, q in enumerate(chunk):
                toks[j, : len(q.prompt) - 1] = torch.tensor(q.prompt[:-1])
            # Padding sits past each prompt: the decode writes those cache entries before anything reads them.
            pos = torch.arange(width).expand(len(chunk), width)
            prefill = _Chunk(toks.to(device), pos.to(device), torch.tensor([q.slot for q in chunk], device=device))
        lane.work = _Round(prefill, torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                           max(positions) + 1, dict(lane.running))

    def _run_stage(self, work: _Round, cache: KVCache, received: Optional[_StageOutput], device, filtering: bool,
                   noise: bool):
        """This stage's part of a lane's round: activations for the next stage, or (tokens, log-probs) [slots] on
        the last."""
        fwd = self.forward
        prefill = None
        if work.prefill is not None:
            c = work.prefill
            prefill = fwd(c.tokens, c.positions, c.slots, cache, kv_len=c.width, logits=False,
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
        # Per slot: temperature, top_p, top_k, seed and step (the tokens drawn so far); a free slot samples greedily.
        rows = [(q.params.temperature, q.params.top_p, q.params.top_k, q.seed, len(q.tokens))
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

    def _finish_round(self, lane: _Lane, tokens: list[int], logprobs: list[float]) -> None:
        for slot, seq in lane.work.seqs.items():
            seq.tokens.append(tokens[slot])
            seq.logprobs.append(logprobs[slot])
            seq.finish = self.stopped(seq, tokens[slot])
            if seq.finish is not None:
                del lane.running[slot]
                lane.free.append(slot)
