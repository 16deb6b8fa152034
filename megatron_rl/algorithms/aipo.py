"""AIPO: asynchronous importance-weighted policy optimization (LlamaRL, Meta 2025).

Per response token t, with pi the trainer policy and mu the generator that sampled it:

    w_t = min(exp(logp_pi - logp_mu), rho)            (truncated importance weight, one-sided)
    L   = - mean( stopgrad(w_t) * A * logp_pi )

so grad L = - mean( min(w_t, rho) * A * grad logp_pi ). `importance_weights=False` sets w_t = 1: the plain
on-policy gradient applied to off-policy samples, the uncorrected baseline that AIPO is measured against.

The peers' corrections (`correction`; r_t = exp(logp_pi - logp_mu), detached):
- "mask" (masked importance sampling, as slime's IcePop and verl's token mask): w_t = r_t where
  1/rho <= r_t <= rho, else 0. Where "truncate" keeps a token whose ratio is out of range at the bound, "mask"
  drops it: a token the two policies disagree on that much carries no gradient at all, in either direction.
- "decoupled" (AReaL's decoupled PPO): the behaviour policy gives the weight w_t = pi_prox / mu, with tokens above
  rho dropped (AReaL's `behav_imp_weight_cap`), and the proximal policy pi_prox, the trainer's weights before this
  step, gives PPO's clip: L = - w_t * min(q_t A, clip(q_t, 1 - eps, 1 + eps) A), q_t = pi / pi_prox. Our trainer
  makes one optimizer step per batch, so pi_prox is the policy whose log-probs the step computes (detached) and
  q_t = 1: the clip does not bind, and the update is the weight's, w_t A grad logp_pi. It bounds what the stale
  behaviour policy can do (drop, not shrink, tokens it sampled far off) and keeps the clip a trust region around
  the trainer's own last weights, not around the stale generator's (AReaL reports that the latter, naive PPO, i.e.
  `ppo_clip` with "truncate", collapses at high staleness; not measured here).
- "sequence" (a sequence-level geometric-mean ratio, as GSPO's and verl's `seq_mean` weights): one weight per
  response, w = min(exp(mean over its tokens of (logp_pi - logp_mu)), rho), for every token of it. The mean of
  log-ratios has far less variance than their sum (the product of token ratios), and no single token's weight can
  dominate a response.

The token band (`token_band`, on by default; the collapse guard's part in the loss): a token with
|logp_pi - logp_mu| > token_band has its policy-gradient term dropped (it stays in the normalisation's count, as a
masked token of "mask" does), whatever the correction: the trainer and the generator disagree on it by more than
any staleness explains, and its weight, truncated or not, is noise. The KL and entropy terms are not behaviour-policy
terms and stay.

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

import math
from typing import Optional

import torch

from megatron_rl.algorithms.settings import AIPOSettings


def segment_sums(values: torch.Tensor, segments: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence sums of `values` [b, s], each token's sequence id [b, s]) where a sequence is a row of [b, s]
    (`segments` None: padded micro-batches) or, in packed micro-batches, each id >= 0 of `segments` [b, s] (the
    packing's padding is -1, left out; the sums run past the last sequence with zeros, which hold no tokens)."""
    if segments is None:
        rows = torch.arange(values.shape[0], device=values.device).unsqueeze(-1).expand_as(values)
        return values.sum(-1), rows
    ids = segments.clamp(min=-1) + 1  # 0: padding
    # As many sums as tokens (an upper bound on the sequences; those past the last are zeros with no tokens): the
    # exact count would be a device-to-host read in the loss.
    sums = values.new_zeros(ids.numel() + 1).index_add_(0, ids.flatten(), values.flatten())
    return sums[1:], ids - 1


def sequence_means(values: torch.Tensor, mask: torch.Tensor,
                   segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's mean of `values` over its tokens in `mask`, its count of those tokens), per sequence
    (`segment_sums`)."""
    m = mask.to(values.dtype)
    sums, _ = segment_sums(values * m, segments)
    counts, _ = segment_sums(m, segments)
    return sums / counts.clamp(min=1), counts


def behaviour_weight(log_ratio: torch.Tensor, settings: AIPOSettings, mask: Optional[torch.Tensor] = None,
                     segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight of each token, whether the correction changed it: truncated or dropped) for the detached
    log-ratio logp_pi - logp_mu [..., s]. `mask` marks the response tokens [..., s] (all, when None); only
    "sequence" needs it, to average each response's log-ratios over its own tokens (a response is a row, or a
    segment of a packed row: `segments`)."""
    ratio = torch.exp(log_ratio)
    rho = settings.rho
    if not settings.importance_weights or settings.correction == "truncate":
        weight = torch.clamp(ratio, max=rho) if settings.importance_weights else torch.ones_like(ratio)
        return weight, ratio > rho
    if settings.correction in ("mask", "decoupled"):
        keep = log_ratio.abs() <= math.log(rho) if settings.correction == "mask" else ratio <= rho
        return torch.where(keep, ratio, torch.zeros_like(ratio)), ~keep
    means, _ = sequence_means(log_ratio, torch.ones_like(log_ratio) if mask is None else mask, segments)
    _, ids = segment_sums(log_ratio, segments)
    seq = torch.exp(means)[ids.clamp(min=0)]
    return torch.clamp(seq, max=rho), seq > rho


def aipo_token_loss(logp_pi: torch.Tensor, logp_mu: torch.Tensor, advantages: torch.Tensor,
                    settings: AIPOSettings, logp_ref: Optional[torch.Tensor] = None,
                    entropy: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                    segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """Per-token loss (same shape as logp_pi) and per-token statistics (detached). `mask`: the response tokens;
    `segments`: the sequences of packed rows (`behaviour_weight`)."""
    log_ratio = logp_pi.detach() - logp_mu
    ratio = torch.exp(log_ratio)
    weight, changed = behaviour_weight(log_ratio, settings, mask, segments)
    if settings.importance_weights and settings.correction == "decoupled":
        q = torch.exp(logp_pi - logp_pi.detach())  # pi / pi_prox: 1, with the gradient of logp_pi
        eps = 0.2 if settings.ppo_clip is None else settings.ppo_clip
        loss = -weight * torch.minimum(q * advantages, torch.clamp(q, 1 - eps, 1 + eps) * advantages)
    elif not settings.importance_weights:
        loss = -advantages * logp_pi
    elif settings.ppo_clip is None:
        loss = -weight * advantages * logp_pi
    else:
        r = torch.exp(logp_pi - logp_mu)
        clipped = torch.clamp(r, 1 - settings.ppo_clip, 1 + settings.ppo_clip)
        loss = -torch.minimum(r * advantages, clipped * advantages)
    stats = {"ratio": ratio, "truncated": changed.to(ratio.dtype),
             "kl_mu_pi": -log_ratio, "abs_log_ratio": log_ratio.abs()}
    if settings.token_band is not None:
        out_of_band = log_ratio.abs() > settings.token_band
        loss = torch.where(out_of_band, torch.zeros_like(loss), loss)
        stats["out_of_band"] = out_of_band.to(ratio.dtype)
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


def normalize(token_values: torch.Tensor, mask: torch.Tensor, normalization: str,
              segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose global ratio is the token-mean or the sequence-mean of `token_values` [b, s] (a sequence
    is a row, or a segment of a packed row: `segment_sums`)."""
    if normalization == "token":
        mask = mask.to(token_values.dtype)
        return (token_values * mask).sum(), mask.sum()
    seq_mean, per_seq_tokens = sequence_means(token_values, mask, segments)  # 0 where a sequence has no tokens
    return seq_mean.sum(), (per_seq_tokens > 0).to(token_values.dtype).sum()
