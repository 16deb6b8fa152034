"""Next-token cross entropy on vocabulary-parallel logits (used for warm-starting and for layout tests)."""

from __future__ import annotations

import torch

from megatron_rl.training.logprobs import target_logprobs


def make_lm_loss(tp_group, vocab_size: int):
    """A `TrainEngine` loss function: sum of -log p(next token) over `loss_mask`, and the token count.

    A micro-batch holds `tokens` [b, s] and `loss_mask` [b, s]; position t predicts token t + 1, so the last
    position is never a target.
    """

    def loss_fn(logits: torch.Tensor, batch: dict):
        mask = batch["loss_mask"].clone()
        mask[:, 0] = 0  # position 0 is never a target
        logp = target_logprobs(logits, batch["tokens"], tp_group, vocab_size, mask=mask)
        mask = mask.to(logp.dtype)
        loss_sum = -(logp * mask).sum()
        num_tokens = mask.sum().to(torch.int64)
        return loss_sum, num_tokens, {"loss": torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])}

    return loss_fn
