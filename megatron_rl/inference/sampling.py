"""Batched sampling on the device: temperature, top-k, top-p, greedy; seeded per sequence.

Each sequence's randomness is a counter-based hash of (its seed, its step, the vocabulary index), so the same
seed gives the same tokens whatever else shares the batch, on CPU and GPU alike, with no per-sequence generator
objects and no host round trip. Sampling is the Gumbel-max trick: argmax(log-probs + Gumbel noise) is a draw
from the softmax.

The recorded log-prob is log softmax(logits / T)[token] over the whole vocabulary: the quantity the trainer
computes from its own logits (top-k / top-p truncation is a sampling device the trainer cannot see; with them
enabled, mu is the tempered distribution, not the truncated one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF


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


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (in int64 arithmetic; products wrap, the low 32 bits are exact)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, index)."""
    row = _hash32(_hash32(seeds) ^ _hash32(steps * 0x9E3779B9 + 0x632BE5AB))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _hash32(row[:, None] ^ _hash32(idx * 0x85EBCA6B + 0x27D4EB2F)[None, :])
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, steps: torch.Tensor, filtering: bool = True,
           noise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b] and their log-probs [b] from fp32 logits [b, vocab]; per-row parameters [b].

    temperature 0 is greedy (its log-prob is then under T = 1). `filtering=False` skips the top-k / top-p sort
    when no row uses them; `noise=False` skips the random draws when every row is greedy.
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    logp = torch.log_softmax(scaled, -1)
    candidates = scaled
    if filtering:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, scaled.shape[-1]))
        probs = torch.softmax(sorted_logits, -1)
        keep = (rank < k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
        kept_sorted = torch.where(keep, sorted_logits, torch.full_like(sorted_logits, float("-inf")))
        candidates = torch.empty_like(scaled).scatter_(1, order, kept_sorted)
    if noise:
        u = uniform_noise(seeds, steps, scaled.shape[-1])
        noisy = torch.where(greedy[:, None], scaled, candidates - torch.log(-torch.log(u)))
    else:
        noisy = scaled
    tokens = torch.argmax(noisy, dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
