"""Every element of every tensor in a dist checkpoint is in exactly one of its saved chunks.

torch's distributed-checkpoint load reads the chunks that the index (`.metadata`) lists for each tensor and leaves
the rest of the tensor as it was: an index that misses a chunk (a lost or partial copy, a save that went wrong)
loads without a word, with those elements holding the freshly built model's values, and a chunk listed twice
makes the value depend on which one is read. Megatron-Core validates the sharding when it saves, on rank 0, and
skips uneven shardings there (the optimizer's pieces, `optimizer_state.py`). This check reads only the index, so
it is the same whatever layout the checkpoint is then loaded into: if the chunks of each tensor tile its global
shape exactly, every rank of any layout finds each element it needs exactly once.

How: per tensor, the chunk boundaries along each dimension cut its shape into a grid of cells (a few per
dimension for TP/PP/DP splits, even for the optimizer's uneven pieces); every cell lies wholly inside or outside
each chunk, so counting the chunks over each cell (numpy slices) finds the first cell in none or in several, which
is what the one-line error names.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from megatron_rl.checkpointing.layout import DCP_METADATA, CheckpointError

MAX_CELLS = 1 << 24  # a grid larger than this (no real sharding comes close) is checked by volume alone


def range_text(lo: Iterable[int], hi: Iterable[int]) -> str:
    """Elements [lo, hi) of a tensor as the lines name them: `[a:b, c:d]`."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def tensor_problem(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Optional[str]:
    """How `chunks` ((offsets, sizes) each) fail to tile a tensor of `shape` exactly once, in a phrase naming the
    first range of elements that is in no chunk or in several (or a chunk outside the shape); None when they do."""
    shape = tuple(int(s) for s in shape)
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return (f"chunk {range_text(offsets, [o + s for o, s in zip(offsets, sizes)])} lies outside its "
                    f"shape {list(shape)}")
    if not shape:  # a scalar: one chunk holds it
        return None if len(chunks) == 1 else f"is saved {len(chunks)} times" if chunks else "is in no chunk"
    cuts = []
    for d, n in enumerate(shape):
        edges = {0, n}
        for offsets, sizes in chunks:
            edges.update((offsets[d], offsets[d] + sizes[d]))
        cuts.append(np.array(sorted(edges), dtype=np.int64))
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_CELLS:
        total = sum(math.prod(s) for _, s in chunks)
        need = math.prod(shape)
        return None if total == need else f"its chunks hold {total} elements of {need}"
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for offsets, sizes in chunks:
        index = tuple(slice(int(np.searchsorted(c, o)), int(np.searchsorted(c, o + s)))
                      for c, o, s in zip(cuts, offsets, sizes))
        count[index] += 1
    for bad, what in ((count == 0, "in no saved chunk"), (count > 1, "in more than one saved chunk")):
        found = np.argwhere(bad)
        if len(found):
            cell = found[0]
            lo = [int(c[i]) for c, i in zip(cuts, cell)]
            hi = [int(c[i + 1]) for c, i in zip(cuts, cell)]
            return f"elements {range_text(lo, hi)} of {list(shape)} are {what}"
    return None


def coverage_problems(md) -> list[str]:
    """`tensor_problem` of every tensor of torch DCP `Metadata` `md`, as "key: phrase"."""
    out = []
    for key, entry in md.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is None:  # a saved object (BytesStorageMetadata): present by its key
            continue
        problem = tensor_problem(tuple(entry.size), [(tuple(c.offsets), tuple(c.sizes)) for c in chunks])
        if problem is not None:
            out.append(f"{key}: {problem}")
    return out


def check_coverage(d: Path, md) -> None:
    """CheckpointError naming the first tensor of directory `d` whose chunks (index `md`) do not cover it exactly
    once, and how many more, in one line."""
    problems = coverage_problems(md)
    if problems:
        more = f" (and {len(problems) - 1} more tensors)" if len(problems) > 1 else ""
        raise CheckpointError(f"{Path(d) / DCP_METADATA}: {problems[0]}{more}; a load would leave those elements "
                              f"as the new model holds them")
