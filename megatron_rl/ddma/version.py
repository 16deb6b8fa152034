"""Which trainer step a generator's weights come from, for users of `WeightSync` on its own.

A sync stamps the generator model with the trainer step it copied; `weight_version(model)` reads it (as does
`WeightSync.version`). The job does not read the stamp: there the schedule's actions carry the version
(`controller/schedule.py`), and every rollout records it (`RolloutBatch.weight_versions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_ATTR = "_ddma_weight_version"


@dataclass(frozen=True)
class WeightVersion:
    """The trainer step whose weights a model holds."""

    step: int


def set_weight_version(model: torch.nn.Module, version: WeightVersion) -> None:
    object.__setattr__(model, _ATTR, version)


def weight_version(model: torch.nn.Module) -> Optional[WeightVersion]:
    """The version stamped by the last sync into `model`, or None if it was never synced."""
    return getattr(model, _ATTR, None)
