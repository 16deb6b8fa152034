"""The `run` section: the run as a whole (its name, seed, length, world, logging), which the launch and the job's
loop read. Imports nothing heavy."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_rl.settings import Section, ranged


@dataclass
class WandbSettings(Section):
    """Weights & Biases logging of the run (`pip install 'megatron-rl[wandb]'`): the scalars of metrics.jsonl, the
    plot and sample rollouts. `mode`: "auto" logs when `project` is set, online with a W&B login (WANDB_API_KEY or
    `wandb login`), else offline into the run directory (`wandb sync` uploads it); "online" and "offline" always
    log (project "megatron-rl" unless set); "disabled" never does."""

    SECTION: ClassVar[str] = "run.wandb"
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None  # the run's display name in W&B; run.name when unset

    @property
    def enabled(self) -> bool:
        return self.mode in ("online", "offline") or (self.mode == "auto" and self.project is not None)

    def rules(self, path: str) -> list[str]:
        if self.enabled and importlib.util.find_spec("wandb") is None:
            setting = f"{path}.project={self.project!r}" if self.mode == "auto" else f"{path}.mode={self.mode!r}"
            return [f"{setting} needs the wandb package: pip install 'megatron-rl[wandb]'"]
        return []


@dataclass
class RunSettings(Section):
    """The run as a whole: its name (its directory is checkpoint.dir/name), seed, length, world and logging. After
    SIGTERM or SIGINT the job saves a checkpoint at its next weight push and ends; the local launcher kills its
    ranks `stop_grace_s` seconds after the signal if they have not ended by then."""

    SECTION: ClassVar[str] = "run"
    name: str = "default"
    seed: int = ranged(1234, "in [0, 2**32)")
    steps: int = ranged(800, ">= 1")
    world_size: Optional[int] = ranged(None, ">= 1")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    eval_interval: int = ranged(20, ">= 1")
    stop_grace_s: float = ranged(120.0, ">= 0", "(seconds from a stop signal to killing the ranks)")
    wandb: WandbSettings = field(default_factory=WandbSettings)

    @property
    def name_is_plain(self) -> bool:
        return bool(self.name.strip()) and self.name not in (".", "..") and not any(c in self.name for c in "/\\\0")

    def rules(self, path: str) -> list[str]:
        if not self.name_is_plain:
            return [f"{path}.name={self.name!r} must be a plain directory name (not empty, no '/', not '.' or '..'): "
                    f"the run writes into checkpoint.dir/{path}.name"]
        return []
