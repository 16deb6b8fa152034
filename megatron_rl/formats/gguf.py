"""A GGUF file read without transformers: its key-value metadata, its tensor index, and each tensor dequantized to
fp32 when it is asked for (gguf's own dequantizers, the ones transformers calls).

Why not transformers' GGUF loader: it parses the whole file with gguf's `GGUFReader`, which builds a numpy view per
item of every array (SmolLM2's 49,152 tokens and 48,900 merges: 3.9-4.1 s on the idle 2-core test machine), and it
does so once for the config, once for the model and once more for the tokenizer, then holds the dequantized model in
memory at once. Here the header is read with `struct` in one pass (0.15-0.25 s for the same file, measured beside
it: docs/dependencies.md), and a conversion holds one tensor at a time.

What a GGUF Llama means in Hugging Face terms (names, config, llama.cpp's Q/K row order) is
`checkpointing/hf_sources.py`'s.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF value types: struct format of each scalar type (7 is bool, 8 string, 9 array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class GGUFError(ValueError):
    """A file that is not a GGUF file this reader understands; the message says what is wrong, in one line."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the index: its ggml type, its shape in torch's order (GGUF lists the fastest dimension
    first), and where its bytes lie in the file."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError("the header runs past the end of the file (truncated?)")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"the header runs past the end of the file (truncated?): a string of {n} bytes")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt) * count
                if self.pos + size > len(self.buf):
                    raise GGUFError(f"the header runs past the end of the file (truncated?): an array of {count} "
                                    f"items")
                values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
                self.pos += size
                return values
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {vtype}")


class GGUFFile:
    """A GGUF file's header, read at construction (metadata and tensor index, no tensor data); `tensor(name)` reads
    and dequantizes one tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                buf = memoryview(mapped)
                try:
                    self._parse(buf)
                finally:
                    buf.release()
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}") from None
        except (struct.error, OSError, ValueError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GGUFError(f"{self.path}: unreadable GGUF header ({reason})") from None

    def _parse(self, buf) -> None:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFError("not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.take("I")
        if self.version < 2:
            raise GGUFError(f"GGUF version {self.version} is not supported (2 or newer)")
        n_tensors, n_fields = cur.take("Q"), cur.take("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("Q") for _ in range(cur.take("I"))]
            infos.append((name, dims, cur.take("I"), cur.take("Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, offset in infos:
            nbytes = _tensor_bytes(name, dims, ggml_type)
            if start + offset + nbytes > size:
                raise GGUFError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = GGUFTensor(name, ggml_type, tuple(int(d) for d in reversed(dims)), start + offset,
                                            nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` dequantized to fp32, in torch's shape."""
        from gguf.quants import dequantize

        info = self.tensors[name]
        raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        values = dequantize(raw.reshape(rows, -1), info.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape))


def _tensor_bytes(name: str, dims: list[int], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name} has ggml type {ggml_type}, which gguf {_gguf_version()} does not "
                        f"know") from None
    count = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFError(f"tensor {name}: rows of {dims[0]} values do not fill blocks of {block}")
    return count // block * type_size


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"
