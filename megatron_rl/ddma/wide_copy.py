"""Copy a slice between tensors of one dtype as the widest element type both views allow.

Most of a reshard is slices whose rows are contiguous but whose rows are not adjacent: the column slices of
row-parallel weights (`linear_proj`, `linear_fc2`) between TP degrees, a third of a Llama's bytes. PyTorch's copy
kernel handles a strided view element by element (an offset computation and, for bf16, a 2-byte access per
element), and benchmarks/ddma.py measured the whole reshard at 0.62-0.67 of a plain device copy on an H100.
Reinterpreting both views as 16-byte elements (complex128; 8 or 4 bytes when the row length or offsets do not
allow 16) moves the same bytes with 8x fewer elements for bf16. Whether that closes the gap on a GPU is not
measured yet (the benchmark reports both); on a CPU it changes nothing (docs/benchmarks.md). The bytes are copied
unchanged, so the result is bit-identical to a copy in the original dtype; no arithmetic is done in the wide type.
"""

from __future__ import annotations

import torch

# Widest first. complex128 is the only 16-byte dtype torch has; a copy between tensors of one dtype moves the
# bytes unchanged whatever the type.
_WIDE = (torch.complex128, torch.int64, torch.int32)


def _allows(t: torch.Tensor, size: int) -> bool:
    """`t.view(dtype)` with a `size`-byte dtype is legal: unit stride in the last dimension, and its byte length,
    offset and every other stride (in bytes) divisible by `size`."""
    e = t.element_size()
    if t.dim() == 0 or t.stride(-1) != 1 or t.shape[-1] * e % size or t.storage_offset() * e % size:
        return False
    return all(s * e % size == 0 for s in t.stride()[:-1])


def wide_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dst` and `src` reinterpreted as the widest dtype both allow (themselves when their dtypes differ, when no
    wider type fits, or when they are already at least that wide)."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.numel() == 0:
        return dst, src
    for dtype in _WIDE:
        size = dtype.itemsize
        if size <= dst.element_size():
            break
        if _allows(dst, size) and _allows(src, size):
            return dst.view(dtype), src.view(dtype)
    return dst, src


def copy_slice(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, as wide elements where the views allow (a cast when the dtypes differ)."""
    d, s = wide_views(dst, src)
    d.copy_(s)
