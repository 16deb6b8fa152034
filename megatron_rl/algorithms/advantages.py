"""Advantage estimators over groups of responses to the same prompt.

`rewards` [n] and `group_ids` [n] (responses with the same id answered the same prompt):
- group_mean (the LlamaRL paper): A_i = r_i - mean_j r_j over the group;
- rloo (leave-one-out): A_i = r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean_j r_j);
- grpo: A_i = (r_i - mean_j r_j) / (std_j r_j + eps), the sample std (unbiased=False as in GRPO's reference code).
"""

from __future__ import annotations

import torch


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    r = rewards.double()
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = (sq / count).sqrt()
    return inverse, count, mean, std


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "group_mean",
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages, float32 [n]."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    inverse, count, mean, std = _group_stats(rewards, group_ids)
    centered = rewards.double() - mean[inverse]
    if estimator == "group_mean":
        adv = centered
    elif estimator == "rloo":
        k = count[inverse]
        if torch.any(k < 2):
            raise ValueError("rloo needs at least 2 responses per prompt")
        adv = centered * k / (k - 1)
    elif estimator == "grpo":
        adv = centered / (std[inverse] + eps)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected group_mean, rloo or grpo")
    return adv.float()
