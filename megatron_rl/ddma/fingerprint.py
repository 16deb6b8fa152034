"""Is what the generator holds what the trainer sent? A check of a weight push, cheap enough to run every few pushes.

The failure peers' users report most often is a weight sync that "succeeds" while the generator keeps the old
weights. After a push, every copy of the plan is fingerprinted on both of its ends: the source rank fingerprints the
region it sent, as the destination's dtype holds it (bf16-rounded for a bf16 generator of an fp32 trainer), the
destination rank the region it wrote. The fingerprints travel in one all_gather of small objects over the ranks of
both executors (the first check also gathers the destinations' dtypes); every rank compares every copy, and all
raise the same `PushMismatch` naming the first copy whose ends differ: the tensor, the region, the two ranks.

The fingerprint of a region is the sum of its elements' bit patterns read as signed integers of their width,
wrapping at 2**32, over every `SAMPLE_EVERY`-th row of the region (every element of a 1-D region). Integer sums are
exact and independent of the order the elements are read in, so the two ends agree bit for bit although the region
is a strided slice of a tensor on one end and of a differently-shaped one on the other; one changed bit of a
sampled element changes the fingerprint. A float64 sum is exact too, but reads 10x slower on a CPU (the conversion
dominates; int32 sums run at the memory's speed): measured in `benchmarks/ddma.py`, recorded in docs/benchmarks.md.
Sampling rows is what keeps the check under 1% of a push at `generator.push_check_interval`'s default, and it loses
nothing for the fault it is for: a copy that did not arrive leaves every row of its region stale.

Quantized destinations (int8/fp8 codes) are not fingerprinted: their codes are made on the destination from rows
that no single source holds.
"""

from __future__ import annotations

import math
import time
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_rl.ddma.planner import Box, ReshardPlan

SAMPLE_EVERY = 8  # rows of a region read by the fingerprint: 0, 8, 16, ...
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PushMismatch(RuntimeError):
    """A copy of a weight push whose two ends hold different values; the message names it in one line."""


def _fingerprint(t: torch.Tensor, box: Box, dtype: torch.dtype) -> torch.Tensor:
    """The region's fingerprint as a 0-d int tensor on t's device (no sync here). Few torch calls per region: on a
    GPU the check is bound by them, not by the bytes (measured in `benchmarks/ddma.py`)."""
    rows = t[(slice(box[0][0], box[0][1], SAMPLE_EVERY if len(box) > 1 else 1),
              *(slice(a, b) for a, b in box[1:]))]
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    return rows.view(_BITS[rows.element_size()]).sum(dtype=torch.int32 if rows.element_size() <= 4 else torch.int64)


def held_dtypes(plan: ReshardPlan, rank: int, dst_params: Optional[Mapping[str, torch.Tensor]]) -> dict:
    """{(rank, local name): dtype} of the plan's destination tensors on this rank (a generator in bf16 keeps its
    norms in fp32: one dtype per generator would be wrong). Quantized weights are left out: not fingerprinted."""
    if dst_params is None:
        return {}
    return {(rank, c.dst_param): dst_params[c.dst_param].dtype for c in plan.copies
            if c.dst_rank == rank and isinstance(dst_params[c.dst_param], torch.Tensor)}


@torch.no_grad()
def local_fingerprints(plan: ReshardPlan, rank: int, src_params: Optional[Mapping[str, torch.Tensor]],
                       dst_params: Optional[Mapping[str, torch.Tensor]], dtypes: Mapping) -> dict:
    """This rank's ends of the plan's copies: {("s", i): fingerprint} for copies it sent (its region cast to the
    dtype the destination holds, from every rank's `held_dtypes` merged) and {("d", i): fingerprint} for copies it
    wrote. Copies into a destination missing from `dtypes` (quantized) are skipped on both ends.

    The fingerprints stay on the tensors' device until one `tolist()` at the end: one device sync per check, not one
    per copy (a 405B rank's plan has hundreds of copies)."""
    keys, values = [], []
    for i, c in enumerate(plan.copies):
        dtype = dtypes.get((c.dst_rank, c.dst_param))
        if dtype is None:
            continue
        if src_params is not None and c.src_rank == rank:
            keys.append(("s", i))
            values.append(_fingerprint(src_params[c.src_param], c.src_box, dtype))
        if dst_params is not None and c.dst_rank == rank:
            keys.append(("d", i))
            values.append(_fingerprint(dst_params[c.dst_param], c.dst_box, dtype))
    if not keys:
        return {}
    if any(v.dtype != values[0].dtype for v in values):  # int64 sums of 8-byte elements beside int32 ones
        values = [v.to(torch.int64) for v in values]
    return dict(zip(keys, torch.stack(values).tolist()))


def mismatches(plan: ReshardPlan, gathered: list[dict]) -> list[str]:
    """Every copy whose destination fingerprint differs from its source's, one line each (`gathered`: every rank's
    `local_fingerprints`)."""
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    bad = []
    for i, c in enumerate(plan.copies):
        got, want = merged.get(("d", i)), merged.get(("s", i))
        if got is not None and want is not None and got != want:
            region = ", ".join(f"{a}:{b}" for a, b in c.dst_box)
            bad.append(f"{c.name}[{region}] on generator rank {c.dst_rank} is not what was sent (fingerprint "
                       f"{got & 0xFFFFFFFF:#010x}, trainer rank {c.src_rank} sent {want & 0xFFFFFFFF:#010x})")
    return bad


def checks_every(check_s: float, push_s: float, budget: float) -> int:
    """The fewest pushes between two checks for which one check costs at most `budget` of their time."""
    return max(1, math.ceil(check_s / (budget * push_s))) if push_s > 0 else 1


class PushCheck:
    """The check of one plan's pushes, on one rank of either executor. Collective over `group` (the ranks of both
    executors) each time it runs; the first run also gathers the destinations' dtypes, which never change.

    `interval`: check every N-th push (0: never), or "auto": check push 0, then choose the next so that the checks
    cost at most `BUDGET` of the pushes between them. Every run gathers each rank's check and mean push seconds
    with the fingerprints, so every rank computes the same next version from the same numbers: the slowest rank's
    check against the fastest rank's push (a generator rank's push also holds its wait for the trainer's step)."""

    BUDGET = 0.01

    def __init__(self, plan: ReshardPlan, rank: int, group, interval: "int | str" = "auto"):
        self.plan, self.rank, self.group, self.interval = plan, rank, group, interval
        self.dtypes: Optional[dict] = None
        self.next_version: Optional[int] = 0 if interval == "auto" else (interval or None)  # None: never
        self.every = None if interval == "auto" else interval  # pushes between checks, as last chosen
        self.seconds = 0.0  # the last check's, on this rank
        self.cost = (0.0, 0.0)  # (check seconds, mean push seconds) this rank sent with its last check
        self._pushes: list[float] = []  # push seconds since the last check, on this rank

    def _all_gather(self, obj) -> list:
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def after_push(self, src_params, dst_params, version: int, push_s: float) -> None:
        """Call after every push (every rank of both executors): runs the check when it is due, and raises
        PushMismatch on every rank when a copy of the push of `version` did not arrive intact."""
        self._pushes.append(push_s)
        if self.next_version is None or version < self.next_version:
            return
        t0 = time.perf_counter()
        if self.dtypes is None:
            self.dtypes = {k: v for part in self._all_gather(held_dtypes(self.plan, self.rank, dst_params))
                           for k, v in part.items()}
        mine = local_fingerprints(self.plan, self.rank, src_params, dst_params, self.dtypes)
        self.cost = (time.perf_counter() - t0 + self.seconds, sum(self._pushes) / len(self._pushes))
        gathered = self._all_gather((mine, self.cost))
        self.seconds, self._pushes = time.perf_counter() - t0, []
        if self.interval == "auto":  # the last check's full time stands in for this one's gather
            self.every = checks_every(max(g[1][0] for g in gathered), min(g[1][1] for g in gathered), self.BUDGET)
        self.next_version = version + self.every
        bad = mismatches(self.plan, [g[0] for g in gathered])
        if bad:
            more = f" (and {len(bad) - 1} more regions)" if len(bad) > 1 else ""
            raise PushMismatch(f"weight push {version} did not arrive: {bad[0]}{more}")
