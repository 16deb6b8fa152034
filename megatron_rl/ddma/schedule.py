"""The transport's shared arithmetic: pure functions of a reshard plan that every rank computes alike, so that
both ends of each message post it in the same round, order and form without asking each other.

schedule         the network slices grouped into rounds that fit a staging bucket on every rank (first fit)
copy_contiguous  whether a slice is contiguous in both local tensors (it may then move storage to storage)
end_contiguous   the same for one end of a slice
by_peer          a rank's slices grouped by peer, in the order both ends use

Schedules and contiguity are kept in the plan's `PlanMemo` (`ddma.planner`): a sync runs every step.
"""

from __future__ import annotations

from megatron_rl.ddma.planner import Box, Copy, ReshardPlan


def _split_to_fit(c: Copy, limit: int) -> list[Copy]:
    """Cut a copy into dim-0 slices of at most `limit` elements (one row at least)."""
    n = c.numel
    if n <= limit:
        return [c]
    (d0, d1), (s0, _) = c.dst_box[0], c.src_box[0]
    rows = d1 - d0
    row = n // rows
    step = max(1, limit // row)
    out = []
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        out.append(Copy(c.name, c.src_rank, c.dst_rank, c.src_param, c.dst_param,
                        ((s0 + lo, s0 + hi),) + c.src_box[1:], ((d0 + lo, d0 + hi),) + c.dst_box[1:]))
    return out


def schedule(plan: ReshardPlan, bucket_elements: int) -> tuple[tuple[tuple[Copy, Copy], ...], ...]:
    """Network copies grouped into rounds as (plan copy, slice of it) pairs; per rank and round, sent + received
    elements <= bucket (first fit). A slice that alone exceeds the bucket (a single row larger than it) gets a round
    of its own on its two ranks. Kept in `plan.memo`."""
    cached = plan.memo.schedules.get(bucket_elements)
    if cached is not None:
        return cached
    rounds: list[list[tuple[Copy, Copy]]] = []
    used: list[dict[int, int]] = []
    first_open: dict[int, int] = {}  # per rank: rounds before this one are full for it (first-fit shortcut)
    for big in plan.copies:
        if big.is_local:
            continue
        for c in _split_to_fit(big, bucket_elements):
            n = c.numel
            i = max(first_open.get(c.src_rank, 0), first_open.get(c.dst_rank, 0))
            while i < len(rounds):
                u = used[i]
                us, ud = u.get(c.src_rank, 0), u.get(c.dst_rank, 0)
                if (us == 0 or us + n <= bucket_elements) and (ud == 0 or ud + n <= bucket_elements):
                    break
                i += 1
            if i == len(rounds):
                rounds.append([])
                used.append({})
            rounds[i].append((big, c))
            for r in (c.src_rank, c.dst_rank):
                used[i][r] = used[i].get(r, 0) + n
                if used[i][r] >= bucket_elements and first_open.get(r, 0) == i:
                    first_open[r] = i + 1
    result = tuple(tuple(r) for r in rounds)
    plan.memo.schedules[bucket_elements] = result
    return result


def copy_contiguous(c: Copy, plan: ReshardPlan) -> bool:
    """Whether both boxes of a copy are contiguous in their row-major local tensors (a pure function of the plan:
    both ends of a message get the same answer)."""
    return end_contiguous(c, plan, "src") and end_contiguous(c, plan, "dst")


def end_contiguous(c: Copy, plan: ReshardPlan, end: str) -> bool:
    """Whether one end's box ("src" or "dst") of a copy (or of a row slice of one) is contiguous in its local
    tensor; pure, like `copy_contiguous`, and kept in `plan.memo`."""
    memo = plan.memo.contiguous
    hit = memo.get((end, c))
    if hit is None:
        endpoint, rank, name, box = ((plan.src, c.src_rank, c.src_param, c.src_box) if end == "src"
                                     else (plan.dst, c.dst_rank, c.dst_param, c.dst_box))
        hit = memo[end, c] = _box_contiguous(box, _local_shape(endpoint, rank, name))
    return hit


def _local_shape(endpoint, rank: int, name: str) -> tuple[int, ...]:
    for lp in endpoint.params(rank):
        if lp.local_name == name:
            return lp.local_shape
    raise KeyError(f"rank {rank} holds no parameter {name!r}")


def _box_contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    """A box is contiguous when, after its first dim with more than one element, every dim is whole."""
    started = False
    for (a, b), n in zip(box, shape):
        if started and (a, b) != (0, n):
            return False
        if b - a > 1:
            started = True
    return True


def by_peer(copies: list[Copy], attr: str) -> list[tuple[int, list[Copy]]]:
    """Copies grouped by peer rank, peers ascending, plan order kept inside each group (both ends agree)."""
    groups: dict[int, list[Copy]] = {}
    for c in copies:
        groups.setdefault(getattr(c, attr), []).append(c)
    return sorted(groups.items())
