"""The rollout batch: what generators produce, rewards score, and the trainer learns from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class RolloutBatch:
    """n sampled sequences, right-padded to a common length s.

    tokens [n, s]: prompt then response then padding. Position t of `behaviour_logprobs` [n, s] holds
    log mu(tokens[t] | tokens[<t]) for response tokens (0 elsewhere), mu being the generator's sampling
    distribution (after temperature). `group_ids` [n] tie responses to their prompt; `weight_versions` [n] is
    the trainer step whose weights generated each sequence. `policy_mask` [n, s], for episodes (multi-turn): True
    at the tokens the generator sampled, False at the environments' observations inside the response, which carry
    no loss, importance weight, KL or entropy term (`response_mask` leaves them out); None when every response
    token was sampled. `routes` [n, s, layers, k] (a mixture-of-experts model's generator with routing replay,
    `inference/generator.py`): the experts each MoE layer chose for each token, which the trainer replays (padding
    and the last token hold placeholders); None otherwise.
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    behaviour_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    weight_versions: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    policy_mask: Optional[torch.Tensor] = None
    routes: Optional[torch.Tensor] = None

    def __post_init__(self):
        n, s = self.tokens.shape
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            expected = (n, s) if f.name in ("tokens", "behaviour_logprobs", "policy_mask") else (n,)
            if f.name == "routes" and v.dim() == 4:
                expected = (n, s) + tuple(v.shape[2:])
            if tuple(v.shape) != expected:
                raise ValueError(f"RolloutBatch.{f.name} has shape {tuple(v.shape)}, expected {expected}")
        if torch.any(self.prompt_lengths < 1) or torch.any(self.prompt_lengths + self.response_lengths > s):
            raise ValueError("RolloutBatch: prompt_lengths must be >= 1 and prompt + response must fit in tokens")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def response_mask(self) -> torch.Tensor:
        """[n, s] True at the response tokens the generator sampled (the positions the trainer learns from)."""
        pos = torch.arange(self.tokens.shape[1]).unsqueeze(0)
        start = self.prompt_lengths.unsqueeze(1)
        mask = (pos >= start) & (pos < start + self.response_lengths.unsqueeze(1))
        return mask if self.policy_mask is None else mask & self.policy_mask

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(**{f.name: (getattr(self, f.name)[index] if getattr(self, f.name) is not None else None)
                               for f in fields(self)})
