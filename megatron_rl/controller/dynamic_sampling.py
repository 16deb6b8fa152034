"""Dynamic sampling (DAPO; `algorithm.dynamic_sampling`): a group whose raw task rewards are all equal has zero
group-relative advantage, so it carries no gradient and only dilutes the step. A generator replica drops such groups
and fills their places from further prompts, drawn deterministically, before it sends its batch.

On each replica (its ranks together, the leader deciding):

    round 0       the batch's own prompts (the replica's share), as without dynamic sampling
    round r >= 1  the first `missing` prompts of the replica's share of refill batch `refill_index(batch, r)`, each
                  seeded as a training prompt of that index is (`executors.rollout_seed`): a pure function of (run
                  seed, batch, round), so a resumed run draws exactly what the uninterrupted one drew
    fill          a dropped group's place goes to the next refill group with signal, in order; after
                  `algorithm.dynamic_sampling_rounds` refill rounds, a place still open keeps its own group (no
                  signal, zero advantage): the batch is always full, and the rounds per batch bounded

Filtering reads the raw rewards (the verifier's, or an episode's return), never a shaped one (overlong shaping is
applied by the controller, after, to the advantages' rewards only: the bug NeMo-RL #2431 shows). The replacement
takes the dropped group's id, so the batch keeps its shape and group ids. Each part reports how many prompts it drew
and how many of its groups have signal (`sampling/*` in the metrics row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

REFILL_BASE = 20_000_000  # refill batches' indices: apart from training batches and the warm start's (10_000_000 + k)
MAX_ROUNDS = 64  # refill rounds a batch can have (algorithm.dynamic_sampling_rounds is at most this)


def refill_index(batch: int, round_: int) -> int:
    """The task's batch index whose prompts refill round `round_` (>= 1) of training batch `batch` draws."""
    return REFILL_BASE + batch * MAX_ROUNDS + round_


def has_signal(rewards: list[float]) -> bool:
    """Do a group's raw rewards differ (a group-relative advantage that is not all zero)?"""
    return max(rewards) != min(rewards)


@dataclass
class SampledGroup:
    """One prompt's samples on the replica's leader: the record, its group id in the batch, its outputs and raw
    rewards (one per sample), its prompt's index in the batch it was drawn from, and that batch's index."""

    record: object
    group: int
    outputs: list
    rewards: list[float]
    drawn_from: int


def fill(first: Optional[list[SampledGroup]], draw: Callable[[int, int], Optional[list[SampledGroup]]],
         share: Callable[[Optional[int]], int], rounds: int) -> tuple[Optional[list[SampledGroup]], dict]:
    """The replica's groups with every place of a group without signal refilled (module docstring). Every rank of
    the replica calls it: `first` is the leader's round 0 (None elsewhere), `draw(round, count)` samples and scores
    `count` refill prompts (collective; the leader gets them, other ranks None), `share(x)` broadcasts the leader's
    x. Returns (the leader's groups in place order, None elsewhere; {"prompts_drawn", "groups", "with_signal"})."""
    leader = first is not None
    places = list(first) if leader else []
    open_ = [i for i, g in enumerate(places) if not has_signal(g.rewards)]
    drawn = len(places)
    for round_ in range(1, rounds + 1):
        missing = share(len(open_) if leader else None)
        if missing == 0:
            break
        got = draw(round_, missing)
        if not leader:
            continue
        drawn += len(got)
        for g in got:
            if has_signal(g.rewards) and open_:
                i = open_.pop(0)
                g.group = places[i].group
                places[i] = g
    report = {"prompts_drawn": drawn, "groups": len(places), "with_signal": sum(has_signal(g.rewards) for g in places)}
    return (places if leader else None), report


def occupancy_over(rounds: list[dict]) -> Optional[float]:
    """The slot occupancy of a batch's rounds together (each round's `Generator.stats`: occupied slot-steps over
    all slot-steps); None where no round recorded one (a pipelined generator)."""
    runs = [(s["occupancy"], s["slot_steps"]) for s in rounds if s.get("occupancy") is not None and s.get("slot_steps")]
    return sum(o * n for o, n in runs) / sum(n for _, n in runs) if runs else None
