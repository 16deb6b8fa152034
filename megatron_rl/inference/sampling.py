"""Sampling from full-vocabulary logits: temperature, top-k, top-p, greedy; seeded per sequence.

Each sequence draws its noise from its own generator, seeded by the request, so the same seed gives the same
tokens whatever else shares the batch. Sampling is the Gumbel-max trick (argmax of log-probs plus Gumbel
noise), which equals sampling from the softmax and needs one uniform draw per vocabulary entry.

The recorded log-prob is log softmax(logits / T)[token] over the whole vocabulary: the quantity the trainer
computes from its own logits (top-k / top-p truncation is a sampling device the trainer cannot see; with them
enabled, mu is the tempered distribution, not the truncated one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: Optional[int] = None

    def problems(self) -> list[str]:
        out = []
        if self.temperature < 0:
            out.append(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            out.append(f"top_k={self.top_k} must be >= 0")
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.n < 1:
            out.append(f"n={self.n} must be >= 1")
        return out


@dataclass
class SequenceRng:
    generator: torch.Generator = field(default_factory=torch.Generator)


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least the first token)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator) -> tuple[int, float]:
    """One token from fp32 logits [vocab] and its log-prob under the tempered full distribution."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, -1)
    filtered = _filter(scaled, params.top_k, params.top_p)
    u = torch.rand(logits.shape[-1], generator=rng, dtype=torch.float64).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u)).to(logits.device, torch.float32)
    tok = int(torch.argmax(filtered + gumbel))
    return tok, float(logp[tok])
