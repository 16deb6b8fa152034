"""The deterministic asynchronous schedule.

Version v means "the weights after v trainer steps". Trainer step k trains on batch k and produces version k + 1.
With a staleness bound s, batch k is generated with version max(0, k - s): for s = 1 the generator produces batch
k while the trainer trains on batch k - 1, and AIPO corrects for the one-version lag. s = 0 is the synchronous,
on-policy baseline (generate, then train). Because the version of every batch is fixed in advance, runs are
reproducible and a resumed run regenerates exactly the batches that were in flight.

With in-flight updates (`rollout.in_flight`) the job runs this schedule at s - 1 (`RolloutSettings.schedule_staleness`):
each batch's first sequences start while the batch before it drains, under that batch's version, so a sample's
oldest token is still at most s versions old.

Weight syncs: the generator needs version v before generating batch v + s, so after trainer step v - 1 the trainer
pushes version v if some later batch needs it (v + s <= last batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union


def generation_version(batch: int, staleness: int) -> int:
    return max(0, batch - staleness)


def syncs_needed(num_steps: int, staleness: int) -> list[int]:
    """Versions pushed to the generator during the run (version 0 is pushed before the first batch)."""
    return [v for v in range(1, num_steps) if v + staleness <= num_steps - 1]


def push_after_step(step: int, num_steps: int, staleness: int) -> bool:
    """Does the trainer push its new weights (version step + 1) after trainer step `step`?"""
    v = step + 1
    return v + staleness <= num_steps - 1


def pull_before_batch(batch: int, staleness: int) -> bool:
    """Does the generator receive new weights before generating `batch`?"""
    return batch - staleness >= 1 and generation_version(batch, staleness) != generation_version(batch - 1, staleness)


# ---- the whole job as one ordered list of actions -------------------------------------------------------------------
# Every rank walks the same list and performs the actions its roles take part in. Because the order is one total
# order shared by all ranks, collectives (weight pushes, checkpoints) meet in the same order everywhere, and the
# same list serves a colocated job (one rank does everything, in this order) and disjoint executors (the generator
# runs ahead, bounded by the pushes it must wait for).


@dataclass(frozen=True)
class PushWeights:
    """Trainer ranks send version `version`; generator ranks receive it (DDMA, a collective of both)."""

    version: int


@dataclass(frozen=True)
class Generate:
    """Generator ranks sample batch `batch` with weights `version`, score it and send it to the controller;
    with `evaluate`, they also measure the held-out reward."""

    batch: int
    version: int
    evaluate: bool


@dataclass(frozen=True)
class Train:
    """The controller turns batch `step`'s rollouts into advantages; trainer ranks take one AIPO step on it."""

    step: int


@dataclass(frozen=True)
class Checkpoint:
    """Every rank: save the state after `version` trainer steps (a collective of the whole world)."""

    version: int


Action = Union[PushWeights, Generate, Train, Checkpoint]


def save_after(step: int, num_steps: int, save_interval: int, save_final: bool = True) -> bool:
    """Is a checkpoint written after trainer step `step`? Every `save_interval` steps and, unless not
    `save_final`, after the last one (with `save_interval` 0, only after the last one: a finished run can always be
    extended)."""
    return (save_final and step == num_steps - 1) or (save_interval > 0 and (step + 1) % save_interval == 0)


def evaluate_at(batch: int, num_steps: int, eval_interval: int) -> bool:
    """Is the held-out reward measured with batch `batch`'s weights? Every `eval_interval` batches and the last."""
    return batch % max(eval_interval, 1) == 0 or batch == num_steps - 1


def job_plan(num_steps: int, staleness: int, *, start: int = 0, restored: Iterable[int] = (),
             save_interval: int = 0, save_final: bool = True, eval_interval: int = 1,
             fresh: bool = True) -> list[Action]:
    """The actions of a run that starts after `start` trainer steps, in the order every rank performs them.

    `restored`: batches whose rollouts came back with the checkpoint (generated before it, not again). `fresh`: the
    run starts from scratch, so the starting state (after any warm start) is saved as version 0 first, unless
    `save_interval` is 0 (only the final checkpoint; none with `save_final` false).

        [Checkpoint(0)]  PushWeights(start)  Generate(start .. start+s-1)
        for k in start .. n-1:  Generate(k+s)  Train(k)  [Checkpoint(k+1)]  [PushWeights(k+1)]

    Batch k is generated with version max(k - s, start) (`generation_version`, never older than the weights the
    run started from), and version v is pushed only if a later batch needs it (`push_after_step`).
    """
    restored = set(restored)

    def gen(b: int) -> list[Action]:
        if b in restored:
            return []
        return [Generate(b, max(generation_version(b, staleness), start), evaluate_at(b, num_steps, eval_interval))]

    plan: list[Action] = []
    if fresh and save_interval > 0:
        plan.append(Checkpoint(0))
    plan.append(PushWeights(start))
    for b in range(start, min(start + staleness, num_steps)):
        plan += gen(b)
    for k in range(start, num_steps):
        if k + staleness < num_steps:
            plan += gen(k + staleness)
        plan.append(Train(k))
        if save_after(k, num_steps, save_interval, save_final):
            plan.append(Checkpoint(k + 1))
        if push_after_step(k, num_steps, staleness):
            plan.append(PushWeights(k + 1))
    return plan
