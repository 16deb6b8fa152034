"""Batched sampling on the device: temperature, top-k, top-p, greedy; seeded per sequence.

Each draw is inverse-CDF sampling: one uniform per sequence and step, a counter-based hash of (its seed, its step),
is located in the cumulative distribution of the (filtered) softmax. The same seed gives the same tokens whatever
else shares the batch, with no per-sequence generator objects and no host round trip. One uniform per row and a
cumulative sum cost a few passes over the vocabulary, where Gumbel-max sampling needs a hashed noise value for
every vocabulary entry. A sequence's seed is the 63-bit `stream_seed` of the keys that name its stream (run seed,
batch, prompt, sample): the one place a stream's seed is derived.

The recorded log-prob is log softmax(logits / T)[token] over the whole vocabulary: the quantity the trainer
computes from its own logits (top-k / top-p truncation is a sampling device the trainer cannot see; with them
enabled, mu is the tempered distribution, not the truncated one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import operator

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_GAMMA64 = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: Optional[int] = None  # in [0, 2**64): the request's stream, its samples' seeds derive from it

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
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            out.append(f"seed={self.seed} must be in [0, 2**64)")
        return out


def _mix64(z: int) -> int:
    """splitmix64's finalizer (Stafford's Mix13): a bijection of 64-bit words with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(*keys: int) -> int:
    """The 63-bit seed of the sampling stream named by `keys` (each an int in [0, 2**64)), e.g. (run seed, batch,
    prompt), then (that seed, sample): a pure function of the keys, so a resumed run redraws exactly.

    The state starts at mix(len(keys)) and absorbs each key in order: h = mix(((h ^ key) + GAMMA) mod 2**64), mix a
    bijection of 64-bit words; the seed is h >> 1. Tuples of different lengths start from different states; two of
    the same length agree up to their first differing key, where h ^ key differs and so, mix being a bijection, does
    h. From there on equal outputs need the mixer to collide two different states, so the only collisions are the
    hash's: about n**2 / 2**64 among n streams (the birthday bound on 63 bits), none of them structural: no key
    overflows into another's place, as batch b's prompt 1000 would into batch b + 1's prompt 0 under a formula like
    batch * 1000 + prompt.
    """
    h = _mix64(len(keys))
    for key in keys:
        key = operator.index(key)
        if not 0 <= key <= _MASK64:
            raise ValueError(f"stream key {key} is outside [0, 2**64)")
        h = _mix64(((h ^ key) + _GAMMA64) & _MASK64)
    return h >> 1


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (in int64 arithmetic; products wrap, the low 32 bits are exact)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[b] float32 uniforms in (0, 1), a pure function of (seed, step), seeds int64 in [0, 2**63).

    Each 32-bit half of the seed meets the step on its own path before the two are mixed: two seeds that share one
    half differ in the other, so their 32-bit hashes differ at every step (the mixer is a bijection of 32-bit
    words); any other two agree at a given step with probability about 2**-32, independently from step to step, so
    no two seeds share a stream. The uniform is the hash's top 24 bits. Elementwise int64 arithmetic (products wrap;
    the low 32 bits are exact) on the seeds' device: no host round trip, capturable in a CUDA graph.
    """
    step = _hash32(steps * 0x9E3779B9 + 0x632BE5AB)
    x = _hash32(_hash32(_hash32(seeds) ^ step) ^ _hash32((seeds >> 32) + step))
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds u times the row's total (entries of
    probability 0 are never drawn: the cumulative sum does not rise over them)."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, steps: torch.Tensor, filtering: bool = True,
           noise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b] and their log-probs [b] from fp32 logits [b, vocab]; per-row parameters [b].

    temperature 0 is greedy (its log-prob is then under T = 1). `filtering=False` skips the top-k / top-p sort
    when no row uses them; `noise=False` skips the random draw when every row is greedy.
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], -1)
    tokens = torch.argmax(logits, dim=-1)
    if noise:
        u = uniform(seeds, steps)
        if filtering:
            sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
            probs = sorted_logp.exp()
            rank = torch.arange(logp.shape[-1], device=logp.device)[None, :]
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logp.shape[-1]))
            # Keep the k most likely tokens, and of those the smallest prefix whose mass reaches top_p.
            keep = (rank < k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
            drawn = order.gather(1, _draw(probs * keep, u)[:, None]).squeeze(1)
        else:
            drawn = _draw(logp.exp(), u)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
