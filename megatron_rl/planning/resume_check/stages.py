"""What each trainer rank of a layout holds and loads: the trainer layout (`TrainerSpec`), and every rank's boxes
of the model and optimizer state (`Stage`, built on the meta device by `build_stage`), dense and expert alike."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from megatron_rl.checkpointing.layout import MODEL_DIR, OPTIMIZER_DIR, CheckpointError
from megatron_rl.checkpointing.optimizer_state import PREFIX, STATE_KEYS, range_boxes
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.planning.meta import (StandInGroup, meta_building, owned_expert_ranges, owned_ranges,
                                      stage_model)
from megatron_rl.planning.resume_check.progress import Progress


DIST_DIRS = (MODEL_DIR, OPTIMIZER_DIR)
DIST_CONFIG = "metadata.json"  # Megatron-Core's description of a dist_checkpointing directory, read before it loads
REFERENCE = "reference."  # the KL reference model's keys in the optimizer checkpoint (`megatron_state`)
EXPERTS = ".experts."  # in the key of every expert weight (`megatron_state.spread_replicas` reads it so too)


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
