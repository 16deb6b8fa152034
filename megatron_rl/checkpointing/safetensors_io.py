"""Streaming safetensors: write sharded files one tensor at a time, read tensors lazily.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range;
padded with spaces to a multiple of 8) and the raw little-endian tensor bytes. When every tensor's name, dtype
and shape is known before the data (as in a conversion, where they follow from the model shape), the header can be
written first and each tensor appended as soon as it is produced, so a writer never holds more than one tensor.
Reading goes through `safetensors.safe_open`, which reads one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """One safetensors file with a known list of tensors, written in that order by `write`."""

    def __init__(self, path: Path, entries: list[Entry], metadata: Optional[dict[str, str]] = None):
        self.path = Path(path)
        self.entries = list(entries)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in self.entries:
            if dtype not in DTYPE_CODES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": [int(s) for s in shape],
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(text)))
        self._f.write(text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path.name}: unexpected tensor {name!r} (all {len(self.entries)} written)")
        want_name, dtype, shape = self.entries[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path.name}: expected {want_name} {dtype} {list(shape)}, got {name} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        t = tensor.detach().cpu().contiguous()
        if t.numel():
            self._f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            missing = self.entries[self._next][0]
            self._f.close()
            raise ValueError(f"{self.path.name}: closed before {missing!r} was written")
        self._f.close()


def plan_shards(entries: list[Entry], shard_bytes: int) -> list[list[Entry]]:
    """Split entries, in order, into shards of at most `shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        b = nbytes(e[1], e[2])
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += b
    return shards


def write_sharded(dst: Path, entries: list[Entry], tensors: Iterable[tuple[str, torch.Tensor]],
                  shard_bytes: int, prefix: str = "model") -> dict:
    """Write `tensors` (an iterator yielding exactly `entries`' names in order) as HF-style shards plus
    `{prefix}.safetensors.index.json`; returns the index. Holds one tensor at a time."""
    shards = plan_shards(entries, shard_bytes)
    index: dict = {"metadata": {"total_size": sum(nbytes(e[1], e[2]) for e in entries)}, "weight_map": {}}
    it: Iterator = iter(tensors)
    for i, shard in enumerate(shards):
        fname = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(Path(dst) / fname, shard)
        for name, _, _ in shard:
            got_name, t = next(it)
            writer.write(got_name, t)
            del t
            index["weight_map"][name] = fname
        writer.close()
    for extra in it:
        raise ValueError(f"tensor {extra[0]!r} was produced but not planned")
    (Path(dst) / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype code, shape) of one safetensors file, from its header (and the file size) only."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"implausible header length {n}")
        text = f.read(n)
        if len(text) != n:
            raise ValueError("truncated header")
    header = json.loads(text)
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    size = Path(path).stat().st_size
    if size < 8 + n + end:
        raise ValueError(f"truncated: {size} bytes, the header describes {8 + n + end}")
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
