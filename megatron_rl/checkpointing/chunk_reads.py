"""Reading one saved chunk of a torch distributed checkpoint (a torch.save zip inside a `.distcp` file) the way
`checkpointing/loader.py: RangeReader` needs it: only the byte ranges of the region a rank loads.

    Slice              a file object over one chunk, with its first and last `HEADER_WINDOW` bytes held in memory
    head_layout        the tensor's layout from the first window alone (its pickle, read by a reader that builds
                       nothing, and its data record's local header), a guess that `confirmed` checks against the zip
                       directory at the chunk's end, read after the data so a chunk is read front to back
    chunk_layout       torch's own reading of the headers (torch.load on the meta device, zipfile): where the fast
                       parse declines, this decides
    read_region        a region read as `reads.chunk_read_ranges` says, straight into place where it can
    ReadAhead          a thread asking the kernel to read ahead the chunks a rank needs most of
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import os
import pickle
import re
import struct
import sys
import threading
import zipfile
from typing import Optional

import torch

from megatron_rl.checkpointing.reads import chunk_read_ranges, runs

HEADER_WINDOW = 4096  # bytes at each end of a chunk read at once for its headers


class Slice(io.RawIOBase):
    """A read-only file object over bytes [offset, offset + length) of an open file, counting the bytes it reads
    from the file (positioned reads, so several slices may share the descriptor). `with_headers` reads the first and
    last `HEADER_WINDOW` bytes at once and serves the reads inside them from memory: the zip's records before the
    data and its directory after it, in two reads instead of some twenty small ones."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.offset, self.length = fd, offset, length
        self.pos = self.read_bytes = 0
        self.windows: list[tuple[int, bytes]] = []

    def with_headers(self) -> "Slice":
        return self.with_head().with_tail()

    def with_head(self) -> "Slice":
        """The window at the slice's start (the zip's first records: the tensor's pickle, the data's local header)."""
        if not self.windows:
            self._window(0, min(HEADER_WINDOW, self.length))
        return self

    def with_tail(self) -> "Slice":
        """The window at the slice's end (the zip's directory), where the head's window does not reach it."""
        self.with_head()
        head_end = len(self.windows[0][1])
        tail = max(self.length - HEADER_WINDOW, head_end)
        if tail < self.length and all(start != tail for start, _ in self.windows):
            self._window(tail, self.length - tail)
        return self

    def _window(self, start: int, n: int) -> None:
        self.windows.append((start, os.pread(self.fd, n, self.offset + start)))
        self.read_bytes += len(self.windows[-1][1])

    def peek(self, start: int, n: int) -> Optional[bytes]:
        """Bytes [start, start + n) of the slice where a header window holds them all, else None."""
        for at, data in self.windows:
            if at <= start and start + n <= at + len(data):
                return data[start - at:start - at + n]
        return None

    def peek_end(self) -> tuple[int, bytes]:
        """The last window and where it starts (the head's, for a slice no longer than it)."""
        return self.windows[-1] if self.windows else (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos + (0, self.pos, self.length)[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        out = memoryview(buffer).cast("B")[:n]
        for start, data in self.windows:
            if start <= self.pos and self.pos + n <= start + len(data):
                out[:] = data[self.pos - start:self.pos - start + n]
                break
        else:
            n = _pread_into(self.fd, out, self.offset + self.pos)
            self.read_bytes += n
        self.pos += n
        return n


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill `buffer` from the file at `offset`; fewer bytes only at the file's end."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """A chunk the fast path reads: a contiguous row-major tensor of `shape` and `dtype` whose first element is at
    byte `start` of the chunk."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int


_STORAGE_RECORD = re.compile(r"[^/]+/data/\d+")


def chunk_layout(chunk: Slice) -> Optional[ChunkLayout]:
    """The layout of a chunk (a torch.save zip) from its headers alone (the pickle and the zip directory, a few KB),
    or None where the fast path does not apply."""
    chunk.seek(0)
    meta = torch.load(chunk, map_location="meta", weights_only=True)  # shape, strides, storage offset; no data
    if not isinstance(meta, torch.Tensor) or not meta.is_contiguous():
        return None
    chunk.seek(0)
    with zipfile.ZipFile(chunk) as zf:
        infos = zf.infolist()
        storages = [i for i in infos if _STORAGE_RECORD.fullmatch(i.filename)]
        if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
            return None
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if order and zf.read(order[0]).decode() != sys.byteorder:
            return None
        info = storages[0]
    itemsize = meta.element_size()
    if (meta.storage_offset() + meta.numel()) * itemsize > info.file_size:
        return None
    chunk.seek(info.header_offset)
    header = chunk.read(30)  # the record's local header: its name and extra field precede the data
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len + meta.storage_offset() * itemsize
    return ChunkLayout(tuple(meta.shape), meta.dtype, start)


# The storage classes a tensor's pickle names (`torch.save`), by name: the element type of the storage.
_STORAGE_DTYPES = {f"{name}Storage": dtype for name, dtype in (
    ("Float", torch.float32), ("BFloat16", torch.bfloat16), ("Half", torch.float16), ("Double", torch.float64),
    ("Long", torch.int64), ("Int", torch.int32), ("Short", torch.int16), ("Char", torch.int8),
    ("Byte", torch.uint8), ("Bool", torch.bool))}


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    """What a tensor's pickle would rebuild (`torch._utils._rebuild_tensor_v2`'s arguments), as a description."""

    storage: tuple
    storage_offset: int
    size: tuple
    stride: tuple
    requires_grad: bool = False
    hooks: object = None
    metadata: object = None


class _TensorPickle(pickle.Unpickler):
    """The pickle of one saved tensor (torch.save's `data.pkl`) read as a description: the only names it may use are
    torch's tensor-rebuild function (replaced by `_Rebuilt`), the storage classes (replaced by their element type)
    and OrderedDict; nothing is built or called, and any other name refuses the pickle (the caller then takes
    torch's own path)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def _zip_records(headers: Slice) -> Optional[dict[str, tuple[int, int, int]]]:
    """A chunk's zip directory from its last header window: record name -> (compression, size, local header
    offset); None where the directory is not in the window or is a zip64 one."""
    base, tail = headers.peek_end()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    count, size, offset = struct.unpack("<HII", tail[at + 10:at + 20])
    if offset == 0xFFFFFFFF or count == 0xFFFF or offset < base or offset + size > base + at:
        return None
    records, pos = {}, offset - base
    for _ in range(count):
        if tail[pos:pos + 4] != b"PK\x01\x02":
            return None
        method, = struct.unpack("<H", tail[pos + 10:pos + 12])
        csize, usize, n, e, c = struct.unpack("<IIHHH", tail[pos + 20:pos + 34])
        local, = struct.unpack("<I", tail[pos + 42:pos + 46])
        if csize != usize or 0xFFFFFFFF in (csize, local):
            return None
        records[tail[pos + 46:pos + 46 + n].decode("utf-8", "replace")] = (method, usize, local)
        pos += 46 + n + e + c
    return records


def _local_record(headers: Slice, local: int) -> Optional[tuple[str, int]]:
    """The name of the zip record whose local header is at `local` and where its data starts; None where the
    header is not in a window."""
    header = headers.peek(local, 30)
    if header is None or header[:4] != b"PK\x03\x04":
        return None
    n, e = struct.unpack("<HH", header[26:30])
    name = headers.peek(local + 30, n)
    return None if name is None else (name.decode("utf-8", "replace"), local + 30 + n + e)


@dataclasses.dataclass(frozen=True)
class _Guess:
    """A chunk's layout read from its first window (`head_layout`), and what its zip directory must then say for
    the layout to stand (`confirmed`)."""

    layout: ChunkLayout
    prefix: str  # the records' folder ("archive/")
    pickle_bytes: int  # the tensor's pickle, as far as its STOP
    data_record: str
    data_local: int  # the data record's local header
    data_bytes: int  # the bytes of the record the tensor needs


def head_layout(headers: Slice) -> Optional[_Guess]:
    """The layout of a chunk from its first window alone: the tensor's pickle (the zip's first record, read by
    `_TensorPickle`: nothing is built) and its data record's local header, found by name. A guess: torch.save's local
    headers carry no sizes, so the zip's directory at the chunk's end confirms it (`confirmed`), read after the
    data so that a chunk is read front to back. None where anything differs from a plain torch.save of one
    contiguous tensor."""
    first = _local_record(headers, 0)
    if first is None or not first[0].endswith("/data.pkl"):
        return None
    prefix, body = first[0][:-len("data.pkl")], first[1]
    window = headers.windows[0][1]
    stream = io.BytesIO(window[body:])
    try:
        rebuilt = _TensorPickle(stream).load()
    except Exception:  # noqa: BLE001 - cut off by the window, or anything unexpected: torch's path decides
        return None
    if not isinstance(rebuilt, _Rebuilt) or rebuilt.hooks or rebuilt.metadata is not None:
        return None
    storage, shape, stride = rebuilt.storage, rebuilt.size, rebuilt.stride
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"
            and isinstance(storage[1], torch.dtype) and isinstance(storage[2], str)):
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
               for x in (*shape, *stride, rebuilt.storage_offset)) or len(stride) != len(shape):
        return None
    if any(d > 1 and st != math.prod(shape[k + 1:]) for k, (d, st) in enumerate(zip(shape, stride))):
        return None  # not contiguous row-major
    name = f"{prefix}data/{storage[2]}"
    at = window.find(name.encode(), body + stream.tell())
    while at >= 30:
        found = _local_record(headers, at - 30)  # a local header whose name is this one
        if found is not None and found[0] == name:
            itemsize = torch.empty((), dtype=storage[1]).element_size()
            layout = ChunkLayout(tuple(shape), storage[1], found[1] + rebuilt.storage_offset * itemsize)
            return _Guess(layout, prefix, stream.tell(), name, at - 30,
                          (rebuilt.storage_offset + math.prod(shape)) * itemsize)
        at = window.find(name.encode(), at + 1)
    return None


def confirmed(headers: Slice, guess: _Guess) -> bool:
    """Does the chunk's zip directory (its tail window, `with_tail`) say what `guess` assumed: one tensor pickle,
    stored, first and of the length the pickle read; the data record stored where its local header was found,
    holding the bytes the tensor needs; this machine's byte order?"""
    records = _zip_records(headers.with_tail())
    if not records:
        return False
    pickles = [r for r in records if r.endswith("/data.pkl")]
    if pickles != [f"{guess.prefix}data.pkl"] or records[pickles[0]] != (zipfile.ZIP_STORED, guess.pickle_bytes, 0):
        return False
    method, size, local = records.get(guess.data_record, (None, 0, -1))
    if method != zipfile.ZIP_STORED or local != guess.data_local or size < guess.data_bytes:
        return False
    order = records.get(f"{guess.prefix}byteorder")
    if order is not None:
        where = _local_record(headers, order[2])
        text = headers.peek(where[1], order[1]) if where is not None and order[0] == zipfile.ZIP_STORED else None
        if text is None or text.decode(errors="replace") != sys.byteorder:
            return False
    return True


def fast_chunk_layout(headers: Slice) -> Optional[ChunkLayout]:
    """`chunk_layout` without torch.load and zipfile: `head_layout`, `confirmed` by the directory. None where
    anything differs from what a plain torch.save of one contiguous tensor writes (`chunk_layout` then decides)."""
    guess = head_layout(headers.with_head())
    return guess.layout if guess is not None and confirmed(headers, guess) else None


def read_region(chunk: Slice, layout: ChunkLayout, offsets: tuple[int, ...], lengths: tuple[int, ...],
                 into: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int]:
    """The region [offsets, offsets + lengths) of the chunk, read as `chunk_read_ranges` says: a range of one run
    straight into place, a range of merged runs through a buffer. The place is `into` where it can take the bytes
    as they are (a contiguous CPU tensor of the chunk's dtype and the region's shape), else a new tensor. Returns
    (tensor, bytes read)."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    if (into is not None and into.device.type == "cpu" and into.dtype == layout.dtype and into.is_contiguous()
            and tuple(into.shape) == tuple(lengths)):
        out = into.reshape(-1).view(torch.uint8)
    else:
        out = torch.empty(math.prod(lengths) * itemsize, dtype=torch.uint8)
    view = memoryview(out.numpy())
    region_runs = runs(layout.shape, itemsize, offsets, lengths)
    pos = read = 0
    for start, n in chunk_read_ranges(layout.shape, itemsize, offsets, lengths):
        at = chunk.offset + layout.start + start
        first, run = next(region_runs)
        if run == n:
            got = _pread_into(chunk.fd, view[pos:pos + n], at)
            pos += n
        else:
            buf = memoryview(bytearray(n))
            got = _pread_into(chunk.fd, buf, at)
            while True:
                view[pos:pos + run] = buf[first - start:first - start + run]
                pos += run
                if first + run == start + n:
                    break
                first, run = next(region_runs)
        if got != n:
            raise OSError(f"a checkpoint chunk ends early: {n} bytes at {at} asked for, {got} read")
        read += n
    return out.view(layout.dtype).reshape(lengths), read


PREFETCH_STEP = 16 << 20  # bytes the read-ahead asks the kernel for at a time


class ReadAhead:
    """A thread that asks the kernel to read `extents` ((path, offset, length), in the order they will be read)
    into the page cache ahead of the loader (POSIX_FADV_WILLNEED, `PREFETCH_STEP` at a time; the call releases the
    GIL), so that the disk streams while this thread's caller parses chunk headers and copies regions: a cold load
    costs about the larger of the two, not their sum. Where the platform has no posix_fadvise it does nothing; the
    loader's own reads read as before. `stop()` ends it early (the load is over)."""

    def __init__(self, extents: list[tuple[str, int, int]]):
        self._extents, self._stop = extents, threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-rl-read-ahead", daemon=True)
        if extents and hasattr(os, "posix_fadvise"):
            self._thread.start()

    def _run(self) -> None:
        fds: dict[str, int] = {}
        try:
            for path, offset, length in self._extents:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                for at in range(offset, offset + length, PREFETCH_STEP):
                    if self._stop.is_set():
                        return
                    os.posix_fadvise(fds[path], at, min(PREFETCH_STEP, offset + length - at), os.POSIX_FADV_WILLNEED)
        except OSError:  # a hint only: the loader's reads report what is wrong with the file
            return
        finally:
            for fd in fds.values():
                os.close(fd)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def chunk_numel(req, planner) -> int:
    """The elements of the saved chunk `req` reads from (from the index; 0 where it cannot be found, which reads
    it ahead)."""
    index = req.storage_index
    entry = planner.metadata.state_dict_metadata.get(index.fqn)
    chunks = getattr(entry, "chunks", None) or []
    if index.index is not None and index.index < len(chunks) and tuple(chunks[index.index].offsets) == \
            tuple(index.offset):
        return math.prod(chunks[index.index].sizes)
    return next((math.prod(c.sizes) for c in chunks if tuple(c.offsets) == tuple(index.offset)), 0)
