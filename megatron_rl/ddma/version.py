"""Which trainer step a generator's weights come from.

Every rollout carries the version of the weights that produced it (the controller's staleness bound and AIPO's
behaviour policy depend on it). A sync stamps the generator model with the trainer step it copied; the controller
reads it with `weight_version(model)` (or from the `WeightSync` that ran the sync).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

_ATTR = "_ddma_weight_version"


@dataclass(frozen=True)
class WeightVersion:
    """The trainer step whose weights a model holds, and when (wall clock, seconds) they arrived."""

    step: int
    synced_at: float = field(default_factory=time.time)


def set_weight_version(model: torch.nn.Module, version: WeightVersion) -> None:
    object.__setattr__(model, _ATTR, version)


def weight_version(model: torch.nn.Module) -> Optional[WeightVersion]:
    """The version stamped by the last sync into `model`, or None if it was never synced."""
    return getattr(model, _ATTR, None)
