"""Packed micro-batches: whole sequences concatenated into rows of a token budget, so a step pays for its tokens
rather than for padding every sequence to the longest.

Reasoning rollouts are uneven (a 100-token answer beside a 4,000-token chain of thought); padding each micro-batch
to the step's longest sequence spends most of the trainer's FLOPs on padding. Here a micro-batch is one row [1, T]
holding as many whole sequences as fit `budget` tokens, with their boundaries (`cu_seqlens`, Megatron-Core's THD
format): attention stays within each sequence (`models.attention.SDPAttention` on CPUs and without
transformer-engine, transformer-engine's attention where it runs), positions and RoPE restart at each sequence, and
every per-token quantity is the padded path's. The per-sequence quantities (the "sequence" normalization and
importance weight) reduce over `segments`, each token's sequence in the row (-1: the row's padding).

Shapes: every micro-batch of a step has the same T (the fullest row, rounded up to a multiple of 8), because
Megatron-Core's pipeline schedule sends fixed-shape activations between stages. DP ranks get token-balanced shares
(longest sequences first, each to the rank holding the fewest tokens) and the same number of micro-batches: a
rank whose sequences fit in fewer rows spreads them over as many (or, where they do not fit spread, adds rows of
padding only), so no rank waits for another's extra micro-batch at the gradient reduction.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.rollout import RolloutBatch
from megatron_rl.training.logprobs import logit_positions


def placeholder_routes(rows: int, t: int, routes: torch.Tensor) -> torch.Tensor:
    """[rows, t, layers, k] routes of `routes`' dtype holding experts 0..k-1 (padding: any k distinct experts)."""
    k = routes.shape[-1]
    return torch.arange(k, dtype=routes.dtype).expand(rows, t, routes.shape[2], k).clone()


def dp_shares(lengths: list[int], dp: int) -> list[list[int]]:
    """The sequences (indices into `lengths`) of each DP rank, balancing tokens: longest first, each to the rank
    holding the fewest tokens so far (the lowest rank on a tie); each share in batch order."""
    load, shares = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]


def first_fit(lengths: dict[int, int], budget: int) -> list[list[int]]:
    """Rows of at most `budget` tokens (first fit, longest first): the fewest rows that greedy packing finds."""
    rows, loads = [], []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit trainer.max_tokens_per_micro_batch="
                             f"{budget}")
        for r, load in enumerate(loads):
            if load + lengths[i] <= budget:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    return rows


def spread(lengths: dict[int, int], rows: list[list[int]], count: int, budget: int) -> list[list[int]]:
    """`rows` (at most `count`) made `count` rows of near-equal tokens: the sequences re-spread over `count` rows
    (longest first, each to the emptiest row) where that keeps every row within `budget`, else `rows` and rows of
    padding only (empty lists). Even rows matter because every row is padded to the fullest (module docstring):
    first fit alone fills its first rows to the budget and leaves the last nearly empty."""
    spread_rows, loads = [[] for _ in range(count)], [0] * count
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        r = min(range(count), key=lambda r: (loads[r], r))
        spread_rows[r].append(i)
        loads[r] += lengths[i]
    if max(loads) <= budget:
        return spread_rows
    return rows + [[] for _ in range(count - len(rows))]


def plan_rows(lengths: list[int], dp: int, budget: int) -> list[list[list[int]]]:
    """Per DP rank, its micro-batches' sequences (indices into `lengths`), each row within `budget` tokens, every
    rank with the same number of rows. Every rank computes the same plan from the same batch."""
    per_rank = []
    for share in dp_shares(lengths, dp):
        mine = {i: lengths[i] for i in share}
        per_rank.append((mine, first_fit(mine, budget)))
    count = max(max(len(rows) for _, rows in per_rank), 1)
    return [[sorted(row) for row in spread(mine, rows, count, budget)] for mine, rows in per_rank]


def row_length(plan: list[list[list[int]]], lengths: list[int]) -> int:
    """The T of every micro-batch: the fullest row's tokens, rounded up to a multiple of 8 (at least 8)."""
    fullest = max((sum(lengths[i] for i in row) for rows in plan for row in rows), default=0)
    return max(-(-fullest // 8) * 8, 8)


def packed_micro_batches(batch: RolloutBatch, dp: int, dp_rank: int, budget: int,
                         device: Optional[torch.device] = None, pad_id: int = 0) -> list[dict]:
    """This DP rank's micro-batches of `batch` packed into rows of at most `budget` tokens (module docstring).

    Each is a dict of [1, T] tensors: tokens, position_ids (restarting at each sequence), loss_mask (response tokens;
    never a sequence's first token, whose logits would be the previous sequence's), logit_positions, logp_mu, adv
    (each token its sequence's advantage), segments (each token's sequence in the row, -1 on padding); and
    cu_seqlens [k + 2] int32 (the sequences' boundaries, then the row's padding as one more segment), with
    host_bounds (the same as a list) and max_seqlen; with `batch.routes`, routes [1, T, layers, k] (routing replay;
    placeholder experts on padding)."""
    if batch.advantages is None:
        raise ValueError("the batch has no advantages; compute them before training")
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    plan = plan_rows(lengths, dp, budget)
    t = row_length(plan, lengths)
    response = batch.response_mask()
    out = []
    for row in plan[dp_rank]:
        mb = {"tokens": torch.full((1, t), pad_id, dtype=torch.long),
              "position_ids": torch.zeros(1, t, dtype=torch.long),
              "loss_mask": torch.zeros(1, t, dtype=torch.bool), "logp_mu": torch.zeros(1, t),
              "adv": torch.zeros(1, t), "segments": torch.full((1, t), -1, dtype=torch.long)}
        bounds = [0]
        for k, i in enumerate(row):
            a, n = bounds[-1], lengths[i]
            mb["tokens"][0, a:a + n] = batch.tokens[i, :n]
            mb["position_ids"][0, a:a + n] = torch.arange(n)
            mb["loss_mask"][0, a:a + n] = response[i, :n]
            mb["loss_mask"][0, a] = False
            mb["logp_mu"][0, a:a + n] = batch.behaviour_logprobs[i, :n]
            mb["adv"][0, a:a + n] = batch.advantages[i]
            mb["segments"][0, a:a + n] = k
            if batch.routes is not None:
                mb.setdefault("routes", placeholder_routes(1, t, batch.routes))[0, a:a + n] = batch.routes[i, :n]
            bounds.append(a + n)
        if bounds[-1] < t:
            bounds.append(t)
        mb["logit_positions"] = logit_positions(mb["loss_mask"])
        if device is not None:
            mb = {k: v.to(device) for k, v in mb.items()}
        mb["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
        mb["host_bounds"] = bounds
        mb["max_seqlen"] = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        out.append(mb)
    return out
