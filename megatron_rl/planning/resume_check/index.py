"""The checkpoint's index: every saved tensor's boxes and the files and byte ranges that hold them (`Index`,
`read_index`), the trainer layout it was saved at, and a synthetic save of any layout for the rehearsal
(`rehearsed_index`)."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_rl.checkpointing.coverage import tensor_problem
from megatron_rl.checkpointing.layout import (DCP_METADATA, META, OPTIMIZER_DIR, RL_STATE, CheckpointError,
                                              CheckpointMeta, files_problem, read_meta)
from megatron_rl.checkpointing.optimizer_state import PREFIX
from megatron_rl.checkpointing.safe_load import COMMON, read_dcp_metadata
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.planning.resume_check.stages import (DIST_CONFIG, DIST_DIRS, REFERENCE, Box, ResumeCheckError,
                                                      TrainerSpec, stages)
from megatron_rl.planning.resume_check.progress import Progress


@dataclass
class Index:
    """A checkpoint as a resume sees it before reading: torch DCP's `Metadata` of each dist_checkpointing directory
    (read on first use), and the files it holds (the manifest; for a rehearsed save, the files the save writes)."""

    where: Path  # the checkpoint directory, or the config whose save this is
    files: set[str]
    layout: Optional[ParallelLayout] = None  # the layout it was written with
    meta: Optional[CheckpointMeta] = None  # megatron_rl.json (None for a rehearsed save)
    loaded: Optional[dict] = None  # MODEL_DIR / OPTIMIZER_DIR -> torch.distributed.checkpoint.metadata.Metadata
    _saved: dict = field(default_factory=dict, repr=False)

    @property
    def metadata(self) -> dict:
        if self.loaded is None:
            self.loaded = {d: read_dcp_metadata(self.where / d) for d in DIST_DIRS}
        return self.loaded

    def label(self, d: str) -> str:
        """How a message names directory `d`'s index."""
        return f"{self.where} (rehearsed save) {d}/" if self.meta is None else str(self.where / d / DCP_METADATA)

    def saved(self, d: str, key: str) -> Optional["_Saved"]:
        """The saved tensor `key` of directory `d` (None when the index holds no tensor of that name)."""
        got = self._saved.get((d, key))
        if got is None:
            entry = self.metadata[d].state_dict_metadata.get(key)
            if entry is None or getattr(entry, "chunks", None) is None:
                return None
            got = self._saved[(d, key)] = _Saved(entry)
        return got

    def read_files(self) -> list[str]:
        """Every file a load of this checkpoint opens, whatever the layout: those every rank reads whole, and each
        shard the index places a chunk or an object in."""
        files = set(saved_files())
        for d, md in self.metadata.items():
            files |= {f"{d}/{info.relative_path}" for info in (md.storage_data or {}).values()}
        return sorted(files)

    def tensors(self) -> Iterator[tuple[str, str, object]]:
        for d, md in self.metadata.items():
            for key, entry in md.state_dict_metadata.items():
                if getattr(entry, "chunks", None) is not None:
                    yield d, key, entry

    def has_object(self, d: str, key: str) -> bool:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        md = self.metadata[d]
        if not isinstance(md.state_dict_metadata.get(key), BytesStorageMetadata):
            return False
        return not md.storage_data or MetadataIndex(key) in md.storage_data


class _Saved:
    """One saved tensor: its index entry, and its chunks grouped by their first offset (a stacked tensor's layer),
    each group sorted by the offsets after it, to find those a box overlaps by bisection on the first two axes (a
    layer of 128 experts, each in its own chunk, is one group of 128 or more)."""

    def __init__(self, entry):
        self.entry = entry
        self.shape = tuple(entry.size)
        self.itemsize = entry.properties.dtype.itemsize
        self.chunks = sorted(entry.chunks, key=lambda c: tuple(c.offsets))
        groups: dict[int, list] = {}
        for c in self.chunks if self.shape else ():
            groups.setdefault(c.offsets[0], []).append(c)
        self.firsts = list(groups)  # ascending, as the chunks are
        self.groups = list(groups.values())
        self.reach = max((c.sizes[0] for c in self.chunks), default=0) if self.shape else 0
        deep = len(self.shape) > 1
        self.seconds = [[c.offsets[1] for c in g] if deep else None for g in self.groups]
        self.second_reach = [max(c.sizes[1] for c in g) if deep else 0 for g in self.groups]
        self._problem: Optional[tuple[str]] = None

    def problem(self) -> Optional[str]:
        """`coverage.tensor_problem` of the chunks (computed once)."""
        if self._problem is None:
            self._problem = (tensor_problem(self.shape, [(tuple(c.offsets), tuple(c.sizes)) for c in self.chunks]),)
        return self._problem[0]

    def overlapping(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> list:
        if not self.shape:
            return self.chunks
        out = []
        first, last = bisect.bisect_right(self.firsts, lo[0] - self.reach), bisect.bisect_left(self.firsts, hi[0])
        for g in range(first, last):
            group, seconds = self.groups[g], self.seconds[g]
            if seconds is not None:
                group = group[bisect.bisect_right(seconds, lo[1] - self.second_reach[g]):
                              bisect.bisect_left(seconds, hi[1])]
            out += [c for c in group if all(o < h and o + s > low for o, s, low, h in zip(c.offsets, c.sizes, lo, hi))]
        return out


def read_index(ckpt: Path) -> Index:
    """The index of training checkpoint `ckpt` (a real one, or a copy of its `.metadata` files and META; those are
    read when first used); CheckpointError in one line when it is not one."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if not meta.is_training:
        raise CheckpointError(f"{ckpt}: not a training checkpoint (format {meta.format!r})")
    files = set(meta.files or meta.checksums)
    if not files:  # written without a manifest: the files present
        files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    return Index(ckpt, files, meta.trainer_layout(), meta)


def saved_trainer(index: Index) -> TrainerSpec:
    """The trainer that wrote the checkpoint of `index`, as far as its metadata says: model, layout, dtype; a
    distributed optimizer when its state is in pieces (`optimizer.state.param.*`), a reference model when it has
    `reference.*` tensors."""
    meta = index.meta
    model = meta.model_config()
    if index.layout is None:
        raise CheckpointError(f"{index.where}: {META} records no layout")
    keys = [key for _, key, _ in index.tensors()]
    dtype = getattr(torch, meta.torch_dtype_name, torch.float32)
    return TrainerSpec(model, index.layout, dtype if isinstance(dtype, torch.dtype) else torch.float32,
                       distributed_optimizer=any(k.startswith(f"{PREFIX}.param.") for k in keys),
                       optimizer_state=meta.optimizer_state is not False,
                       reference=any(k.startswith(REFERENCE) for k in keys))


def loading(spec: TrainerSpec, index: Index) -> TrainerSpec:
    """`spec` loading the checkpoint of `index`: no optimizer state where it was saved before the first update."""
    return dataclasses.replace(spec, optimizer_state=spec.optimizer_state and
                               (index.meta is None or index.meta.optimizer_state is not False))


def saved_files() -> set[str]:
    """The files every training checkpoint holds besides the shards (what the target's ranks read whole)."""
    return {f"{d}/{name}" for d in DIST_DIRS for name in (DCP_METADATA, COMMON, DIST_CONFIG)} | {RL_STATE}


def rehearsed_index(spec: TrainerSpec, where: Path, progress: Optional["Progress"] = None,
                    built: Optional[dict] = None) -> Index:
    """The index that a save of trainer `spec` writes: the distinct chunks of every rank's tensors and its
    objects (`Stage`), in torch DCP's `Metadata`. `built`: as `stages` takes it."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)

    entries: dict[str, dict] = {d: {} for d in DIST_DIRS}
    seen: set = set()

    def add(d: str, b: Box) -> None:
        if (d, b.key, b.offset) in seen:  # a replica of a chunk already listed
            return
        seen.add((d, b.key, b.offset))
        entry = entries[d].get(b.key)
        if entry is None:
            entry = entries[d][b.key] = TensorStorageMetadata(TensorProperties(dtype=b.dtype),
                                                              torch.Size(b.global_shape), [])
        entry.chunks.append(ChunkStorageMetadata(torch.Size(b.offset), torch.Size(b.shape)))

    for stage in stages(spec, progress, built):
        for d, boxes in stage.replicated.items():
            for b in boxes:
                add(d, b)
        for boxes in stage.optimizer:
            for b in boxes:
                add(OPTIMIZER_DIR, b)
        for _, dirs in stage.experts:
            for d, boxes in dirs.items():
                for b in boxes:
                    add(d, b)
        for d, key in stage.objects:
            entries[d][key] = BytesStorageMetadata()
    return Index(Path(where), saved_files(), spec.layout,
                 loaded={d: Metadata(state_dict_metadata=entries[d]) for d in DIST_DIRS})


def check_files(index: Index, checksums: bool, progress: Optional[Progress] = None) -> dict:
    """The files a load of `index`'s checkpoint opens (`Index.read_files`) are there with the sizes its manifest
    recorded (a stat each) and, with `checksums`, hold what was written (each read once, several at a time):
    ResumeCheckError naming the first that is not. Their count and bytes, for the report."""
    files = index.read_files()
    if checksums and progress is not None:
        progress.begin(f"the checksums of the {len(files)} files the load reads", 1)
    problem = files_problem(index.where, index.meta, files, checksums=checksums)
    if problem:
        raise ResumeCheckError(f"{problem}, and the load reads it")
    sizes = index.meta.files
    return {"checked": len(files), "bytes": sum(sizes.get(f, 0) for f in files), "checksums": checksums}
