"""One torch.distributed world split into executors, each with its own Megatron-Core process groups.

A job runs trainer and generator executors in one world with different parallel layouts, e.g. trainer TP=2 x PP=2
on ranks 0-3 and generator TP=1 x DP=2 on ranks 4-5, or both on the same ranks (colocated). Megatron-Core's
`parallel_state` singleton can only describe one layout spanning the whole world, so every executor gets its own
`ProcessGroupCollection`, built with Megatron-Core's `HyperCommGrid` (which supports a rank offset).

`torch.distributed.new_group` is collective over the whole world: every rank must build every executor's groups
in the same order. `build_topology` does exactly that, and returns, for each executor, the groups of this rank
(`pgs` is None on ranks outside the executor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ExecutorPlacement:
    """An executor's name, layout and first global rank; it occupies ranks [first_rank, first_rank + size)."""

    name: str
    layout: ParallelLayout
    first_rank: int = 0

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.layout.size)


@dataclass
class ExecutorGroups:
    """One executor as seen from this rank."""

    placement: ExecutorPlacement
    rank: int
    pgs: Optional[ProcessGroupCollection] = None
    grid: Optional[HyperCommGrid] = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.placement.name

    @property
    def layout(self) -> ParallelLayout:
        return self.placement.layout

    @property
    def is_member(self) -> bool:
        return self.rank in self.placement.ranks

    @property
    def local_rank(self) -> int:
        return self.rank - self.placement.first_rank

    @property
    def coords(self) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of this rank in the executor."""
        return self.layout.coords(self.local_rank)

    @property
    def tp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def dp_rank(self) -> int:
        return self.coords[2]

    @property
    def expert_coords(self) -> tuple[int, int]:
        """(expert TP rank, EP rank): which slice of which share of the experts this rank holds."""
        return self.layout.expert_coords(self.tp_rank, self.dp_rank)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def check_placements(placements: list[ExecutorPlacement], world_size: int) -> None:
    """Reject placements that do not fit in the world, or names used twice, before any group is made."""
    names = set()
    for p in placements:
        if p.name in names:
            raise ValueError(f"executor name {p.name!r} is used twice")
        names.add(p.name)
        if p.first_rank < 0:
            raise ValueError(f"{p.name}: first_rank={p.first_rank} must be >= 0")
        if p.ranks.stop > world_size:
            raise ValueError(
                f"{p.name}: {p.layout} needs ranks {p.ranks.start}-{p.ranks.stop - 1} "
                f"({p.layout.size} ranks) but the world has only {world_size}"
            )


def world_timeout() -> timedelta:
    """The world's timeout for one collective, for every group made from it: torch gives a new group its backend's
    default (30 min for gloo, 10 for NCCL), not the world's, and a subgroup that gave up sooner would call a slow
    peer dead (hangs are found by heartbeats, `parallel/liveness.py`)."""
    from megatron_rl.parallel import liveness

    pg = dist.distributed_c10d._get_default_group()
    for device in pg._device_types:  # gloo registers cpu and cuda, NCCL cuda: one backend's options hold it
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return timedelta(seconds=liveness.collective_timeout_s())  # a backend without options: the configured value


def new_group(ranks: Optional[list[int]] = None, backend: Optional[str] = None):
    """`dist.new_group` with the world's timeout (collective over the world)."""
    return dist.new_group(ranks=ranks, backend=backend, timeout=world_timeout())


def _new_subgroups(rank_lists: list[list[int]], backend: Optional[str]):
    """Create one group per list (collective over the world); return the one holding this rank, if any."""
    mine = None
    me = dist.get_rank()
    for ranks in rank_lists:
        group = new_group(ranks, backend)
        if me in ranks:
            mine = group
    return mine


def _expert_groups(placement: ExecutorPlacement, backend: Optional[str]) -> tuple:
    """The expert groups of an executor whose experts are not laid out as its dense weights (collective over the
    world): expert TP, EP, expert TP x EP, that x PP, and expert-data-parallel, from Megatron-Core's expert grid
    "tp-ep-dp-pp" over each stage's tp x dp ranks (`ParallelLayout.expert_coords`'s rule)."""
    layout = placement.layout
    if layout.expert_grid_problem():
        raise ValueError(f"{placement.name}: {layout.expert_grid_problem()}")
    grid = HyperCommGrid([layout.etp, layout.ep, layout.expert_dp, layout.pp],
                         ["tp", "ep", "dp", "pp"], rank_offset=placement.first_rank, backend=backend)
    timeout = world_timeout()
    return tuple(grid.create_pg(dims, timeout=timeout)
                 for dims in (["tp"], ["ep"], ["tp", "ep"], ["tp", "ep", "pp"], ["dp"]))


def _executor_groups(placement: ExecutorPlacement, backend: Optional[str]) -> ExecutorGroups:
    layout = placement.layout
    rank = dist.get_rank()
    grid = HyperCommGrid(
        [layout.tp, 1, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"], rank_offset=placement.first_rank,
        backend=backend,
    )
    member = rank in placement.ranks
    made = {}
    timeout = world_timeout()
    for dims in (["tp"], ["pp"], ["dp"], ["cp"], ["tp", "pp"], ["cp", "dp"], ["tp", "cp"],
                 ["tp", "cp", "dp"], ["tp", "cp", "dp", "pp"]):
        made["-".join(dims)] = grid.create_pg(dims, timeout=timeout)
    # Embedding group: first and last pipeline stage of each pipeline (tied embeddings' gradients are summed
    # there); position-embedding group: first stage only. Both are enumerated from the pipeline groups.
    pp_lists = grid.get_rank_enum(["pp"])
    embd = _new_subgroups([sorted({r[0], r[-1]}) for r in pp_lists], backend)
    pos_embd = _new_subgroups([[r[0]] for r in pp_lists], backend)
    expert = _expert_groups(placement, backend) if (layout.ep, layout.etp) != (1, layout.tp) else None
    groups = ExecutorGroups(placement=placement, rank=rank, grid=grid)
    if not member:
        return groups
    pgs = ProcessGroupCollection()
    pgs.tp = made["tp"]
    pgs.pp = made["pp"]
    pgs.dp = made["dp"]
    pgs.cp = made["cp"]
    pgs.mp = made["tp-pp"]
    pgs.dp_cp = made["cp-dp"]
    pgs.intra_dp_cp = made["cp-dp"]
    pgs.tp_cp = made["tp-cp"]
    pgs.tp_dp_cp = made["tp-cp-dp"]
    pgs.embd = embd
    pgs.pos_embd = pos_embd
    if expert is None:  # experts split as the dense MLP (or no experts): the expert groups are the dense ones
        pgs.expt_tp = made["tp"]
        pgs.ep = made["cp"]
        pgs.tp_ep = made["tp"]
        pgs.tp_ep_pp = made["tp-pp"]
        pgs.expt_dp = made["cp-dp"]
    else:
        pgs.expt_tp, pgs.ep, pgs.tp_ep, pgs.tp_ep_pp, pgs.expt_dp = expert
    pgs.intra_expt_dp = pgs.expt_dp
    # One distributed-optimizer instance spanning the executor: grad statistics reduce over all its ranks.
    pgs.intra_dist_opt = made["tp-cp-dp-pp"]
    pgs.inter_dist_opt = None
    groups.pgs = pgs
    return groups


def build_topology(
    placements: list[ExecutorPlacement], backend: Optional[str] = None
) -> dict[str, ExecutorGroups]:
    """Build every executor's process groups (collective: call on every rank with the same placements)."""
    if not dist.is_initialized():
        raise RuntimeError("build_topology needs torch.distributed to be initialized first")
    check_placements(placements, dist.get_world_size())
    return {p.name: _executor_groups(p, backend) for p in placements}
