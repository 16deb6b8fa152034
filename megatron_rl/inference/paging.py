"""Which cache blocks each sequence holds, for a generator whose KV cache is paged (`kv_forward.PagedKVCache`).

A slot cache gives every sequence the longest sequence's memory from the start; with lengths spread from a hundred
tokens to thousands, most of it holds nothing. A paged cache gives a sequence blocks of `block_size` positions as it
grows and takes them back when it ends, so the cache holds about as many tokens as the sequences in it have, and the
generator decodes more sequences at once in the same memory.

The generator (`inference/generator.py`) asks this pool, between decode steps: `admits` (are there blocks for a new
sequence's history, keeping one block of growth for each running sequence?), `grow` (the blocks a running sequence
needs for its next position), `release` (a sequence ended, or was preempted). When the running sequences outgrow the
cache, the generator preempts the one admitted last: its blocks go back, and it waits to be admitted again, its
history (prompt and tokens so far) prefilled then (its sampling stream continues where it stopped: its tokens are the
same as without preemption, up to the rounding of a prefill against the decode steps that first computed its cache).
"""

from __future__ import annotations

import torch

from megatron_rl.inference.kv_forward import PagedKVCache


class BlockPool:
    """The blocks of a `PagedKVCache` and the table that maps each slot's positions to them (block 0: scratch).
    Every decision is made on the host, from the sequences' lengths; the table is written to the device as it
    changes (a row at a time)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.block_size = cache.block_size
        self.free = list(range(cache.blocks, 0, -1))  # popped from the end: block 1 first
        self.held: dict[int, list[int]] = {}  # slot -> its blocks, in position order
        self.peak = 0  # the most blocks held at once
        cache.table.zero_()  # every slot at scratch: a batch starts with the whole cache free, whatever came before

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def missing(self, slot: int, tokens: int) -> int:
        """Blocks `slot` lacks to hold positions 0..tokens-1."""
        return max(0, self.blocks_for(tokens) - len(self.held.get(slot, ())))

    def admits(self, tokens: int, running: int) -> bool:
        """Can a new sequence of `tokens` positions start, leaving a block of growth for each of `running`
        sequences?"""
        return self.blocks_for(tokens) + running <= len(self.free)

    def fits(self, tokens: int) -> bool:
        """Could a sequence of `tokens` positions ever be held (the whole cache to itself)?"""
        return self.blocks_for(tokens) <= self.cache.blocks

    def grow(self, slot: int, tokens: int) -> None:
        """Give `slot` the blocks it lacks for positions 0..tokens-1 (the caller checked `missing` against
        `free`)."""
        blocks = self.held.setdefault(slot, [])
        start = len(blocks)
        while len(blocks) < self.blocks_for(tokens):
            blocks.append(self.free.pop())
        if len(blocks) > start:
            self.cache.table[slot, start:len(blocks)] = torch.tensor(blocks[start:], dtype=torch.long,
                                                                     device=self.cache.table.device)
        self.peak = max(self.peak, self.cache.blocks - len(self.free))

    def release(self, slot: int) -> None:
        """`slot`'s sequence ended or was preempted: its blocks are free again, and its table row points at
        scratch."""
        blocks = self.held.pop(slot, [])
        if blocks:
            self.free.extend(reversed(blocks))
            self.cache.table[slot, :len(blocks)] = 0


    def restore(self, state: dict) -> None:
        """Hold the blocks a saved engine's pool held (`Engine.snapshot`), the table written to match."""
        self.cache.table.zero_()
        self.free, self.held, self.peak = list(state["free"]), {}, int(state["peak"])
        for slot, blocks in state["held"].items():
            self.held[int(slot)] = list(blocks)
            if blocks:
                self.cache.table[int(slot), :len(blocks)] = torch.tensor(blocks, dtype=torch.long,
                                                                        device=self.cache.table.device)
