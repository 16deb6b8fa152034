"""The loads of training checkpoints and model weights: each byte read once, by one rank (`reads.py`'s rules).

1. `RangeReader`: torch's `FileSystemReader`, except for tensors: a saved chunk is a torch.save zip inside a
   `.distcp` file, and where its headers show a contiguous storage (what our saves write: `HostStaging` copies
   each tensor out), the region a rank needs is read as `chunk_read_ranges` of its data instead of the whole
   chunk. Objects, chunks with a stream transform and any other layout (a view saved with its strides, several
   storages, compression, another byte order) take torch's path: the chunk read whole, then narrowed. It counts
   the bytes it reads (`ReadCount`). A chunk's headers are parsed from two small reads without torch.load where
   they are what torch.save writes (`chunk_reads.py`); each file is read forward, chunk by chunk, behind a thread
   that asks the kernel to read ahead the chunks a rank needs most of (`ReadAhead`), so a cold load overlaps the
   disk with the parsing and copying.
2. `RangeLoadStrategy`: Megatron-Core's torch_dist load strategy with that reader.
3. `ParallelLoadStrategy`: the ShardedTensors that several ranks of a data-parallel group hold alike (model weights
   and the KL reference's on every rank; a mixture of experts' experts on each expert-data-parallel group's) are
   read by one of their holders each (`read_owners`) and sent to the others (a broadcast where all hold them), on
   the device the tensors live on (the group's backend moves them: gloo on CPU, NCCL on GPU): a tensor of at least
   `DIRECT_BYTES` straight from the tensor its owner read into the receivers' own (no buffer, no copy), smaller ones
   coalesced in buckets of at most `BUCKET_BYTES`; everything else (the distributed optimizer's pieces, objects) is
   read by the ranks that need it.
4. `resume_strategy`: the two together, what the loads pass to `dist_checkpointing.load`. A resume loads the model's
   directory, then the optimizer's, with `read_ahead` the files each will read (`resume_read_ahead`): from the
   first load's start (while it plans), both directories' small files (`directory_files`, which every rank reads),
   then the model's shards this rank wrote (`files_written_here`, when the layout is the one they were written
   with); from the moment the model's reads end, while the replicated weights are exchanged (no disk), the
   optimizer's shards. So the disk does not idle until each load has planned its reads, and no small read waits
   behind a large read-ahead.

Every rank ends with the values a plain `dist_checkpointing.load` gives it (the tests check bit-equality).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

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

from megatron_rl.checkpointing.chunk_reads import (ChunkLayout, ReadAhead, Slice, chunk_layout, chunk_numel,
                                                   confirmed, head_layout, read_region)
from megatron_rl.checkpointing.reads import ReadCount, read_owners

READ_THREADS = 2  # threads that read a file's regions into place (`RangeReader._read_tensors`)
# The replicated tensors of at least DIRECT_BYTES are broadcast from and into the tensors themselves; the smaller
# ones coalesced into buffers of at most BUCKET_BYTES. Through a buffer, a tensor costs a copy on each side and the
# buffer's fresh pages: 0.46-0.63 s for the 2 x 135 MB of SmolLM2's weights at DP2 on a 2-core CPU, against 0.21-0.24
# s for the same bytes broadcast in place (docs/benchmarks.md, issue 65).
DIRECT_BYTES = 1 << 20
BUCKET_BYTES = 256 << 20
_ALIGN = 16  # bytes: every tensor of a bucket starts at a multiple of this (any dtype's view of it is aligned)


# ---- 1. the reader ---------------------------------------------------------------------------------------------
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
        ahead = ReadAhead([] if self.whole_chunks else self._read_ahead(per_file, planner))
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
                if (relative_path, md.offset) not in seen and 2 * math.prod(req.lengths) >= chunk_numel(req, planner):
                    seen.add((relative_path, md.offset))
                    extents.append((str(path), md.offset, md.length))
        return extents

    def _read_tensors(self, fd: int, reqs: list, planner) -> None:
        """The file's chunks in file order, each front to back (behind the read-ahead): its first window, the
        regions the load needs of it (where the window shows the layout, `head_layout`), its last window (the zip's
        directory, which must confirm the layout, else the chunk is read again through `chunk_layout`'s path).
        The regions and then the last window are read by `READ_THREADS` threads, in that order (the copies out of
        the page cache release the GIL), while this one parses the next chunk's headers: read here, the last
        window was a read ahead of the regions on every chunk (0.42 s of a 1.55 s cold load at DP2)."""
        pending: list = []  # (the chunk's slice, its reads, its tail's check, its requests and targets)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="megatron-rl-read") as pool:
            for _, group in itertools.groupby(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                group = list(group)
                md = self.storage_data[group[0].storage_index]
                headers = Slice(fd, md.offset, md.length)
                targets = [planner.resolve_tensor(req).detach() for req in group]
                guess = None if self.whole_chunks else head_layout(headers.with_head())
                reads, check = [], None
                if guess is not None:
                    reads = [pool.submit(self._region, fd, md, guess.layout, req, target)
                             for req, target in zip(group, targets)]
                    check = pool.submit(confirmed, headers, guess)
                else:
                    self._read_chunk(fd, md, headers, group, targets)
                pending.append((headers, reads, check, group, targets))
            for headers, reads, check, group, targets in pending:
                self.count.data += sum(f.result() for f in reads)
                if check is not None and not check.result():  # read again; the bytes read so far count too
                    self._read_chunk(fd, self.storage_data[group[0].storage_index], headers, group, targets)
                self.count.header += headers.read_bytes
                for req, target in zip(group, targets):
                    planner.commit_tensor(req, target)

    def _read_chunk(self, fd: int, md, headers: Slice, group: list, targets: list) -> None:
        """The chunk's requests read where its headers say (`chunk_layout`), or through torch's path."""
        layout = None if self.whole_chunks else chunk_layout(headers.with_headers())
        for req, target in zip(group, targets):
            if layout is None:
                self._place(self._whole(Slice(fd, md.offset, md.length), req), target, req)
            else:
                self.count.data += self._region(fd, md, layout, req, target)

    def _region(self, fd: int, md, layout: ChunkLayout, req, target: torch.Tensor) -> int:
        """Read `req`'s region of the chunk at `md` into `target`; the bytes read."""
        tensor, n = read_region(Slice(fd, md.offset, md.length), layout, tuple(req.storage_offsets),
                                 tuple(req.lengths), into=target)
        self._place(tensor, target, req)
        return n

    @staticmethod
    def _place(tensor: torch.Tensor, target: torch.Tensor, req) -> None:
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        if tensor.data_ptr() != target.data_ptr():  # not read into place
            target.copy_(tensor)

    def _whole(self, chunk: Slice, req) -> torch.Tensor:
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
    reads those and everything not replicated, and the owners broadcast the rest (each rank receives into its own
    tensors: those of `direct_bytes` or more in place, the smaller through buckets). `received` counts the bytes
    this rank got from the others."""

    def __init__(self, base: LoadShardedStrategy, group, bucket_bytes: int = BUCKET_BYTES,
                 read_ahead: Sequence[Sequence[tuple[str, int, int]]] = (), direct_bytes: int = DIRECT_BYTES):
        super().__init__()
        self.base, self.group, self.bucket_bytes, self.direct_bytes = base, group, bucket_bytes, direct_bytes
        self.received = 0
        # Per load, in order, extents it reads: read ahead (`ReadAhead`, a kernel hint), the first load's from its
        # start, each later one's from the end of the reads of the load before it.
        self._read_ahead, self._ahead = [list(e) for e in read_ahead], None

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
        if self._ahead is None and self._read_ahead:  # the first load: its files while it plans its reads
            self._ahead = ReadAhead(self._read_ahead.pop(0))
        try:
            loaded = self.base.load({i: v for i, v in items.items() if i not in elsewhere}, checkpoint_dir)
        finally:
            self._stop_ahead()  # what was read ahead for this load is read now (or the load failed)
        if self._read_ahead:  # the disk is free again: the next load's files, while the exchange runs
            self._ahead = ReadAhead(self._read_ahead.pop(0))
        for share in shares:
            loaded.update(self._exchange(share, loaded))
        dict_list_map_inplace(
            lambda v: loaded[_shard_id(v)] if isinstance(v, (ShardedTensor, ShardedObject)) else v,
            sharded_state_dict)
        return sharded_state_dict

    def close(self) -> None:
        """Ends a read-ahead that is running (its load has read, or will not run) and any still to come."""
        self._read_ahead = []
        self._stop_ahead()

    def _stop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

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
        """(owner, indices into the share) per message: each owner's tensors, by device type, those of at least
        `direct_bytes` alone (sent in place, `_exchange`), the others in buckets of `bucket_bytes`. Computed from
        the share's entries alone, so every rank lists the same messages."""
        out = []
        for owner in sorted(set(share.owners)):
            for device in sorted(set(share.devices)):
                bucket, used = [], 0
                for i, (o, d) in enumerate(zip(share.owners, share.devices)):
                    if o != owner or d != device:
                        continue
                    if share.nbytes[i] >= self.direct_bytes:
                        out.append((owner, [i]))
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
            if share.nbytes[bucket[0]] >= self.direct_bytes:  # alone, in place (a strided one through a copy)
                buffer = tensors[0] if tensors[0].is_contiguous() else tensors[0].contiguous()
                parts = [buffer]
            else:
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
                    if part is not t:
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


def resume_strategy(group, read_ahead: Sequence[Sequence[tuple[str, int, int]]] = ()) -> ParallelLoadStrategy:
    """The load strategy for `dist_checkpointing.load` of a training checkpoint or of model weights on the ranks
    of one data-parallel `group` (`engine.pgs.dp_cp`): byte ranges, each replicated tensor read by one rank. Its
    `read` holds the bytes this rank read. `read_ahead`: per load made with it, in order, the extents (path,
    offset, length) it will read, read ahead from its start (the first) or while the load before it exchanges
    its replicated tensors (module docstring); `close()` it after the last load."""
    return ParallelLoadStrategy(RangeLoadStrategy(), group, read_ahead=read_ahead, direct_bytes=DIRECT_BYTES)


def directory_files(path, directory: str, meta) -> list[tuple[str, int, int]]:
    """The files of checkpoint `path`'s `directory` that every rank's load reads (all but the `.distcp` shards:
    Megatron-Core's `metadata.json` and `common.pt`, DCP's `.metadata`), as whole-file extents. Read ahead first:
    the optimizer's, read when its load starts, waited 0.23 s behind the read-ahead of its shards (issue 65)."""
    prefix = f"{directory}/"
    return [(os.path.join(path, rel), 0, size) for rel, size in sorted(meta.files.items())
            if rel.startswith(prefix) and not rel.endswith(".distcp")]


def files_written_here(path, directory: str, meta, pgs) -> list[tuple[str, int, int]]:
    """The `.distcp` files of checkpoint `path`'s `directory` (e.g. "optimizer") that this rank wrote (torch names
    them `__<rank>_<n>`), as whole-file extents, when the world and the trainer layout (`pgs`: the engine's groups)
    are those the checkpoint's `meta` records: this rank then reads its share of that directory from them alone.
    [] otherwise (a resharded resume reads other ranks' files in part; `RangeReader` reads ahead what it plans)."""
    saved = meta.trainer_layout()
    here = (pgs.tp.size(), pgs.pp.size(), pgs.dp.size(), pgs.ep.size(), pgs.expt_tp.size())
    if saved is None or meta.world_size != dist.get_world_size() or \
            (saved.tp, saved.pp, saved.dp, saved.ep, saved.etp) != here:
        return []
    prefix = f"{directory}/__{dist.get_rank()}_"
    return [(os.path.join(path, rel), 0, size) for rel, size in sorted(meta.files.items())
            if rel.startswith(prefix) and rel.endswith(".distcp")]


def resume_read_ahead(path, directories: Sequence[str], meta, pgs) -> list[list[tuple[str, int, int]]]:
    """What `resume_strategy(read_ahead=...)` reads ahead of the loads of `directories` of checkpoint `path`, in
    that order: with the first, every directory's small files (`directory_files`), then the first's shards this
    rank wrote; with each later one, its shards this rank wrote (`files_written_here`, [] at another layout)."""
    small = [extent for d in directories for extent in directory_files(path, d, meta)]
    return [(small if i == 0 else []) + files_written_here(path, d, meta, pgs) for i, d in enumerate(directories)]
