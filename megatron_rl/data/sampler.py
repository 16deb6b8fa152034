"""Deterministic, resumable, sharded iteration over a prompt dataset.

A run killed at any moment must restart on the very next prompts, not replay or skip some, so the position in the
data is part of the checkpoint: `state_dict()` is a small dict of ints (epoch, position), `load_state_dict()` puts
it back. The order of an epoch is a pure function of (seed, epoch), so nothing else needs saving.

Sharding over data-parallel ranks: each epoch's order is cut into consecutive groups of `world_size` items and rank
r takes item r of each group. All ranks advance in lockstep, so the state counts global items consumed; that makes a
checkpoint resumable on a different number of ranks (the new ranks continue from the same global position).
When the dataset size is not a multiple of `world_size`, the epoch is padded by repeating its first items (every
rank gets the same number of prompts), or cut short with `drop_last=True`.
"""

from __future__ import annotations

import random
from typing import Iterator


class ResumableSampler:
    """Indices into a dataset of `num_items`, epoch after epoch, for one data-parallel rank."""

    def __init__(self, num_items: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        if num_items < 1:
            raise ValueError(f"num_items={num_items} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if drop_last and num_items < world_size:
            raise ValueError(f"drop_last with {num_items} items and world_size={world_size} leaves every epoch empty")
        self.num_items = num_items
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # global items of this epoch already taken, by all ranks together
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def global_epoch_size(self) -> int:
        """Items per epoch over all ranks (padded or cut to a multiple of world_size)."""
        w = self.world_size
        return (self.num_items // w) * w if self.drop_last else -(-self.num_items // w) * w

    def __len__(self) -> int:
        """Items per epoch for this rank."""
        return self.global_epoch_size // self.world_size

    @property
    def position(self) -> int:
        """Items of the current epoch this rank has taken."""
        return self.consumed // self.world_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The global order of an epoch: a permutation from (seed, epoch), padded or cut to the epoch size."""
        if epoch != self._order_epoch:
            order = list(range(self.num_items))
            if self.shuffle:
                random.Random(f"sampler:{self.seed}:{epoch}").shuffle(order)
            size = self.global_epoch_size
            while len(order) < size:  # pad by repeating from the start (fewer than world_size items)
                order += order[:size - len(order)]
            self._order, self._order_epoch = order[:size], epoch
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """This rank's next `n` indices, running into the next epoch (reshuffled) as needed."""
        out = []
        while len(out) < n:
            if self.consumed >= self.global_epoch_size:
                self.epoch += 1
                self.consumed = 0
            order = self.epoch_order(self.epoch)
            out.append(order[self.consumed + self.rank])
            self.consumed += self.world_size
        return out

    def __iter__(self) -> Iterator[int]:
        """Endless: RL runs count steps, not epochs."""
        while True:
            yield self.next_indices(1)[0]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "num_items": self.num_items,
                "shuffle": self.shuffle, "world_size": self.world_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`. The dataset and seed must match; the number of ranks may differ (the global
        position is kept, rounded down to a whole group of the new world size)."""
        for key in ("seed", "num_items", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; it belongs to a different dataset or run")
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or consumed < 0:
            raise ValueError(f"sampler state has a negative position: {state}")
        self.epoch = epoch
        self.consumed = min((consumed // self.world_size) * self.world_size, self.global_epoch_size)
