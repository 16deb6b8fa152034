"""The rehearsal of a load: each rank's boxes matched against the index (every element found exactly once, every
object present), the bytes each rank reads, and the report with the load's time estimate."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.checkpointing.coverage import range_text
from megatron_rl.checkpointing.layout import OPTIMIZER_DIR
from megatron_rl.checkpointing.reads import chunk_read_ranges, read_owners
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.planning.resume_check.stages import Box, ResumeCheckError, Stage, TrainerSpec, stages
from megatron_rl.planning.resume_check.index import Index, saved_files
from megatron_rl.planning.resume_check.progress import Progress


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
