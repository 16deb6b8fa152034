"""The loads of training checkpoints and model weights: each byte read once, by one rank (`reads.py`'s rules).

1. `RangeReader`: torch's `FileSystemReader`, except for tensors: a saved chunk is a torch.save zip inside a
   `.distcp` file, and where its headers show a contiguous storage (what our saves write: `HostStaging` copies
   each tensor out), the region a rank needs is read as `chunk_read_ranges` of its data instead of the whole
   chunk. Objects, chunks with a stream transform and any other layout (a view saved with its strides, several
   storages, compression, another byte order) take torch's path: the chunk read whole, then narrowed. It counts
   the bytes it reads (`ReadCount`). The headers are parsed from two small reads without torch.load where they
   are what torch.save writes (`_fast_chunk_layout`); each file is read forward, chunk by chunk, behind a thread
   that asks the kernel to read ahead the chunks a rank needs most of (`_ReadAhead`), so a cold load overlaps the
   disk with the parsing and copying.
2. `RangeLoadStrategy`: Megatron-Core's torch_dist load strategy with that reader.
3. `ParallelLoadStrategy`: the ShardedTensors that several ranks of a data-parallel group hold alike (model weights
   and the KL reference's on every rank; a mixture of experts' experts on each expert-data-parallel group's) are
   read by one of their holders each (`read_owners`) and sent to the others (a broadcast where all hold them), in
   buckets of at most `BUCKET_BYTES`, on the device the tensors live on (the group's backend moves them: gloo on
   CPU, NCCL on GPU); everything else (the distributed optimizer's pieces, objects) is read by the ranks that need
   it.
4. `resume_strategy`: the two together, what the loads pass to `dist_checkpointing.load`.

Every rank ends with the values a plain `dist_checkpointing.load` gives it (the tests check bit-equality).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import itertools
import math
import os
import pickle
import re
import struct
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import torch.distributed as dist

import megatron_rl.compat.megatron_core  # noqa: F401 - before Megatron-Core (tests/test_compat.py says why)
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader)
from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner, TorchDistLoadShardedStrategy,
                                                               _replace_sharded_keys_with_state_dict_keys,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               _restore_dict_types, _unwrap_pyt_sharded_tensor,
                                                               mcore_to_pyt_state_dict)
from torch.distributed import checkpoint
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megatron_rl.checkpointing.reads import ReadCount, chunk_read_ranges, read_owners, runs

# The broadcasts of replicated tensors are coalesced into buffers of at most this size (a larger tensor goes alone).
BUCKET_BYTES = 256 << 20
_ALIGN = 16  # bytes: every tensor of a bucket starts at a multiple of this (any dtype's view of it is aligned)
HEADER_WINDOW = 4096  # bytes at each end of a chunk read at once for its headers


# ---- 1. the reader ---------------------------------------------------------------------------------------------
class _Slice(io.RawIOBase):
    """A read-only file object over bytes [offset, offset + length) of an open file, counting the bytes it reads
    from the file (positioned reads, so several slices may share the descriptor). `with_headers` reads the first and
    last `HEADER_WINDOW` bytes at once and serves the reads inside them from memory: the zip's records before the
    data and its directory after it, in two reads instead of some twenty small ones."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.offset, self.length = fd, offset, length
        self.pos = self.read_bytes = 0
        self.windows: list[tuple[int, bytes]] = []

    def with_headers(self) -> "_Slice":
        return self.with_head().with_tail()

    def with_head(self) -> "_Slice":
        """The window at the slice's start (the zip's first records: the tensor's pickle, the data's local header)."""
        if not self.windows:
            self._window(0, min(HEADER_WINDOW, self.length))
        return self

    def with_tail(self) -> "_Slice":
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
class _ChunkLayout:
    """A chunk the fast path reads: a contiguous row-major tensor of `shape` and `dtype` whose first element is at
    byte `start` of the chunk."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int


_STORAGE_RECORD = re.compile(r"[^/]+/data/\d+")


def _chunk_layout(chunk: _Slice) -> Optional[_ChunkLayout]:
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
    return _ChunkLayout(tuple(meta.shape), meta.dtype, start)


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


def _zip_records(headers: _Slice) -> Optional[dict[str, tuple[int, int, int]]]:
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


def _local_record(headers: _Slice, local: int) -> Optional[tuple[str, int]]:
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
    """A chunk's layout read from its first window (`_head_layout`), and what its zip directory must then say for
    the layout to stand (`_confirmed`)."""

    layout: _ChunkLayout
    prefix: str  # the records' folder ("archive/")
    pickle_bytes: int  # the tensor's pickle, as far as its STOP
    data_record: str
    data_local: int  # the data record's local header
    data_bytes: int  # the bytes of the record the tensor needs


def _head_layout(headers: _Slice) -> Optional[_Guess]:
    """The layout of a chunk from its first window alone: the tensor's pickle (the zip's first record, read by
    `_TensorPickle`: nothing is built) and its data record's local header, found by name. A guess: torch.save's local
    headers carry no sizes, so the zip's directory at the chunk's end confirms it (`_confirmed`), read after the
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
            layout = _ChunkLayout(tuple(shape), storage[1], found[1] + rebuilt.storage_offset * itemsize)
            return _Guess(layout, prefix, stream.tell(), name, at - 30,
                          (rebuilt.storage_offset + math.prod(shape)) * itemsize)
        at = window.find(name.encode(), at + 1)
    return None


def _confirmed(headers: _Slice, guess: _Guess) -> bool:
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


def _fast_chunk_layout(headers: _Slice) -> Optional[_ChunkLayout]:
    """`_chunk_layout` without torch.load and zipfile: `_head_layout`, `_confirmed` by the directory. None where
    anything differs from what a plain torch.save of one contiguous tensor writes (`_chunk_layout` then decides)."""
    guess = _head_layout(headers.with_head())
    return guess.layout if guess is not None and _confirmed(headers, guess) else None


def _read_region(chunk: _Slice, layout: _ChunkLayout, offsets: tuple[int, ...], lengths: tuple[int, ...],
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
READ_THREADS = 2  # threads that read a file's regions into place


class _ReadAhead:
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


def _chunk_numel(req, planner) -> int:
    """The elements of the saved chunk `req` reads from (from the index; 0 where it cannot be found, which reads
    it ahead)."""
    index = req.storage_index
    entry = planner.metadata.state_dict_metadata.get(index.fqn)
    chunks = getattr(entry, "chunks", None) or []
    if index.index is not None and index.index < len(chunks) and tuple(chunks[index.index].offsets) == \
            tuple(index.offset):
        return math.prod(chunks[index.index].sizes)
    return next((math.prod(c.sizes) for c in chunks if tuple(c.offsets) == tuple(index.offset)), 0)


class RangeReader(CachedMetadataFileSystemReader):
    """torch's `FileSystemReader` (Megatron-Core's, which caches the metadata) reading only the byte ranges of each
    chunk that the load needs, adding the bytes it reads to `count`. With `whole_chunks`, every tensor is read as
    torch reads it (the whole chunk), counted the same way: the baseline to compare with."""

    def __init__(self, path, count: ReadCount, whole_chunks: bool = False):
        super().__init__(path)
        self.count = count
        self.whole_chunks = whole_chunks

    def read_data(self, plan, planner) -> Future:
        torch_path, per_file = [], {}
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                torch_path.append(req)
                if req.type == LoadItemType.BYTE_IO:
                    self.count.header += md.length
                else:
                    self.count.data += md.length
            else:
                per_file.setdefault(md.relative_path, []).append(req)
        for reqs in per_file.values():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
        ahead = _ReadAhead([] if self.whole_chunks else self._read_ahead(per_file, planner))
        try:
            if torch_path:
                super().read_data(dataclasses.replace(plan, items=torch_path), planner).wait()
            for relative_path, reqs in per_file.items():
                fd = os.open(self.fs.concat_path(self.path, relative_path), os.O_RDONLY)
                try:
                    self._read_tensors(fd, reqs, planner)
                finally:
                    os.close(fd)
        finally:
            ahead.stop()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_ahead(self, per_file: dict, planner) -> list[tuple[str, int, int]]:
        """The extents of the chunks of which the load needs at least half (what a rank reads at its own layout:
        every chunk whole), in the order `_read_tensors` reads them; a chunk needed in small part is left to the
        loader's own range reads, so a resharded load does not read ahead what it skips."""
        extents, seen = [], set()
        for relative_path, reqs in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            for req in reqs:
                md = self.storage_data[req.storage_index]
                if (relative_path, md.offset) not in seen and 2 * math.prod(req.lengths) >= _chunk_numel(req, planner):
                    seen.add((relative_path, md.offset))
                    extents.append((str(path), md.offset, md.length))
        return extents

    def _read_tensors(self, fd: int, reqs: list, planner) -> None:
        """The file's chunks in file order, each front to back (behind the read-ahead): its first window, the
        regions the load needs of it (where the window shows the layout, `_head_layout`), its last window (the zip's
        directory, which must confirm the layout, else the chunk is read again through `_chunk_layout`'s path).
        The regions are read by `READ_THREADS` threads (the copies out of the page cache release the GIL) while
        this one parses the next chunk's headers."""
        pending: list = []  # (the chunk's reads, its requests and targets)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="megatron-rl-read") as pool:
            for _, group in itertools.groupby(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                group = list(group)
                md = self.storage_data[group[0].storage_index]
                headers = _Slice(fd, md.offset, md.length)
                targets = [planner.resolve_tensor(req).detach() for req in group]
                guess = None if self.whole_chunks else _head_layout(headers.with_head())
                reads = []
                if guess is not None:
                    reads = [pool.submit(self._region, fd, md, guess.layout, req, target)
                             for req, target in zip(group, targets)]
                    if not _confirmed(headers, guess):  # read again below; the bytes read so far count too
                        self.count.data += sum(f.result() for f in reads)
                        guess, reads = None, []
                if guess is None:
                    layout = None if self.whole_chunks else _chunk_layout(headers.with_headers())
                    for req, target in zip(group, targets):
                        if layout is None:
                            self._place(self._whole(_Slice(fd, md.offset, md.length), req), target, req)
                        else:
                            self.count.data += self._region(fd, md, layout, req, target)
                self.count.header += headers.read_bytes
                pending.append((reads, group, targets))
            for reads, group, targets in pending:
                self.count.data += sum(f.result() for f in reads)
                for req, target in zip(group, targets):
                    planner.commit_tensor(req, target)

    def _region(self, fd: int, md, layout: _ChunkLayout, req, target: torch.Tensor) -> int:
        """Read `req`'s region of the chunk at `md` into `target`; the bytes read."""
        tensor, n = _read_region(_Slice(fd, md.offset, md.length), layout, tuple(req.storage_offsets),
                                 tuple(req.lengths), into=target)
        self._place(tensor, target, req)
        return n

    @staticmethod
    def _place(tensor: torch.Tensor, target: torch.Tensor, req) -> None:
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        if tensor.data_ptr() != target.data_ptr():  # not read into place
            target.copy_(tensor)

    def _whole(self, chunk: _Slice, req) -> torch.Tensor:
        """torch's path: the chunk loaded whole, then narrowed to the region."""
        chunk.seek(0)
        before = chunk.read_bytes
        tensor = torch.load(chunk, map_location="cpu", weights_only=True)
        read = chunk.read_bytes - before
        data = min(read, tensor.untyped_storage().nbytes())
        self.count.data += data
        self.count.header += read - data
        return narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)


# ---- 2. Megatron-Core's strategy with that reader --------------------------------------------------------------
class RangeLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron-Core's torch_dist load strategy reading through `RangeReader`; `read` adds up the bytes this rank
    read over its loads."""

    def __init__(self, whole_chunks: bool = False):
        super().__init__()
        self.whole_chunks = whole_chunks
        self.read = ReadCount()

    def load(self, sharded_state_dict, checkpoint_dir):
        # `TorchDistLoadShardedStrategy.load` of Megatron-Core 0.16, which builds its reader inline: the same steps
        # with ours.
        flexible_shape = [sh for sh in nested_values(sharded_state_dict)
                          if isinstance(sh, ShardedTensor) and not sh.allow_shape_mismatch]
        shape_mismatch = {sh.key: sh for sh in nested_values(sharded_state_dict)
                          if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch}
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = RangeReader(checkpoint_dir, self.read, self.whole_chunks)
        checkpoint.load_state_dict(pyt_state_dict, reader, planner=MCoreLoadPlanner(
            shapes_validation_sharded_tensors=flexible_shape, allow_shape_mismatch_sharded_tensors=shape_mismatch))
        self.cached_global_metadata = reader.read_metadata()  # cached: no read
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, orig_sharded_state_dict)
        return state


# ---- 3. the fully parallel load --------------------------------------------------------------------------------
def _shard_id(sh) -> tuple:
    if isinstance(sh, ShardedTensor):
        return ("tensor", sh.key, tuple(sh.global_offset))
    return ("object", sh.key, tuple(sh.global_offset), tuple(sh.global_shape))


def _device_type(sh: ShardedTensor) -> str:
    return sh.data.device.type if sh.data is not None else "cpu"


class ParallelLoadStrategy(LoadShardedStrategy):
    """Wraps a load strategy (`base`) so that what every rank of `group` holds alike is read once over the group.

    Each rank lists its ShardedTensors (key, offset, shape, dtype, device); those on every rank's list (one
    all-gather of a digest, and of the lists only when the digests differ) are the replicated ones: `read_owners`
    names the rank that reads each (the rank that wrote it, when the layout is the one it was saved with), `base`
    reads those and everything not replicated, and the owners broadcast the rest in buckets (each rank receives
    into its own tensors). `received` counts the bytes this rank got from the others."""

    def __init__(self, base: LoadShardedStrategy, group, bucket_bytes: int = BUCKET_BYTES):
        super().__init__()
        self.base, self.group, self.bucket_bytes = base, group, bucket_bytes
        self.received = 0

    @property
    def read(self) -> ReadCount:
        return self.base.read

    @property
    def can_handle_sharded_objects(self):
        return self.base.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir):
        return self.base.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.base.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend):
        return self.base.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version):
        return self.base.check_version_compatibility(loaded_version)

    def load(self, sharded_state_dict, checkpoint_dir):
        items = {_shard_id(v): v for v in nested_values(sharded_state_dict)
                 if isinstance(v, (ShardedTensor, ShardedObject))}
        rank = self.group.rank()
        shares = self._replicated(items) if self.group.size() > 1 else []
        elsewhere = {entry[0] for s in shares if rank in s.ranks for entry, owner in zip(s.entries, s.owners)
                     if owner != rank}
        loaded = self.base.load({i: v for i, v in items.items() if i not in elsewhere}, checkpoint_dir)
        for share in shares:
            loaded.update(self._exchange(share, loaded))
        dict_list_map_inplace(
            lambda v: loaded[_shard_id(v)] if isinstance(v, (ShardedTensor, ShardedObject)) else v,
            sharded_state_dict)
        return sharded_state_dict

    def _replicated(self, items: dict) -> list["_Share"]:
        """The ShardedTensors that two or more ranks of the group hold alike, as one `_Share` per set of holders
        (every rank: a model's weights; some: a mixture of experts' experts, held alike by each expert-data-parallel
        group), in the same order on every rank."""
        mine = sorted((i, tuple(sh.local_shape), str(sh.dtype), _device_type(sh)) for i, sh in items.items()
                      if isinstance(sh, ShardedTensor))
        size = self.group.size()
        digests = [None] * size
        dist.all_gather_object(digests, hashlib.sha256(repr(mine).encode()).hexdigest(), group=self.group)
        if len(set(digests)) == 1:
            return [_Share(tuple(range(size)), [items[entry[0]] for entry in mine], mine)] if mine else []
        lists = [None] * size
        dist.all_gather_object(lists, mine, group=self.group)
        holders: dict[tuple, tuple[int, ...]] = {}
        for r, entries in enumerate(lists):
            for entry in entries:
                holders[entry] = holders.get(entry, ()) + (r,)
        shares: dict[tuple[int, ...], list] = {}
        for entry in sorted(holders):  # every rank walks the same entries: its own and the others'
            if len(holders[entry]) > 1:
                shares.setdefault(holders[entry], []).append(entry)
        return [_Share(ranks, [items.get(entry[0]) for entry in entries], entries)
                for ranks, entries in sorted(shares.items())]

    def _buckets(self, share: "_Share") -> list[tuple[int, list[int]]]:
        """(owner, indices into the share) per message: each owner's tensors, by device type, in buckets of
        `bucket_bytes`."""
        out = []
        for owner in sorted(set(share.owners)):
            for device in sorted(set(share.devices)):
                bucket, used = [], 0
                for i, (o, d) in enumerate(zip(share.owners, share.devices)):
                    if o != owner or d != device:
                        continue
                    n = -(-share.nbytes[i] // _ALIGN) * _ALIGN
                    if bucket and used + n > self.bucket_bytes:
                        out.append((owner, bucket))
                        bucket, used = [], 0
                    bucket.append(i)
                    used += n
                if bucket:
                    out.append((owner, bucket))
        return out

    def _exchange(self, share: "_Share", loaded: dict) -> dict:
        """The tensors of `share` this rank did not read, received from their owners: a broadcast where every rank
        of the group holds them, else the owner's sends to each other holder (messages in the same order on every
        rank; a rank outside the share takes no part)."""
        rank, received = self.group.rank(), {}
        if rank not in share.ranks:
            return received
        everyone = len(share.ranks) == self.group.size()
        for owner, bucket in self._buckets(share):
            shards = [share.shards[i] for i in bucket]
            if owner == rank:
                tensors = [loaded[_shard_id(sh)] for sh in shards]
            else:
                for sh in shards:
                    if sh.data is None:
                        sh.init_data("cpu")  # as Megatron-Core's load does
                tensors = [sh.data.detach() for sh in shards]
            starts, used = [], 0
            for t in tensors:
                starts.append(used)
                used += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
            buffer = torch.empty(used, dtype=torch.uint8, device=tensors[0].device)
            parts = [buffer[s:s + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                     for s, t in zip(starts, tensors)]
            if owner == rank:
                for part, t in zip(parts, tensors):
                    part.copy_(t)
            if everyone:
                dist.broadcast(buffer, group=self.group, group_src=owner)
            elif owner == rank:
                for r in share.ranks:
                    if r != owner:
                        dist.send(buffer, group=self.group, group_dst=r)
            else:
                dist.recv(buffer, group=self.group, group_src=owner)
            if owner != rank:
                for sh, part, t in zip(shards, parts, tensors):
                    t.copy_(part)
                    received[_shard_id(sh)] = t
                    self.received += t.numel() * t.element_size()
        return received


@dataclasses.dataclass
class _Share:
    """Tensors that the group's ranks `ranks` hold alike: their entries as every rank lists them (shard id, local
    shape, dtype, device type), this rank's ShardedTensors of them (None where it holds none), and, derived, each
    one's bytes, device type and reader (`read_owners` over the holders, as a group rank)."""

    ranks: tuple[int, ...]
    shards: list
    entries: list
    nbytes: list[int] = dataclasses.field(init=False)
    devices: list[str] = dataclasses.field(init=False)
    owners: list[int] = dataclasses.field(init=False)

    def __post_init__(self):
        self.nbytes = [math.prod(shape) * _itemsize(dtype) for _, shape, dtype, _ in self.entries]
        self.devices = [device for *_, device in self.entries]
        picks = read_owners([(sid[1], tuple(sid[2]), n) for (sid, *_), n in zip(self.entries, self.nbytes)],
                            len(self.ranks))
        self.owners = [self.ranks[p] for p in picks]


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def resume_strategy(group) -> ParallelLoadStrategy:
    """The load strategy for `dist_checkpointing.load` of a training checkpoint or of model weights on the ranks
    of one data-parallel `group` (`engine.pgs.dp_cp`): byte ranges, each replicated tensor read by one rank. Its
    `read` holds the bytes this rank read."""
    return ParallelLoadStrategy(RangeLoadStrategy(), group)
