"""`megatron-rl resume-check`: a resume rehearsed on metadata, before any rank loads a byte.

    ranks = rehearse(index, trainer)   # index: a checkpoint's (`read_index`) or a job's save (`rehearsed_index`)

For every rank of a trainer (`TrainerSpec`: a model at a layout), it proves that each element of every model and
optimizer tensor the rank loads is in the checkpoint exactly once, and that each object it loads is there (the
layers' `_extra_state`, each directory's `common.pt` and `metadata.json`, `rl_state.pt`); and it counts the bytes
the rank reads, as the loader reads them, and the bytes it needs. The first range in no chunk, or in several, is a
`ResumeCheckError` in one line naming the tensor and the elements.

How, from the job's own pieces (none restated here):
1. What a rank holds: its stage, built on the meta device by the job's builder (`planning.meta.stage_model`), its
   model state dict as saved and loaded (`models.sharding.model_sharded_state_dict`, factories applied), and its
   distributed optimizer's ranges (`planning.meta.owned_ranges`: Megatron-Core's range map over its DDP buffers)
   cut into the model-space boxes the checkpoint stores (`checkpointing.optimizer_state.range_boxes`). Ranks with
   the same (tp, pp) coordinates hold the same model tensors: each stage is built once, and only the optimizer's
   ranges differ over DP. A mixture of experts split over DP ranks is built once per share of the experts (the
   layout's expert grid); the DP ranks holding a share (an expert-data-parallel group) read its weights as the load
   reads what the whole group holds alike, one rank each, and each rank's optimizer owns ranges of the dense
   weights over the DP group and of its experts' over its expert-data-parallel group
   (`planning.meta.owned_expert_ranges`).
2. The checkpoint's index: torch DCP's `Metadata` of `model/` and `optimizer/` (`safe_load.read_dcp_metadata`;
   with `--index-only`, a copy of just the `.metadata` files and `megatron_rl.json` will do; otherwise every file
   the index names must be there with its recorded size, and with `--checksums` its content: `check_files`), or,
   for a job's config, the `Metadata` its
   save writes: every rank's tensors (1.) at the job's layout, each distinct chunk once, as DCP keeps one copy of
   replicated items.
3. Exactly once: each tensor's chunks tile its global shape (`checkpointing.coverage`, the check every load runs),
   and each box a rank needs lies inside that shape with the same global shape (except the vocabulary's padded
   rows, which Megatron-Core lets differ: rows past the saved ones are padding and load as zeros).
4. Bytes read, as `checkpointing/loader.py` reads them: torch DCP's read items for the box
   (`create_read_items_for_chunk_list`), each read as the byte ranges `checkpointing.reads.chunk_read_ranges`
   gives; what every DP rank of a shard holds alike (weights) is read by one rank of the group, chosen per
   directory by `reads.read_owners`, and passed on to the others. The load time is `checkpoint_cost`'s model: a
   checksum pass over every byte written, spread over the trainer's nodes, then the busiest node's reads, both at
   the calibration's filesystem read rate. Only tensor bytes are counted (not the chunks' headers, nor objects).

This is planning, not a checkpointing component: it builds stages on the meta device and reads job configs, which
a component may not import. `train` runs it before a resume loads anything (`check_resume`, from
`controller/job.py`), `megatron-rl resume-check` (`run`) from the command line.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_rl.checkpointing.coverage import range_text, tensor_problem
from megatron_rl.checkpointing.layout import (DCP_METADATA, META, MODEL_DIR, OPTIMIZER_DIR, RL_STATE, CheckpointError,
                                              CheckpointMeta, files_problem, first_line, read_meta)
from megatron_rl.checkpointing.optimizer_state import PREFIX, STATE_KEYS, range_boxes
from megatron_rl.checkpointing.reads import chunk_read_ranges, read_owners
from megatron_rl.checkpointing.safe_load import COMMON, read_dcp_metadata
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout, layout_problems
from megatron_rl.planning.meta import (StandInGroup, meta_building, owned_expert_ranges, owned_ranges,
                                      stage_model)

DIST_DIRS = (MODEL_DIR, OPTIMIZER_DIR)
DIST_CONFIG = "metadata.json"  # Megatron-Core's description of a dist_checkpointing directory, read before it loads
REFERENCE = "reference."  # the KL reference model's keys in the optimizer checkpoint (`megatron_state`)
EXPERTS = ".experts."  # in the key of every expert weight (`megatron_state.spread_replicas` reads it so too)
PROGRESS_EVERY_S = 5.0


class ResumeCheckError(CheckpointError):
    """A checkpoint that the trainer cannot load exactly: one line naming the tensor (or object) and the range."""


@dataclass(frozen=True)
class TrainerSpec:
    """What decides the state a trainer saves and loads: the stage modules (model, layout, parameter dtype,
    attention), its optimizer (distributed or not; state to load or none yet) and a KL reference model."""

    model: ModelConfig
    layout: ParallelLayout
    params_dtype: torch.dtype = torch.float32
    attention: str = "auto"
    distributed_optimizer: bool = True
    optimizer_state: bool = True  # False: saved before the first update, nothing to load
    reference: bool = False  # the reference model's weights in the optimizer checkpoint (algorithm.kl_coef > 0)

    @classmethod
    def of_job(cls, cfg, model: ModelConfig, params_dtype: torch.dtype) -> "TrainerSpec":
        """The trainer of job `cfg` (a JobConfig, validated into `model`) with its parameters in `params_dtype`
        (resolved by the caller: the machine's at run time, the calibrated GPU's when planning)."""
        t = cfg.trainer
        return cls(model, t.layout, params_dtype, t.attention, t.use_distributed_optimizer, True,
                   cfg.algorithm.kl_coef > 0)


# ---- what each rank holds ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Box:
    """A region of one saved tensor that a rank loads: its global offset and shape, the tensor's global shape as
    the rank holds it, and the live tensor's dtype. `padded_vocab`: the vocabulary's rows, padded per TP, whose
    global row count may differ from the saved one (Megatron-Core's `allow_shape_mismatch`)."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    padded_vocab: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Stage:
    """One model-parallel shard (tp_rank, pp_rank) of a trainer: what its ranks load from each directory."""

    tp_rank: int
    pp_rank: int
    # What every DP rank of the shard holds alike, per directory (each load shares its reading over the DP group):
    # the model's weights; the reference model's and a non-distributed optimizer's state in the optimizer's.
    replicated: dict[str, list[Box]] = field(default_factory=dict)
    objects: list[tuple[str, str]] = field(default_factory=list)  # (directory, DCP key) of each sharded object
    optimizer: list[list[Box]] = field(default_factory=list)  # the distributed optimizer's boxes, per DP rank
    # What only some DP ranks hold alike, per directory: a mixture of experts' weights where DP ranks hold different
    # experts (EP over DP), each share with the DP ranks holding it (an expert-data-parallel group; and the
    # reference's experts, and a non-distributed optimizer's state of them); empty where every DP rank holds the
    # same tensors. The load reads each tensor on one of its holders and sends it to the others.
    experts: list[tuple[tuple[int, ...], dict[str, list[Box]]]] = field(default_factory=list)


def _model_boxes(sd: dict, prefix: str = "") -> tuple[list[Box], list[str]]:
    """The tensors (as boxes) and objects (as DCP keys) of a sharded state dict whose factories are applied."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    boxes, objects = [], []
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            pre = sh.prepend_axis_num
            boxes.append(Box(prefix + sh.key, tuple(sh.global_offset), (1,) * pre + tuple(sh.local_shape),
                             tuple(sh.global_shape), sh.dtype, sh.allow_shape_mismatch))
        elif isinstance(sh, ShardedObject):
            objects.append(prefix + sh.unique_key)
    return boxes, objects


@dataclass
class _Held:
    """A meta stage as one DP rank holds it: the model, its parameters' sharding, its tensors and objects."""

    model: torch.nn.Module
    sharding_of: dict
    weights: list[Box]
    objects: list[str]


def _held(spec: TrainerSpec, tp_rank: int, pp_rank: int, dp_rank: int) -> _Held:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    from megatron_rl.models.sharding import model_sharded_state_dict

    model = stage_model(spec.model, spec.layout, tp_rank=tp_rank, pp_rank=pp_rank, params_dtype=spec.params_dtype,
                        attention=spec.attention, dp_rank=dp_rank)
    with meta_building():
        sd = model_sharded_state_dict(model, StandInGroup(spec.layout.dp, 0))
    sharding_of = {sh.data: sh for sh in nested_values(sd) if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}
    apply_factories(sd)
    return _Held(model, sharding_of, *_model_boxes(sd))


def _is_expert(b: Box) -> bool:
    return EXPERTS in b.key


def _state_boxes(ranges, sharding_of: dict) -> list[Box]:
    """The distributed optimizer's boxes of its owned flat ranges (`range_boxes`), one per state key."""
    boxes = []
    for param, start, end in ranges:
        for sh, offset, shape, _ in range_boxes(sharding_of[param], start, end):
            boxes += [Box(f"{PREFIX}.{k}.{sh.key}", offset, shape, tuple(sh.global_shape), torch.float32,
                          sh.allow_shape_mismatch) for k in STATE_KEYS]
    return boxes


def build_stage(spec: TrainerSpec, tp_rank: int, pp_rank: int) -> Stage:
    """What the ranks of stage (tp_rank, pp_rank) of `spec` load, from the stage built on the meta device: one build
    for a dense model, one per share of the experts for a mixture of experts split over DP ranks."""
    layout = spec.layout
    coords = [layout.expert_coords(tp_rank, r) for r in range(layout.dp)]
    holders: dict[tuple[int, int], list[int]] = {}  # the DP ranks holding each share of the experts
    for r, c in enumerate(coords):
        holders.setdefault(c, []).append(r)
    held = {c: _held(spec, tp_rank, pp_rank, ranks[0]) for c, ranks in holders.items()}
    mine = [held[c] for c in coords]  # each DP rank's
    split = len(held) > 1  # DP ranks hold different experts

    def shared(boxes: list[Box]) -> list[Box]:
        return [b for b in boxes if not (split and _is_expert(b))]

    def alone(boxes: list[Box]) -> list[Box]:
        return [b for b in boxes if split and _is_expert(b)]

    objects = list(dict.fromkeys(o for h in held.values() for o in h.objects))
    stage = Stage(tp_rank, pp_rank, {MODEL_DIR: shared(mine[0].weights), OPTIMIZER_DIR: []},
                  [(MODEL_DIR, o) for o in objects],
                  experts=[(tuple(holders[c]), {MODEL_DIR: alone(h.weights), OPTIMIZER_DIR: []})
                           for c, h in held.items()] if split else [])
    if spec.reference:
        def reference(boxes: list[Box]) -> list[Box]:
            return [dataclasses.replace(b, key=REFERENCE + b.key) for b in boxes]

        stage.replicated[OPTIMIZER_DIR] += reference(shared(mine[0].weights))
        for (_, dirs), h in zip(stage.experts, held.values()):
            dirs[OPTIMIZER_DIR] += reference(alone(h.weights))
        stage.objects += [(OPTIMIZER_DIR, REFERENCE + o) for o in objects]
    if not spec.optimizer_state:
        return stage
    if not spec.distributed_optimizer:
        # Megatron-Core's own optimizers: each state tensor sharded as its parameter (`optim_state_to_sharding_state`),
        # the fp32 copies of 16-bit parameters as `fp32_param`.
        def state(boxes: list[Box]) -> list[Box]:
            return [Box(f"{PREFIX}.{k}.{b.key}", b.offset, b.shape, b.global_shape, torch.float32, b.padded_vocab)
                    for b in boxes for k in ("exp_avg", "exp_avg_sq", "fp32_param")
                    if k != "fp32_param" or b.dtype != torch.float32]

        stage.replicated[OPTIMIZER_DIR] += state(shared(mine[0].weights))
        for (_, dirs), h in zip(stage.experts, held.values()):
            dirs[OPTIMIZER_DIR] += state(alone(h.weights))
        return stage
    # Dense weights over the DP group; a mixture of experts' over each rank's expert-data-parallel group.
    for r, (ranges, h) in enumerate(zip(owned_ranges(mine[0].model, layout.dp), mine)):
        experts = owned_expert_ranges(h.model, layout, tp_rank, pp_rank, r) if spec.model.is_moe else []
        stage.optimizer.append(_state_boxes(ranges, mine[0].sharding_of) + _state_boxes(experts, h.sharding_of))
    return stage


def stages(spec: TrainerSpec, progress: Optional["Progress"] = None,
           built: Optional[dict] = None) -> Iterator[Stage]:
    """Every stage of `spec`, each built once (pipeline stage by stage). `built`: stages of this same `spec` kept
    by (tp_rank, pp_rank) from an earlier pass, and filled by this one (a config rehearsed into its own layout
    builds each stage once for the index and the rehearsal)."""
    for pp_rank in range(spec.layout.pp):
        for tp_rank in range(spec.layout.tp):
            stage = built.get((tp_rank, pp_rank)) if built is not None else None
            if stage is None:
                stage = build_stage(spec, tp_rank, pp_rank)
                if built is not None:
                    built[(tp_rank, pp_rank)] = stage
            yield stage
            if progress is not None:
                progress.step()


# ---- the checkpoint's index --------------------------------------------------------------------------------------
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


# ---- the rehearsal -----------------------------------------------------------------------------------------------
@dataclass
class RankBytes:
    """One target rank: the bytes it reads from the checkpoint (as the loader reads them) and the bytes it loads."""

    tp: int
    pp: int
    dp: int
    read_bytes: int = 0
    needed_bytes: int = 0


class _Rehearsal:
    """Checks boxes against an index and counts what reading them costs; remembers each box's answer."""

    def __init__(self, index: Index, spec: TrainerSpec):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        self.index, self.spec = index, spec
        self._chunk, self._md = ChunkStorageMetadata, TensorStorageMetadata
        self._items = create_read_items_for_chunk_list
        self._files_checked = False

    def _where(self, stage: Stage, dp: Optional[int] = None) -> str:
        ranks = f"rank tp {stage.tp_rank}, pp {stage.pp_rank}, dp {dp}" if dp is not None else \
            f"the ranks tp {stage.tp_rank}, pp {stage.pp_rank}"
        return f"{ranks} of the trainer at {self.spec.layout}"

    def files(self) -> None:
        """The files every rank reads whole, and the shards the index places chunks in, are in the checkpoint."""
        missing = sorted(saved_files() - self.index.files)
        if missing:
            raise ResumeCheckError(f"{self.index.where}: {missing[0]} is not in the checkpoint (its manifest), and "
                                   f"every rank reads it")
        for d, md in self.index.metadata.items():
            shards = {f"{d}/{info.relative_path}" for info in (md.storage_data or {}).values()}
            missing = sorted(shards - self.index.files)
            if missing:
                raise ResumeCheckError(f"{self.index.label(d)}: places chunks in {missing[0]}, which is not in the "
                                       f"checkpoint (its manifest)")

    def box(self, d: str, b: Box, stage: Stage, dp: Optional[int] = None) -> tuple[int, int]:
        """(bytes read, bytes needed) of box `b` of directory `d`; ResumeCheckError unless every element of it
        the rank needs is in exactly one saved chunk."""
        saved, where, who = self.index.saved(d, b.key), self.index.label(d), self._where(stage, dp)
        if saved is None:
            raise ResumeCheckError(f"{where}: holds no tensor {b.key}, which is loaded by {who}")
        shape = saved.shape
        same = (len(shape) == len(b.global_shape) and shape[1:] == b.global_shape[1:]) if b.padded_vocab \
            else shape == b.global_shape
        if not same:
            raise ResumeCheckError(f"{where}: {b.key} has global shape {list(shape)}, loaded as "
                                   f"{list(b.global_shape)} by {who}")
        if b.padded_vocab and shape[0] < self.spec.model.vocab_size:
            raise ResumeCheckError(f"{where}: {b.key} holds {shape[0]} rows, the vocabulary has "
                                   f"{self.spec.model.vocab_size}")
        lo = b.offset
        hi = tuple(min(o + s, n) if b.padded_vocab else o + s for o, s, n in zip(b.offset, b.shape, shape))
        problem = saved.problem()
        if problem is not None:
            raise ResumeCheckError(f"{where}: {b.key}: {problem} (the trainer at {self.spec.layout} loads it)")
        if any(h > n for h, n in zip(hi, shape)) or any(o < 0 for o in lo):
            raise ResumeCheckError(f"{where}: {b.key}: {range_text(lo, hi)}, loaded by {who}, lies outside its shape "
                                   f"{list(shape)}")
        need = math.prod(max(h - o, 0) for o, h in zip(lo, hi))
        if need == 0:  # vocabulary padding only: loads as zeros
            return 0, 0
        chunks = saved.overlapping(lo, hi)
        items = self._items(b.key, self._md(saved.entry.properties, saved.entry.size, chunks),
                            [self._chunk(torch.Size(b.offset), torch.Size(b.shape))])
        read = covered = 0
        for item in items:
            chunk = chunks[item.storage_index.index]
            covered += math.prod(item.lengths)
            read += sum(n for _, n in chunk_read_ranges(tuple(chunk.sizes), saved.itemsize,
                                                        tuple(item.storage_offsets), tuple(item.lengths)))
        if covered != need:  # the tiling above rules this out; a grid too large to check is checked here
            raise ResumeCheckError(f"{where}: {b.key}: the saved chunks hold {covered} elements of the {need} in "
                                   f"{range_text(lo, hi)}, loaded by {who}")
        return read, need * saved.itemsize

    def stage(self, stage: Stage) -> list[RankBytes]:
        """Every DP rank of `stage`: checked, and its bytes."""
        if not self._files_checked:
            self.files()
            self._files_checked = True
        dp = self.spec.layout.dp
        ranks = [RankBytes(stage.tp_rank, stage.pp_rank, r) for r in range(dp)]
        for d, key in stage.objects:
            if not self.index.has_object(d, key):
                raise ResumeCheckError(f"{self.index.label(d)}: holds no object {key}, which is loaded by "
                                       f"{self._where(stage)}")
        # Each directory's tensors that several DP ranks hold alike are read by one of them (the load's rule)
        shares = [(tuple(range(dp)), d, boxes) for d, boxes in stage.replicated.items()]
        shares += [(held_by, d, boxes) for held_by, dirs in stage.experts for d, boxes in dirs.items()]
        for held_by, d, boxes in shares:
            owners = read_owners([(b.key, b.offset, b.nbytes) for b in boxes], len(held_by))
            for b, owner in zip(boxes, owners):
                read, need = self.box(d, b, stage, None if len(held_by) == dp else held_by[owner])
                ranks[held_by[owner]].read_bytes += read
                for r in held_by:
                    ranks[r].needed_bytes += need
        for r, boxes in zip(ranks, stage.optimizer):
            for b in boxes:
                read, need = self.box(OPTIMIZER_DIR, b, stage, r.dp)
                r.read_bytes += read
                r.needed_bytes += need
        return ranks


def rehearse(index: Index, spec: TrainerSpec, progress: Optional["Progress"] = None,
             built: Optional[dict] = None) -> list[RankBytes]:
    """Every rank of trainer `spec` loading checkpoint `index`: its bytes, in layout order (pp, tp, dp);
    ResumeCheckError (one line) for the first thing some rank needs that is not in the checkpoint exactly once."""
    check = _Rehearsal(index, spec)
    out = []
    for stage in stages(spec, progress, built):
        out += check.stage(stage)
    return out


def written_bytes(index: Index) -> int:
    """The tensor bytes of the checkpoint: its chunks' elements in their saved dtype."""
    return sum(math.prod(c.sizes) * entry.properties.dtype.itemsize for _, _, entry in index.tensors()
               for c in entry.chunks)


def load_estimate(ranks: list[RankBytes], layout: ParallelLayout, written: int, cal) -> dict:
    """The load's time, `checkpoint_cost`'s model from what each rank reads: every byte written read once for the
    checksums, spread over the trainer's nodes, then each rank's reads, a node at a time at `filesystem_read_gbps`
    (the trainer's ranks are the job's first, `gpus_per_node` to a node)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        node = layout.local_rank(r.tp, r.pp, r.dp) // cal.gpus_per_node
        per_node[node] = per_node.get(node, 0) + r.read_bytes
    rate = cal.filesystem_read_gbps * 1e9
    busiest = max(per_node.values(), default=0)
    checksum_s = written / len(per_node) / rate if per_node else 0.0
    return {"load_s": checksum_s + busiest / rate, "checksum_s": checksum_s, "read_s": busiest / rate,
            "nodes": len(per_node), "busiest_node_read_bytes": busiest,
            "rates": {"filesystem_read_gbps": cal.filesystem_read_gbps, "gpus_per_node": cal.gpus_per_node}}


def report(index: Index, spec: TrainerSpec, ranks: list[RankBytes], cal) -> dict:
    """The JSON object of `resume-check`: the checkpoint, what all ranks and the busiest read and need, the load's
    time, and every rank's bytes."""
    written = written_bytes(index)
    busiest = max(ranks, key=lambda r: (r.read_bytes, r.needed_bytes))
    entries = [entry for _, _, entry in index.tensors()]
    return {
        "ok": True, "source": str(index.where), "source_kind": "config" if index.meta is None else "checkpoint",
        "written_at": str(index.layout) if index.layout else None, "target": str(spec.layout),
        "ranks": len(ranks), "tensors": len(entries), "chunks": sum(len(e.chunks) for e in entries),
        "objects": sum(1 for md in index.metadata.values() for e in md.state_dict_metadata.values()
                       if getattr(e, "chunks", None) is None),
        "written_bytes": written,
        "read_bytes": sum(r.read_bytes for r in ranks), "needed_bytes": sum(r.needed_bytes for r in ranks),
        "max_rank_read_bytes": busiest.read_bytes, "max_rank_needed_bytes": max(r.needed_bytes for r in ranks),
        "busiest_rank": dataclasses.asdict(busiest),
        **load_estimate(ranks, spec.layout, written, cal),
        "per_rank": [dataclasses.asdict(r) for r in ranks],
    }


# ---- inside `train`: before a resume loads anything -------------------------------------------------------------
def check_resume(path: Path, target: TrainerSpec, group=None) -> Optional[str]:
    """Collective over `group` (every rank of the job; None: the default group): checkpoint `path` rehearsed at the
    layout it was written with and at `target`'s, the stages shared out over the ranks; every rank raises the same
    ResumeCheckError (the first stage's, in order) when one fails. Reads META, and the index on the ranks with a
    share. A stage the rehearsal cannot build (a module the meta device does not take) fails no resume: the first
    such note is returned, on every rank, and the load's own checks still run."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failures, notes = [], []
    try:
        index = read_index(path)
        if rank == 0:
            check_files(index, checksums=False)
        specs = [target] if index.layout in (None, target.layout) else \
            [dataclasses.replace(target, layout=index.layout), target]
        specs = [loading(s, index) for s in specs]
        units = [(i, tp, pp) for i, s in enumerate(specs) for pp in range(s.layout.pp) for tp in range(s.layout.tp)]
        checks = [_Rehearsal(index, s) for s in specs]
    except CheckpointError as e:
        failures.append((-1, str(e)))
        units = []
    for i in range(rank, len(units), world):
        which, tp, pp = units[i]
        try:
            checks[which].stage(build_stage(specs[which], tp, pp))
        except CheckpointError as e:
            failures.append((i, str(e)))
            break
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather
            notes.append((i, f"resume-check could not rehearse the load at {specs[which].layout} "
                             f"({first_line(e)}); loading without it"))
    found: list = [None] * world
    dist.all_gather_object(found, (failures, notes), group=group)
    failures = sorted(f for part, _ in found for f in part)
    if failures:
        raise ResumeCheckError(failures[0][1])
    notes = sorted(n for _, part in found for n in part)
    return notes[0][1] if notes else None


# ---- the command -------------------------------------------------------------------------------------------------
class Progress:
    """A line on stderr per stage of the work, and at most every few seconds within one."""

    def __init__(self, prog: str, out=None):
        self.prog, self.out = prog, out if out is not None else sys.stderr
        self.start = time.perf_counter()
        self.what, self.total, self.done, self.last = "", 0, 0, 0.0

    def begin(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self._say(f"{what} ({total} stage{'s' if total != 1 else ''})")

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self._say(f"{self.what}: {self.done}/{self.total}")

    def _say(self, text: str) -> None:
        self.last = time.perf_counter()
        print(f"{self.prog}: {text} [{self.last - self.start:.0f} s]", file=self.out, flush=True)


TRAINER_KEYS = ("trainer.tp", "trainer.pp", "trainer.dp", "trainer.ep", "trainer.dtype", "trainer.attention",
                "trainer.use_distributed_optimizer")


def _trainer_of_checkpoint(index: Index, overrides: list[str], cal) -> TrainerSpec:
    """The checkpoint's own trainer, with the trainer.* settings the overrides give."""
    from megatron_rl.config import ConfigError, given_keys, load_config
    from megatron_rl.planning.plan import executor_dtype

    spec = saved_trainer(index)
    given = given_keys(None, overrides)
    other = sorted(k for k in given if k not in TRAINER_KEYS)
    if other:
        raise ConfigError(f"{other[0]}: with a checkpoint SOURCE and no --config, only {', '.join(TRAINER_KEYS)} "
                          f"apply (the rest is the checkpoint's); give the job with --config")
    cfg = load_config(None, overrides)
    t = cfg.trainer
    # A trainer's experts are split over its DP ranks, each over its TP group (expert TP = TP).
    layout = ParallelLayout(*(getattr(t, k) if f"trainer.{k}" in given else getattr(spec.layout, k)
                              for k in ("tp", "pp", "dp", "ep")))
    problems = layout_problems(spec.model, layout)
    if problems:
        p = problems[0]
        raise ConfigError(f"trainer.ep={layout.ep} does not divide trainer.dp={layout.dp}" if p.dim == "etp x ep"
                          else f"trainer.{p}")
    return dataclasses.replace(
        spec, layout=layout,
        params_dtype=executor_dtype(t.dtype, cal) if "trainer.dtype" in given else spec.params_dtype,
        attention=t.attention if "trainer.attention" in given else spec.attention,
        distributed_optimizer=(t.use_distributed_optimizer if "trainer.use_distributed_optimizer" in given
                               else spec.distributed_optimizer))


def _job_trainer(config: str, overrides: list[str], cal) -> TrainerSpec:
    from megatron_rl.config import load_config, validate
    from megatron_rl.planning.plan import executor_dtype

    cfg = load_config(config, overrides)
    model = validate(cfg, world_size=cfg.run.world_size, cluster_files=False)
    return TrainerSpec.of_job(cfg, model, executor_dtype(cfg.trainer.dtype, cal))


def format_text(r: dict) -> str:
    from megatron_rl.checkpointing.storage import human_bytes as h

    b = r["busiest_rank"]
    lines = [
        f"{r['source']} ({'written' if r['source_kind'] == 'checkpoint' else 'its save'} at {r['written_at']}) into "
        f"the trainer at {r['target']}: every element and object each of its {r['ranks']} ranks loads is in the "
        f"checkpoint exactly once",
        f"  checkpoint    {r['tensors']} tensors in {r['chunks']:,} chunks ({h(r['written_bytes'])}), "
        f"{r['objects']} objects",
        f"  all ranks     read {h(r['read_bytes'])} (x{r['read_bytes'] / max(r['written_bytes'], 1):.3f} the "
        f"checkpoint), need {h(r['needed_bytes'])}",
        f"  busiest rank  tp {b['tp']}, pp {b['pp']}, dp {b['dp']} reads {h(b['read_bytes'])}; the most a rank needs "
        f"is {h(r['max_rank_needed_bytes'])}",
        f"  load          {r['load_s']:.1f} s: checksums {r['checksum_s']:.1f} s, then the busiest of {r['nodes']} "
        f"nodes reads {h(r['busiest_node_read_bytes'])} in {r['read_s']:.1f} s "
        f"({r['rates']['filesystem_read_gbps']:g} GB/s a node)",
    ]
    if r["source_kind"] == "checkpoint":
        f = r.get("files")
        lines.insert(2, f"  files         {f['checked']} files the load reads ({h(f['bytes'])}), each present with "
                        f"its recorded size{', content matching its checksum' if f['checksums'] else ''}"
                     if f else "  files         not checked (--index-only): the index alone")
    if r["ranks"] <= 64:
        lines.append(f"  {'rank':<22}{'reads':>12}{'needs':>12}")
        lines += [f"  {'tp %d, pp %d, dp %d' % (x['tp'], x['pp'], x['dp']):<22}{h(x['read_bytes']):>12}"
                  f"{h(x['needed_bytes']):>12}" for x in r["per_rank"]]
    else:
        lines.append(f"  {'stage':<22}{'reads (max)':>12}{'needs (max)':>12}   (--json: every rank)")
        by_pp: dict[int, list] = {}
        for x in r["per_rank"]:
            by_pp.setdefault(x["pp"], []).append(x)
        lines += [f"  {'pp %d' % pp:<22}{h(max(x['read_bytes'] for x in xs)):>12}"
                  f"{h(max(x['needed_bytes'] for x in xs)):>12}" for pp, xs in sorted(by_pp.items())]
    return "\n".join(lines)


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


def run(source: str, config: Optional[str] = None, overrides: Optional[list[str]] = None, as_json: bool = False,
        prog: str = "megatron-rl resume-check", index_only: bool = False, checksums: bool = False) -> int:
    """`megatron-rl resume-check SOURCE [--config FILE] [overrides]`: 0 and the report when every rank of the target
    loads the checkpoint exactly; 1 and one line when one cannot; 2 and one line for a SOURCE or overrides it cannot
    use.

    A checkpoint SOURCE is checked as the load will read it: its index, and every file the index names present with
    its recorded size (`check_files`; `checksums`: and its content). `index_only` checks the index alone, for a copy
    of just its `.metadata` files and META (the report says the files were not checked)."""
    from megatron_rl.checkpointing.inspect import InspectError, reading
    from megatron_rl.config import ConfigError
    from megatron_rl.planning.calibration import CalibrationError, load_calibration

    overrides = list(overrides or [])
    progress = Progress(prog)
    t0 = time.perf_counter()
    src = Path(source)
    files = None
    try:
        if index_only and checksums:
            raise ConfigError("--checksums reads the files that --index-only leaves alone: give one of them")
        cal = load_calibration(None)
        if src.is_file() or src.suffix in (".yaml", ".yml"):
            if config is not None:
                raise ConfigError(f"SOURCE {source} is a config: give the target's settings as overrides, not "
                                  f"--config")
            written = _job_trainer(source, [], cal)
            target = _job_trainer(source, overrides, cal)
            progress.begin(f"the checkpoint {source} writes at {written.layout}, built on the meta device",
                           written.layout.tp * written.layout.pp)
            built = {}  # the stages of `written`: the target's too where the overrides change nothing
            index = rehearsed_index(written, src, progress, built)
            ranks = _target(index, target, progress, built if target == written else None)
        else:
            with reading(src) as ckpt:
                index = read_index(ckpt)
                target = loading(_job_trainer(config, overrides, cal) if config is not None else
                                 _trainer_of_checkpoint(index, overrides, cal), index)
                if not index_only:
                    files = check_files(index, checksums, progress)
                ranks = _target(index, target, progress)
        out = report(index, target, ranks, cal)
        out["files"] = files
    except ResumeCheckError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        if as_json:
            print(json.dumps({"ok": False, "source": source, "error": str(e)}))
        return 1
    except (CheckpointError, InspectError, ConfigError, CalibrationError) as e:
        print(f"{prog}: {first_line(e)}", file=sys.stderr)
        return 2
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out) if as_json else format_text(out))
    return 0


def _target(index: Index, target: TrainerSpec, progress: Progress,
            built: Optional[dict] = None) -> list[RankBytes]:
    progress.begin(f"every rank of the trainer at {target.layout} loading it", target.layout.tp * target.layout.pp)
    try:
        return rehearse(index, target, progress, built)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the builders' assertions for a layout the model cannot take
        raise CheckpointError(f"cannot build the trainer at {target.layout}: {first_line(e)}") from None
