"""AIPO: asynchronous importance-weighted policy optimization (LlamaRL, Meta 2025).

Per response token t, with pi the trainer policy and mu the generator that sampled it:

    w_t = min(exp(logp_pi - logp_mu), rho)            (truncated importance weight, one-sided)
    L   = - mean( stopgrad(w_t) * A * logp_pi )

so grad L = - mean( min(w_t, rho) * A * grad logp_pi ). `importance_weights=False` sets w_t = 1: the plain
on-policy gradient applied to off-policy samples, the uncorrected baseline that AIPO is measured against.
Options, off by default:
- `ppo_clip=eps`: replace the weighted term by PPO's clipped surrogate of the ratio pi/mu,
  -min(r A, clip(r, 1 - eps, 1 + eps) A);
- `kl_coef`: + kl_coef * KL(pi || ref) per token, the k3 estimator exp(ref - pi) - (ref - pi) - 1;
- `entropy_coef`: - entropy_coef * H(pi) per token.

Normalisation ("token": mean over all response tokens in the step; "sequence": mean over responses of each
response's token mean) is done by returning a (sum, count) pair that the training loop sums over micro-batches
and data-parallel ranks before dividing.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algorithms.settings import AIPOSettings


def aipo_token_loss(logp_pi: torch.Tensor, logp_mu: torch.Tensor, advantages: torch.Tensor,
                    settings: AIPOSettings, logp_ref: Optional[torch.Tensor] = None,
                    entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """Per-token loss (same shape as logp_pi) and per-token statistics (detached)."""
    log_ratio = logp_pi.detach() - logp_mu
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=settings.rho)
    if not settings.importance_weights:
        loss = -advantages * logp_pi
    elif settings.ppo_clip is None:
        loss = -truncated * advantages * logp_pi
    else:
        r = torch.exp(logp_pi - logp_mu)
        clipped = torch.clamp(r, 1 - settings.ppo_clip, 1 + settings.ppo_clip)
        loss = -torch.minimum(r * advantages, clipped * advantages)
    stats = {"ratio": ratio, "truncated": (ratio > settings.rho).to(ratio.dtype),
             "kl_mu_pi": -log_ratio, "abs_log_ratio": log_ratio.abs()}
    if settings.kl_coef:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        d = logp_ref - logp_pi
        kl = torch.exp(d) - d - 1
        loss = loss + settings.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    if entropy is not None:
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * entropy
        stats["entropy"] = entropy.detach()
    return loss, stats


def normalize(token_values: torch.Tensor, mask: torch.Tensor, normalization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose global ratio is the token-mean or the sequence-mean of `token_values` [b, s]."""
    mask = mask.to(token_values.dtype)
    if normalization == "token":
        return (token_values * mask).sum(), mask.sum()
    per_seq_tokens = mask.sum(-1)
    has_tokens = per_seq_tokens > 0
    seq_mean = (token_values * mask).sum(-1) / per_seq_tokens.clamp(min=1)
    return seq_mean[has_tokens].sum(), has_tokens.to(token_values.dtype).sum()
