"""One object that pushes trainer weights into the generator after each trainer step.

`WeightSync` ties the pieces together: the plan (computed once from the two placements, cached), the bucketed
transport (whose handshake carries the trainer step and each rank's readiness), and the version stamp. Every rank
of both executors calls `sync()` at the same point of its loop; trainer ranks pass the step they just finished,
generator-only ranks pass nothing and learn the step from their trainer peers.

Typical use (every rank, after `build_topology`):

    sync = WeightSync(model_cfg, topo["trainer"], topo["generator"])
    ...
    result = sync.sync(trainer_model=trainer_model if trainer member else None,
                       generator_model=generator_model if generator member else None,
                       step=trainer_step if trainer member else None)
    weight_version(generator_model).step  # == trainer_step on generator ranks (also sync.version)

`generator_model` may also be a {local name: tensor or quant.QuantizedWeight} mapping (int8/fp8 quantize-on-receive, see
`megatron_rl/ddma/quant.py`); then the version is read from `sync.version`. A rank in neither executor need not
call `sync()`: nothing is sent to or from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_rl.ddma.planner import DEFAULT_SPLIT_MIN_ELEMENTS, ReshardPlan, plan_reshard
from megatron_rl.ddma.transport import TransferStats, TransportSettings, execute_plan
from megatron_rl.ddma.version import WeightVersion, set_weight_version
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.topology import ExecutorGroups, ExecutorPlacement

ParamSource = Union[torch.nn.Module, Mapping[str, torch.Tensor], None]


def parameters_of(model: ParamSource) -> Optional[dict[str, torch.Tensor]]:
    """Local name -> parameter of a GPTModel stage, looking through wrappers (DDP, Float16Module: `.module`)."""
    if model is None:
        return None
    if isinstance(model, Mapping):
        return dict(model)
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return dict(model.named_parameters())


@dataclass
class SyncResult:
    """One rank's view of one sync."""

    version: Optional[WeightVersion]  # what the generator now holds (None on trainer-only ranks)
    stats: TransferStats
    seconds: float  # handshake + transfer on this rank


class WeightSync:
    """Sync weights from the trainer executor to the generator executor (any layouts, disjoint or colocated)."""

    def __init__(
        self,
        model: ModelConfig,
        trainer: Union[ExecutorPlacement, ExecutorGroups],
        generator: Union[ExecutorPlacement, ExecutorGroups],
        *,
        generator_model_cfg: Optional[ModelConfig] = None,
        settings: TransportSettings = TransportSettings(),
        split_min_elements: int = DEFAULT_SPLIT_MIN_ELEMENTS,
        rank: Optional[int] = None,
    ):
        trainer = trainer.placement if isinstance(trainer, ExecutorGroups) else trainer
        generator = generator.placement if isinstance(generator, ExecutorGroups) else generator
        self.trainer, self.generator, self.settings = trainer, generator, settings
        # Raises (the same way on every rank) if the two cannot match, before anything is sent.
        self.plan: ReshardPlan = plan_reshard(
            model, trainer.layout, generator.layout, src_first_rank=trainer.first_rank,
            dst_first_rank=generator.first_rank, dst_cfg=generator_model_cfg, split_min_elements=split_min_elements)
        self.rank = dist.get_rank() if rank is None else rank
        self.version: Optional[WeightVersion] = None
        self._workspace: dict = {}  # the staging buffer, kept between syncs (at most one bucket)

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainer.ranks

    @property
    def is_generator(self) -> bool:
        return self.rank in self.generator.ranks

    def sync(self, trainer_model: ParamSource = None, generator_model: ParamSource = None,
             step: Optional[int] = None) -> SyncResult:
        """Copy the trainer's weights into the generator's parameters in place; stamp the trainer step."""
        t0 = time.perf_counter()
        src = parameters_of(trainer_model) if self.is_trainer else None
        dst = parameters_of(generator_model) if self.is_generator else None
        if self.is_trainer and src is None:
            raise ValueError(f"rank {self.rank} is a trainer rank: sync() needs trainer_model")
        if self.is_generator and dst is None:
            raise ValueError(f"rank {self.rank} is a generator rank: sync() needs generator_model")
        if self.is_trainer and step is None:
            raise ValueError(f"rank {self.rank} is a trainer rank: sync() needs the trainer step")
        stats = execute_plan(self.plan, self.rank, src, dst, self.settings, step=step, workspace=self._workspace)
        if self.is_generator:
            if stats.step is None:
                raise RuntimeError(f"rank {self.rank}: no trainer rank told this generator rank the step")
            self.version = WeightVersion(stats.step)
            if isinstance(generator_model, torch.nn.Module):
                set_weight_version(generator_model, self.version)
        return SyncResult(self.version, stats, time.perf_counter() - t0)
