"""The deterministic asynchronous schedule.

Version v means "the weights after v trainer steps". Trainer step k trains on batch k and produces version k + 1.
With a staleness bound s, batch k is generated with version max(0, k - s): for s = 1 the generator produces batch
k while the trainer trains on batch k - 1, and AIPO corrects for the one-version lag. s = 0 is the synchronous,
on-policy baseline (generate, then train). Because the version of every batch is fixed in advance, runs are
reproducible and a resumed run regenerates exactly the batches that were in flight.

Weight syncs: the generator needs version v before generating batch v + s, so after trainer step v - 1 the trainer
pushes version v if some later batch needs it (v + s <= last batch).
"""

from __future__ import annotations


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
