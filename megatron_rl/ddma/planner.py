"""DDMA planner: which slice of which trainer rank goes to which slice of which generator rank.

A pure function of the two executors (model shape, layout, first global rank), so every rank computes the same
plan without talking to anyone, and plans are cached; each plan keeps what the transport derives from it every
step in its `PlanMemo`. `box_view` is the one way a `Box` is cut out of a tensor. For each parameter that a
destination rank holds:

- along the partition dim, the destination's blocks are intersected with every source TP rank's blocks in the
  logical coordinates of the padded tensor (Megatron's strided split makes these blocks; intersecting intervals is
  the general form of Megatron-Core's LCM tiling and needs no divisibility between the two TP sizes);
- destination vocabulary rows at or beyond `vocab_size` are padding: they are zero-filled locally, never sent, so
  executors whose padding differs (it grows with TP) still match;
- each piece can come from any source rank holding it: the DP replicas of the owning stage (and, for parameters
  replicated over TP, every TP rank of that stage); a mixture of experts' expert shard, the ranks of the stage
  at its place in the expert grid (its expert-data-parallel group: with EP over DP, only some DP ranks hold an
  expert at all, and the same local name means another expert on the others). A destination rank that is itself
  a candidate (colocated executors) copies locally. Otherwise pieces go to the least-loaded candidate, largest
  pieces first, and large pieces are split over the candidates first, so that all trainer ranks send and none
  sends much more than the replicas beside it. The tied-embedding copy on a trainer's last stage is never used as
  a source: only the canonical copy on the first stage is (the copies agree in exact arithmetic, and we do not
  rely on bitwise agreement); a generator's tied copy is filled like any other parameter.

Megatron-Core's `megatron.core.resharding` planner works from live modules on the same ranks, gathers metadata with
collectives and rejects differing vocabulary padding; this one needs neither the modules nor any communication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, NamedTuple, Optional

from megatron_rl.ddma.descriptors import (
    LocalParam,
    ModelShape,
    check_layout,
    check_same_architecture,
    logical_params,
    stage_params,
)
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim of a local tensor

# Pieces are never cut below this many elements to balance senders (see _assign_sources).
DEFAULT_SPLIT_MIN_ELEMENTS = 1 << 16


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def box_view(t, box: Box):
    """The slice `box` of tensor `t` (a view: writing it writes `t`)."""
    return t[tuple(slice(a, b) for a, b in box)]


@dataclass(frozen=True)
class Endpoint:
    """An executor as the planner sees it: its model's shape, its layout and its first global rank."""

    model: ModelShape
    layout: ParallelLayout
    first_rank: int = 0

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.layout.size)

    def coords(self, rank: int) -> tuple[int, int, int]:
        return self.layout.coords(rank - self.first_rank)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return self.first_rank + self.layout.local_rank(tp_rank, pp_rank, dp_rank)

    def params(self, rank: int) -> tuple[LocalParam, ...]:
        """Parameters held by global `rank` (empty when the rank is not in this executor)."""
        if rank not in self.ranks:
            return ()
        tp_rank, pp_rank, dp_rank = self.coords(rank)
        return stage_params(self.model, self.layout, pp_rank, tp_rank, dp_rank)


class Copy(NamedTuple):
    """Copy `src_box` of `src_param` on `src_rank` into `dst_box` of `dst_param` on `dst_rank` (same shape).

    A named tuple, not a frozen dataclass: a 405B plan holds half a million of them, and a frozen dataclass sets
    each field through `object.__setattr__` (making them took about a fifth of the plan's time)."""

    name: str  # logical (global) parameter name
    src_rank: int
    dst_rank: int
    src_param: str  # local parameter name on the source rank
    dst_param: str  # local parameter name on the destination rank
    src_box: Box
    dst_box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.dst_box)

    @property
    def numel(self) -> int:
        return box_numel(self.dst_box)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class ZeroFill:
    """Vocabulary padding rows of a destination parameter: set to zero, never sent."""

    rank: int
    param: str  # local parameter name
    box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.box)


@dataclass(frozen=True)
class RankPlan:
    """What one global rank does in a sync."""

    rank: int
    sends: tuple[Copy, ...]
    recvs: tuple[Copy, ...]
    local: tuple[Copy, ...]
    zero_fills: tuple[ZeroFill, ...]

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({c.dst_rank for c in self.sends} | {c.src_rank for c in self.recvs}))


@dataclass
class PlanMemo:
    """What is derived from one `ReshardPlan` and kept with it, computed on first use: a sync runs every step, and
    working these out again each time would cost about as much as moving a small model.

    rank_plans: global rank -> its `RankPlan` (`ReshardPlan.for_rank`).
    schedules: bucket size in elements -> the transport's rounds (`ddma.schedule.schedule`).
    contiguous: ("src" or "dst", copy) -> whether that end's box is contiguous in its local tensor
        (`ddma.schedule.end_contiguous`).

    Every entry is a pure function of the plan and its key: the same on every rank, so sharing it is safe, and a
    plan is shared by everyone in the process who asks for it (`plan_reshard` caches plans).
    """

    rank_plans: dict[int, RankPlan] = field(default_factory=dict)
    schedules: dict[int, tuple] = field(default_factory=dict)
    contiguous: dict[tuple[str, Copy], bool] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class ReshardPlan:
    """Every copy and zero-fill of one sync, for all ranks (identical on every rank), and its `memo`."""

    src: Endpoint
    dst: Endpoint
    copies: tuple[Copy, ...]
    zero_fills: tuple[ZeroFill, ...]
    memo: PlanMemo = field(default_factory=PlanMemo, init=False, repr=False, compare=False)

    def for_rank(self, rank: int) -> RankPlan:
        plans = self.memo.rank_plans
        if rank not in plans:
            plans[rank] = RankPlan(
                rank,
                sends=tuple(c for c in self.copies if c.src_rank == rank and not c.is_local),
                recvs=tuple(c for c in self.copies if c.dst_rank == rank and not c.is_local),
                local=tuple(c for c in self.copies if c.src_rank == rank and c.is_local),
                zero_fills=tuple(z for z in self.zero_fills if z.rank == rank),
            )
        return plans[rank]

    @property
    def network_elements(self) -> int:
        return sum(c.numel for c in self.copies if not c.is_local)

    @property
    def local_elements(self) -> int:
        return sum(c.numel for c in self.copies if c.is_local)

    def sender_loads(self) -> dict[int, int]:
        """Elements each source rank sends over the network (0 for ranks that send nothing)."""
        loads = {r: 0 for r in self.src.ranks}
        for c in self.copies:
            if not c.is_local:
                loads[c.src_rank] += c.numel
        return loads

    def summary(self) -> dict:
        loads = self.sender_loads()
        return {"copies": len(self.copies), "network_elements": self.network_elements,
                "local_elements": self.local_elements,
                "zero_filled_elements": sum(z.numel for z in self.zero_fills),
                "senders": sum(1 for v in loads.values() if v), "max_sender_elements": max(loads.values())}


@dataclass
class _Piece:
    """A destination slice and the source ranks that could provide it (before a source is chosen)."""

    name: str
    dst_rank: int
    dst_param: str
    dst_box: Box
    src_box: Box
    candidates: tuple[int, ...]
    src_param: str
    order: int  # position in the plan
    src_rank: int = -1


def _full_box(shape: Iterable[int]) -> Box:
    return tuple((0, s) for s in shape)


def _with_dim(box: Box, dim: int, lo: int, hi: int) -> Box:
    return box[:dim] + ((lo, hi),) + box[dim + 1:]


def _source_index(src: Endpoint) -> dict[str, tuple[int, list[tuple[LocalParam, tuple[int, ...]]]]]:
    """For each logical parameter: the source stage holding its canonical copy, and each distinct shard of it there
    with the ranks that hold that shard (a dense weight's TP shard: its DP replicas; an expert's expert-TP shard:
    the ranks of the expert grid place that owns the expert), in TP-rank order."""
    held: dict[str, tuple[int, dict[LocalParam, list[int]]]] = {}
    lay = src.layout
    for pp_rank in range(lay.pp):
        for t in range(lay.tp):
            for d in range(lay.dp):
                rank = src.rank_of(t, pp_rank, d)
                for lp in stage_params(src.model, lay, pp_rank, t, d):
                    if not lp.tied_copy:
                        held.setdefault(lp.global_name, (pp_rank, {}))[1].setdefault(lp, []).append(rank)
    return {name: (stage, [(lp, tuple(ranks)) for lp, ranks in shards.items()])
            for name, (stage, shards) in held.items()}


def _templates(lp: LocalParam, stage: int, shards: list[tuple[LocalParam, tuple[int, ...]]]) -> tuple[list, list]:
    """What destination parameter `lp` needs, independent of which DP replica holds it:
    ([(dst_box, src_box, candidates, src_param)], [zero-filled dst_box])."""
    p = lp.param
    dst_full = _full_box(lp.local_shape)
    if p.partition_dim is None:
        everyone = tuple(r for _, ranks in shards for r in ranks)
        return [(dst_full, _full_box(p.shape), everyone, shards[0][0].local_name)], []
    pieces, zeros = [], []
    dim = p.partition_dim
    real = p.shape[dim]  # logical extent: padding rows lie beyond it
    replicas = [ranks for _, ranks in shards]
    src_blocks = [(sp.local_name, _full_box(sp.local_shape), sp.blocks()) for sp, _ in shards]
    for g0, g1, l0 in lp.blocks():
        if g1 > real:
            zeros.append(_with_dim(dst_full, dim, l0 + max(g0, real) - g0, l0 + g1 - g0))
        for t, (src_name, src_full, blocks) in enumerate(src_blocks):
            for s0, s1, sl0 in blocks:
                a, b = max(g0, s0), min(g1, s1, real)
                if a < b:
                    pieces.append((_with_dim(dst_full, dim, l0 + a - g0, l0 + b - g0),
                                   _with_dim(src_full, dim, sl0 + a - s0, sl0 + b - s0), replicas[t], src_name))
    return pieces, zeros


def _split_rows(piece: _Piece, parts: int) -> list[_Piece]:
    """Split a piece into `parts` near-equal slices of dim 0 (same rows on both sides)."""
    (d0, d1), (s0, _) = piece.dst_box[0], piece.src_box[0]
    rows = d1 - d0
    parts = max(1, min(parts, rows))
    if parts == 1:
        return [piece]
    out = []
    for i in range(parts):
        lo, hi = d0 + rows * i // parts, d0 + rows * (i + 1) // parts
        out.append(dataclasses.replace(piece, dst_box=_with_dim(piece.dst_box, 0, lo, hi),
                                       src_box=_with_dim(piece.src_box, 0, s0 + lo - d0, s0 + hi - d0)))
    return out


def _assign_sources(pieces: list[_Piece], split_min_elements: int) -> list[_Piece]:
    """Choose a source for every piece: local when possible, else the least-loaded candidate, largest first.

    A piece larger than its candidates' fair share (the total of the pieces with the same candidates divided by
    their number, and at least `split_min_elements`) is first cut into row slices of about that share, so that a
    few big tensors do not leave some replicas idle; with many pieces per candidate nothing is cut, and messages
    stay few and large.
    """
    local, remote = [], []
    total: dict[tuple[int, ...], int] = {}
    for pc in pieces:
        if pc.dst_rank in pc.candidates:
            pc.src_rank = pc.dst_rank
            local.append(pc)
        else:
            remote.append(pc)
            total[pc.candidates] = total.get(pc.candidates, 0) + box_numel(pc.dst_box)
    cut = []
    for pc in remote:
        n, share = box_numel(pc.dst_box), max(split_min_elements, total[pc.candidates] // len(pc.candidates))
        cut.extend(_split_rows(pc, -(-n // share)) if n > share and len(pc.candidates) > 1 else [pc])
    # Largest first (a stable sort: equal sizes keep their order), each to its least-loaded candidate, the lowest
    # rank among equals: `min` over the candidates in ascending order returns the first of the least loaded. A 405B
    # plan assigns half a million pieces, so this loop avoids a Python key function per candidate.
    sizes = [box_numel(pc.dst_box) for pc in cut]
    ascending = {c: tuple(sorted(c)) for c in total}
    load = dict.fromkeys((r for c in ascending.values() for r in c), 0)
    for i in sorted(range(len(cut)), key=sizes.__getitem__, reverse=True):
        pc = cut[i]
        pc.src_rank = min(ascending[pc.candidates], key=load.__getitem__)
        load[pc.src_rank] += sizes[i]
    return local + cut


def plan_reshard(
    src_cfg: "ModelConfig | ModelShape",
    src_layout: ParallelLayout,
    dst_layout: ParallelLayout,
    *,
    src_first_rank: int = 0,
    dst_first_rank: Optional[int] = None,
    dst_cfg: "ModelConfig | ModelShape | None" = None,
    split_min_elements: int = DEFAULT_SPLIT_MIN_ELEMENTS,
) -> ReshardPlan:
    """Plan a sync from a source executor (the trainer) to a destination executor (the generator).

    `dst_first_rank` defaults to the rank after the source's last (disjoint executors); equal first ranks mean
    colocated executors. `dst_cfg` (default: `src_cfg`) may differ only in its vocabulary padding rule. Raises
    ValueError with one line when the two cannot match (different architectures, a TP that does not divide the
    heads, query groups or FFN size, a PP that does not divide the layers). Cached for the process (the last 32
    argument sets): the same arguments return the same plan object, and with it the same `PlanMemo`.
    """
    src_shape = ModelShape.of(src_cfg)
    dst_shape = ModelShape.of(dst_cfg if dst_cfg is not None else src_cfg)
    if dst_first_rank is None:
        dst_first_rank = src_first_rank + src_layout.size
    return _plan_cached(Endpoint(src_shape, src_layout, src_first_rank), Endpoint(dst_shape, dst_layout,
                                                                                  dst_first_rank),
                        split_min_elements)


@contextlib.contextmanager
def _without_cyclic_gc():
    """Python's cyclic garbage collector off for a block that builds many objects none of which form cycles. A 405B
    plan makes about two million (pieces, boxes, copies), and each full collection re-walks all the survivors: 35-40%
    of `plan_reshard`'s time (7.3-7.5 -> 4.3-4.9 s for llama3-405b on the 2-core test machine), which every rank of
    the job pays at its start. The collector is on again afterwards, as the caller had it, also after an error."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=32)
def _plan_cached(src: Endpoint, dst: Endpoint, split_min_elements: int) -> ReshardPlan:
    with _without_cyclic_gc():
        return _make_plan(src, dst, split_min_elements)


def _make_plan(src: Endpoint, dst: Endpoint, split_min_elements: int) -> ReshardPlan:
    check_same_architecture(src.model, dst.model)
    check_layout(src.model, src.layout, "trainer (source)")
    check_layout(dst.model, dst.layout, "generator (destination)")
    if src.first_rank < 0 or dst.first_rank < 0:
        raise ValueError(f"first ranks must be >= 0 (source {src.first_rank}, destination {dst.first_rank})")
    index = _source_index(src)
    position = {p.name: i for i, p in enumerate(logical_params(dst.model))}
    # Parameter-major order: consecutive copies involve many ranks at once, which the transport's rounds like.
    wanted = sorted(((position[lp.global_name], r, lp) for r in dst.ranks for lp in dst.params(r)),
                    key=lambda x: x[:2])
    pieces: list[_Piece] = []
    zeros: list[ZeroFill] = []
    templates: dict[LocalParam, tuple[list, list]] = {}  # DP replicas of the destination need the same slices
    for _, r, lp in wanted:
        if lp not in templates:
            stage, shards = index[lp.global_name]
            templates[lp] = _templates(lp, stage, shards)
        needed, padding = templates[lp]
        for dst_box, src_box, candidates, src_param in needed:
            pieces.append(_Piece(lp.global_name, r, lp.local_name, dst_box, src_box, candidates, src_param,
                                 len(pieces)))
        zeros.extend(ZeroFill(r, lp.local_name, box) for box in padding)
    chosen = _assign_sources(pieces, split_min_elements)
    chosen.sort(key=lambda pc: (pc.order, pc.dst_box))
    copies = tuple(Copy(pc.name, pc.src_rank, pc.dst_rank, pc.src_param, pc.dst_param, pc.src_box, pc.dst_box)
                   for pc in chosen)
    return ReshardPlan(src, dst, copies, tuple(zeros))
