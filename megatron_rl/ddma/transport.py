"""DDMA transport: execute a reshard plan with point-to-point messages, in place, with bounded staging.

Every participating rank runs `execute_plan` with the same plan and settings:

1. Handshake (`ddma.handshake`): one small message each way between every pair of ranks that exchange weights,
   carrying readiness (a rank whose parameters do not fit the plan says so, and its peers raise instead of waiting
   for slices that will never come), the trainer step (generator ranks learn it here), and the dtypes of the
   parameters at both ends of every slice.
2. Direct phase: a slice that is contiguous in both local tensors and has the same dtype at both ends (most of
   them: TP splits of row-major weights along dim 0, whole norms) goes straight from the source parameter's storage
   into the destination parameter's storage, one message per slice, all in one `batch_isend_irecv`: no staging,
   no copies. The local (colocated) copies and the zeroing of vocabulary padding run while these messages fly.
3. Staged rounds: the other slices (columns of row-parallel weights, dtype casts, int8/fp8 quantize-on-receive) go
   through a staging arena. They are grouped into rounds (first fit, in plan order; slices larger than a bucket
   are first cut into row slices) such that on every rank the bytes it sends plus receives in a round fit in
   `bucket_bytes`. Per round and peer, the slices that need packing at both ends travel as one flat message; a
   slice contiguous at one end travels alone, sent from the source storage or received into the destination
   storage, so only its other end is copied through the arena.

The round schedule (`ddma.schedule`) is a deterministic function of (plan, bucket size, wire dtype), computed
identically on every rank and kept in the plan's memo, and it counts every network slice (direct ones too), so
which slices a pair moves directly (a fact both ends of that pair know after the handshake) never changes anyone's
rounds. A rank therefore holds at most one bucket of staging (or one row of a weight, if a single row is larger)
besides its parameters: it never materializes a full tensor, let alone the full model. Messages between a pair are told apart by tag (NCCL orders them per pair anyway).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_rl.ddma.descriptors import logical_params
from megatron_rl.ddma.handshake import Handshake, check_and_agree, slice_dtypes
from megatron_rl.ddma.planner import Box, Copy, RankPlan, ReshardPlan, box_view
from megatron_rl.ddma.quant import QuantizedWeight, is_quantized, weight_format
from megatron_rl.ddma.schedule import by_peer, copy_contiguous, end_contiguous, schedule
from megatron_rl.ddma.wide_copy import copy_slice

DEFAULT_BUCKET_BYTES = 64 << 20

_ALIGN = 16  # bytes: every slice in a message starts on this boundary, so it can be viewed as any dtype
_SCHEDULE_ITEMSIZE = 4  # native mode plans buckets as if every element had this size (fp32; bf16 uses half)


@dataclass(frozen=True)
class TransportSettings:
    """How a plan is executed.

    bucket_bytes: bound on the staging memory of one rank per round (sends plus receives), for elements of at most
        4 bytes (float64 parameters in native mode may use up to twice as much).
    wire_dtype: None (default) sends every slice in its source parameter's own dtype, so mixed models (bf16
        matrices with fp32 norms, as Megatron-Core builds them) arrive bit for bit; the receiving ranks learn the
        dtypes in the handshake. A dtype casts every slice to it (e.g. bf16 to halve the bytes of an fp32 trainer).
        Received values are cast to the destination parameter's dtype when written. Local (colocated) copies go
        through the same cast, so the result does not depend on where a slice came from.
    quantize: None, "int8" or "fp8": the destination holds 2-D weights as `quant.Int8Weight` / `quant.Fp8Weight`
        (8-bit codes + per-row scales), quantized on receive (see `megatron_rl/ddma/quant.py`); `quantize_vocab`
        includes the vocabulary tensors.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    wire_dtype: Optional[torch.dtype] = None
    quantize: Optional[str] = None
    quantize_vocab: bool = False

    def bucket_elements(self) -> int:
        item = _SCHEDULE_ITEMSIZE if self.wire_dtype is None else self.wire_dtype.itemsize
        n = self.bucket_bytes // item
        if n < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is smaller than one element")
        return n


@dataclass
class TransferStats:
    """What one rank did in one sync."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0  # colocated copies (no message)
    elements_zeroed: int = 0
    messages_sent: int = 0
    rounds: int = 0  # rounds this rank took part in
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    step: Optional[int] = None  # the trainer step agreed in the handshake
    bytes_scales: int = 0  # row maxima sent ahead of quantize-on-receive


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _write(target, box: Box, values: torch.Tensor) -> None:
    """Write a slice into a destination parameter (cast to its dtype) or quantize it into a QuantizedWeight."""
    if isinstance(target, QuantizedWeight):
        target.write(box, values)
    else:
        copy_slice(box_view(target, box), values)


def _zero(target, box: Box) -> None:
    if isinstance(target, QuantizedWeight):
        target.zero(box)
    else:
        box_view(target, box).zero_()


def _quantized_names(plan: ReshardPlan, settings: TransportSettings) -> frozenset[str]:
    """Logical names of the parameters the destination holds quantized under these settings."""
    return frozenset(p.name for p in logical_params(plan.dst.model)
                     if is_quantized(p, settings.quantize, settings.quantize_vocab))


class _RankTransfer:
    """This rank's part of one sync once the handshake succeeded: how each slice travels, and the phases that
    move it (`direct_phase`, then `staged_rounds`).

    Every decision below is a pure function of the plan, the settings and the two dtypes of a slice, which both ends
    of a pair know after the handshake, so both ends post matching messages in the same order.
    """

    def __init__(self, plan: ReshardPlan, rp: RankPlan, settings: TransportSettings, src_params, dst_params,
                 quantized: frozenset[str], received: Mapping[int, Handshake], stats: TransferStats, device):
        self.plan, self.rp, self.settings = plan, rp, settings
        self.src_params, self.dst_params = src_params, dst_params
        self.quantized, self.stats, self.device = quantized, stats, device
        self.wire = settings.wire_dtype
        self.src_dtype, self.dst_dtype = slice_dtypes(rp, received, src_params, dst_params)

    # ---- how a slice travels ------------------------------------------------------------------------------------
    def wire_of(self, c: Copy) -> torch.dtype:
        return self.wire or self.src_dtype[c.src_rank, c.src_param]

    def nbytes(self, c: Copy) -> int:
        """Bytes of a slice on the wire, rounded up so that the next slice of a packed message is aligned."""
        return _aligned(c.numel * self.wire_of(c).itemsize)

    def _same_dtype(self, c: Copy) -> bool:
        return self.dst_dtype[c.dst_rank, c.dst_param] == self.src_dtype[c.src_rank, c.src_param]

    def direct(self, c: Copy) -> bool:
        """Moves storage to storage: no cast, no quantization, contiguous at both ends (decided on the plan copy)."""
        return (self.wire is None and c.name not in self.quantized and copy_contiguous(c, self.plan)
                and self._same_dtype(c))

    # A staged slice with one contiguous end still saves that end's copy: it travels as a message of its own, sent
    # straight from the source storage or received straight into the destination storage (the TP column slices
    # of row-parallel weights are whole source shards going into strided destination columns, or the reverse).
    def from_storage(self, c: Copy) -> bool:
        return self.wire is None and end_contiguous(c, self.plan, "src")

    def into_storage(self, c: Copy) -> bool:
        return (self.wire is None and c.name not in self.quantized and end_contiguous(c, self.plan, "dst")
                and self._same_dtype(c))

    def alone(self, c: Copy) -> bool:
        return self.from_storage(c) or self.into_storage(c)

    def src_view(self, c: Copy) -> torch.Tensor:
        return box_view(self.src_params[c.src_param], c.src_box)

    def dst_view(self, c: Copy) -> torch.Tensor:
        return box_view(self.dst_params[c.dst_param], c.dst_box)

    # ---- phases -------------------------------------------------------------------------------------------------
    def local_copies(self) -> None:
        """Colocated slices (same rank at both ends) and the zeroing of vocabulary padding: no message. Local
        copies go through the wire cast too, so a value does not depend on where its slice came from."""
        stats = self.stats
        for c in self.rp.local:
            values = self.src_view(c)
            _write(self.dst_params[c.dst_param], c.dst_box, values if self.wire is None else values.to(self.wire))
            stats.bytes_local += c.numel * self.src_params[c.src_param].element_size()
        for z in self.rp.zero_fills:
            _zero(self.dst_params[z.param], z.box)
            stats.elements_zeroed += z.numel

    def direct_phase(self) -> None:
        """Phase 2: every direct slice as one message from source storage into destination storage (tags 1, 2, ...
        per pair, in plan order), all in one batch; the local copies run while the messages fly."""
        stats, ops = self.stats, []
        for peer, copies in by_peer([c for c in self.rp.sends if self.direct(c)], "dst_rank"):
            for tag, c in enumerate(copies, start=1):
                ops.append(dist.P2POp(dist.isend, self.src_view(c), peer, tag=tag))
                stats.bytes_sent += c.numel * self.wire_of(c).itemsize
        for peer, copies in by_peer([c for c in self.rp.recvs if self.direct(c)], "src_rank"):
            for tag, c in enumerate(copies, start=1):
                ops.append(dist.P2POp(dist.irecv, self.dst_view(c), peer, tag=tag))
                stats.bytes_received += c.numel * self.wire_of(c).itemsize
        stats.messages_sent += sum(1 for op in ops if op.op is dist.isend)
        reqs = dist.batch_isend_irecv(ops) if ops else []
        self.local_copies()
        for req in reqs:
            req.wait()
        if ops:
            stats.rounds += 1

    def staged_rounds(self, workspace: Optional[dict]) -> None:
        """Phase 3: the other network slices, round by round of the shared schedule, through one staging arena
        sized for this rank's largest round (what it sends from anything but source storage plus what it receives
        into anything but destination storage)."""
        rank = self.rp.rank
        mine = []
        for pairs in schedule(self.plan, self.settings.bucket_elements()):
            sends = [c for parent, c in pairs if c.src_rank == rank and not self.direct(parent)]
            recvs = [c for parent, c in pairs if c.dst_rank == rank and not self.direct(parent)]
            if sends or recvs:
                mine.append((sends, recvs))
        arena_bytes = max((sum(self.nbytes(c) for c in s if not self.from_storage(c))
                           + sum(self.nbytes(c) for c in r if not self.into_storage(c)) for s, r in mine), default=0)
        arena = _staging(workspace, arena_bytes, self.device)
        self.stats.peak_staging_bytes = arena_bytes
        for sends, recvs in mine:
            self._round(arena, sends, recvs)

    def _slot(self, arena: torch.Tensor, pos: int, c: Copy) -> torch.Tensor:
        """The slice `c` staged at byte `pos` of the arena, as a tensor of its wire dtype and shape."""
        dt = self.wire_of(c)
        return arena[pos:pos + c.numel * dt.itemsize].view(dt).view(c.shape)

    def _messages(self, arena: torch.Tensor, copies: list[Copy], at_storage, storage_view,
                  offset: int) -> tuple[list, int]:
        """One round's messages to or from one peer, in the order both ends post them: the slices packed at both
        ends as one message (tag 0), then each slice that travels alone (tags 1, 2, ...), from or into storage
        where `at_storage` says this end allows it. Returns ([(tag, buffer, [(arena offset, slice) staged in
        it])], the next free arena offset)."""
        out, start, packed = [], offset, []
        for c in copies:
            if not self.alone(c):
                packed.append((offset, c))
                offset += self.nbytes(c)
        if packed:
            out.append((0, arena[start:offset], packed))
        for tag, c in enumerate((c for c in copies if self.alone(c)), start=1):
            if at_storage(c):
                out.append((tag, storage_view(c), []))
            else:
                out.append((tag, self._slot(arena, offset, c), [(offset, c)]))
                offset += self.nbytes(c)
        return out, offset

    def _round(self, arena: torch.Tensor, sends: list[Copy], recvs: list[Copy]) -> None:
        """One staged round: pack what is sent, exchange every message of the round in one batch, unpack what
        arrived into the destination parameters (cast, or quantized, on the way)."""
        stats, ops, unpack, offset = self.stats, [], [], 0
        for peer, copies in by_peer(sends, "dst_rank"):
            out, offset = self._messages(arena, copies, self.from_storage, self.src_view, offset)
            for tag, buf, staged in out:
                for pos, c in staged:
                    copy_slice(self._slot(arena, pos, c), self.src_view(c))
                ops.append(dist.P2POp(dist.isend, buf, peer, tag=tag))
                stats.bytes_sent += buf.numel() * buf.element_size()
            stats.messages_sent += len(out)
        for peer, copies in by_peer(recvs, "src_rank"):
            out, offset = self._messages(arena, copies, self.into_storage, self.dst_view, offset)
            for tag, buf, staged in out:
                unpack.extend(staged)
                ops.append(dist.P2POp(dist.irecv, buf, peer, tag=tag))
                stats.bytes_received += buf.numel() * buf.element_size()
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        for pos, c in unpack:
            _write(self.dst_params[c.dst_param], c.dst_box, self._slot(arena, pos, c))
        stats.rounds += 1


@torch.no_grad()
def execute_plan(
    plan: ReshardPlan,
    rank: int,
    src_params: Optional[Mapping[str, torch.Tensor]],
    dst_params: Optional[Mapping[str, torch.Tensor]],
    settings: TransportSettings = TransportSettings(),
    step: Optional[int] = None,
    workspace: Optional[dict] = None,
) -> TransferStats:
    """Run this rank's part of `plan`: send from `src_params`, write into `dst_params` in place.

    `src_params` / `dst_params` map local parameter names to tensors (e.g. `dict(model.named_parameters())`; with
    `quantize`, `quant.QuantizedWeight`s for the quantized ones) and are None on ranks outside the source /
    destination executor; peers are global ranks of the default group. `step` (trainer ranks) travels in the
    handshake; the agreed value comes back in `stats.step`. A rank whose parameters do not fit the plan raises
    ValueError, and its peers raise PeerCheckFailed, before any weight moves. Pass the same `workspace` dict to
    every sync to keep the staging buffer allocated between syncs (allocating and first touching it costs as much
    as the copies on a CPU).
    """
    rp = plan.for_rank(rank)
    t0 = time.perf_counter()
    quantized = _quantized_names(plan, settings)
    any_params = dst_params or src_params
    device = next(iter(any_params.values())).device if any_params else torch.device("cpu")
    fmt = weight_format(settings.quantize) if settings.quantize else None
    received, agreed_step = check_and_agree(plan, rp, step, src_params, dst_params, quantized, device, fmt)
    stats = TransferStats(step=agreed_step)
    if not (rp.sends or rp.recvs or rp.local or rp.zero_fills):
        return stats
    if quantized:
        stats.bytes_scales = _exchange_scales(rp, src_params, dst_params, quantized, settings.wire_dtype, device)
    transfer = _RankTransfer(plan, rp, settings, src_params, dst_params, quantized, received, stats, device)
    transfer.direct_phase()
    transfer.staged_rounds(workspace)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - t0
    return stats


def _exchange_scales(rp: RankPlan, src_params, dst_params, quantized: frozenset[str],
                     wire: Optional[torch.dtype], device) -> int:
    """Set the scales of this rank's QuantizedWeights from the row maxima of every slice they will receive.

    Senders reduce each slice to its per-row absolute maximum (after the wire cast, so that the scale matches the
    values that arrive) and send those, one message per peer, before any weight moves. Returns bytes sent.
    """

    def rowmax(c: Copy) -> torch.Tensor:
        values = box_view(src_params[c.src_param], c.src_box)
        if wire is not None:
            values = values.to(wire)
        return values.to(torch.float32).abs().amax(dim=1)

    acc: dict[str, torch.Tensor] = {}

    def fold(c: Copy, m: torch.Tensor) -> None:
        t = acc.setdefault(c.dst_param, torch.zeros(dst_params[c.dst_param].shape[0], device=device))
        r0, r1 = c.dst_box[0]
        torch.maximum(t[r0:r1], m, out=t[r0:r1])

    for c in rp.local:
        if c.name in quantized:
            fold(c, rowmax(c))
    ops, incoming, sent = [], [], 0
    for peer, copies in by_peer([c for c in rp.sends if c.name in quantized], "dst_rank"):
        buf = torch.cat([rowmax(c) for c in copies])
        ops.append(dist.P2POp(dist.isend, buf, peer))
        sent += buf.numel() * buf.element_size()
    for peer, copies in by_peer([c for c in rp.recvs if c.name in quantized], "src_rank"):
        buf = torch.empty(sum(c.dst_box[0][1] - c.dst_box[0][0] for c in copies), device=device)
        ops.append(dist.P2POp(dist.irecv, buf, peer))
        incoming.append((buf, copies))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for buf, copies in incoming:
        pos = 0
        for c in copies:
            rows = c.dst_box[0][1] - c.dst_box[0][0]
            fold(c, buf[pos:pos + rows])
            pos += rows
    for name, m in acc.items():
        dst_params[name].set_scale_from_rowmax(m)
    return sent


def _staging(workspace: Optional[dict], nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer of at least `nbytes`, reused from `workspace` when it is large enough."""
    if workspace is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf = workspace.get("staging")
    if buf is None or buf.numel() < nbytes or buf.device != device:
        buf = workspace["staging"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


def staging_bound(plan: ReshardPlan, rank: int, settings: TransportSettings) -> int:
    """Bytes of staging memory `execute_plan` will use on `rank` with these settings."""
    item = (settings.wire_dtype or torch.get_default_dtype()).itemsize
    best = 0
    for pairs in schedule(plan, settings.bucket_elements()):
        best = max(best, sum(c.numel for _, c in pairs if rank in (c.src_rank, c.dst_rank)))
    return best * item


__all__ = ["TransportSettings", "TransferStats", "execute_plan", "staging_bound"]
