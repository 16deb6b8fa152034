"""How a resume reads a training checkpoint: each byte once, by one rank.

Megatron-Core's default load (torch_dist) has every rank read everything it needs: every data-parallel replica
reads its model-parallel shard's weights (the bytes read grow with DP), and torch's `FileSystemReader` reads each
saved chunk whole (`torch.load` of the chunk's zip) before it narrows it to the region asked for. Here:

- `chunk_read_ranges` and `read_owners`: the two rules, pure (the loader follows them, `resume-check` uses them to
  predict what it reads): the byte ranges of a chunk read for a region; which DP rank reads each replicated tensor
  (the one that wrote it: `megatron_state.spread_replicas` uses the same rule);
- `ReadCount`: the bytes a rank read, as the loader counts them.

The loader itself (a byte-range reader, the fully parallel load) is `loader.py`'s; this module imports nothing
beyond the standard library, so that whatever predicts a load can use the rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator

# Runs of a chunk closer than this are read as one: one read instead of two, for at most this many extra bytes.
MERGE_GAP = 64


def runs(chunk_sizes: tuple[int, ...], itemsize: int, offsets: tuple[int, ...],
         lengths: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(start, length) in bytes of each contiguous run of the region [offsets, offsets + lengths) in a chunk's
    row-major data, in order, before any merging (`chunk_read_ranges` merges them; a region with an empty
    dimension has none)."""
    if any(n == 0 for n in lengths):
        return
    if not chunk_sizes:
        yield 0, itemsize
        return
    # The region is contiguous over the trailing dimensions it covers whole, and over the one before them (`k`):
    # each index of the dimensions before `k` gives one run.
    strides = [itemsize * math.prod(chunk_sizes[d + 1:]) for d in range(len(chunk_sizes))]
    k = len(chunk_sizes) - 1
    while k > 0 and offsets[k] == 0 and lengths[k] == chunk_sizes[k]:
        k -= 1
    run, base = lengths[k] * strides[k], offsets[k] * strides[k]
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:k], lengths[:k]))):
        yield base + sum(i * s for i, s in zip(index, strides)), run


def chunk_read_ranges(chunk_sizes: tuple[int, ...], itemsize: int, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, length) byte ranges, relative to the first byte of a saved chunk's row-major contiguous data, that the reader reads for the region [offsets, offsets + lengths) of a chunk of shape `chunk_sizes`: contiguous runs, runs closer than a small gap merged (one rule, used by the reader and by resume-check to predict it)."""
    if len(chunk_sizes) != len(offsets) or len(offsets) != len(lengths):
        raise ValueError(f"region {offsets}+{lengths} does not match the chunk's dimensions {chunk_sizes}")
    for size, off, n in zip(chunk_sizes, offsets, lengths):
        if off < 0 or n < 0 or off + n > size:
            raise ValueError(f"region {offsets}+{lengths} is outside the chunk {chunk_sizes}")
    if any(n == 0 for n in lengths):
        return []
    ranges: list[list[int]] = []
    for start, run in runs(chunk_sizes, itemsize, offsets, lengths):
        if ranges and start - (ranges[-1][0] + ranges[-1][1]) < MERGE_GAP:
            ranges[-1][1] = start + run - ranges[-1][0]
        else:
            ranges.append([start, run])
    return [(start, n) for start, n in ranges]


def read_owners(sizes: list[tuple[str, tuple[int, ...], int]], group_size: int) -> list[int]:
    """For the replicated tensors of one model-parallel shard, given as (key, global_offset, nbytes), which rank of the data-parallel group reads each from disk (the others receive it): the same greedy balance as `megatron_state.spread_replicas` (largest first, then key and offset, to the least-loaded rank). Every DP rank computes it alone."""
    owners = [0] * len(sizes)
    loads = [0] * group_size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i][2], sizes[i][0], tuple(sizes[i][1]))):
        owner = min(range(group_size), key=lambda r: (loads[r], r))
        loads[owner] += sizes[i][2]
        owners[i] = owner
    return owners


@dataclasses.dataclass
class ReadCount:
    """Bytes a rank read from checkpoint files: `data`, of tensors' stored values (the `chunk_read_ranges` of each
    region; the whole storage where a chunk is read whole); `header`, the rest (what was read to find the data in
    each chunk, the objects' bytes)."""

    data: int = 0
    header: int = 0

    @property
    def total(self) -> int:
        return self.data + self.header
