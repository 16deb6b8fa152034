"""Per-token log-probabilities from vocabulary-parallel logits, without gathering the vocabulary.

Megatron-Core's `vocab_parallel_cross_entropy` reduces over the global `parallel_state` TP group (an executor
has its own group), modifies fp32 logits in place, and counts the padding columns of the vocabulary in the
softmax (padding depends on TP, so losses would depend on the layout). This function reuses its arithmetic
(`VocabParallelCrossEntropy`'s static steps) with an explicit group, a temperature, padding masked out, and
leaves the logits untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size: int, temperature: float):
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        part = logits.shape[-1]
        start, end = tp_rank * part, (tp_rank + 1) * part
        x = logits.to(torch.float32, copy=True)
        if temperature != 1.0:
            x.div_(temperature)
        if end > vocab_size:
            x[..., max(vocab_size - start, 0):] = float("-inf")
        x, logits_max = VocabParallelCrossEntropy.calculate_logits_max(x)
        if tp_group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(x, target, logits_max, start, end)
        )
        if tp_group is not None:
            dist.all_reduce(predicted, group=tp_group)
            dist.all_reduce(sum_exp, group=tp_group)
        logprob = predicted - torch.log(sum_exp)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        return logprob

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        # d logp / d logits = (onehot - softmax) / T
        grad_2d, arange_1d, update, grad = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad_2d[arange_1d, masked_target_1d] -= update
        grad.mul_(-grad_output.unsqueeze(-1) / ctx.temperature)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    vocab_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax(logits / T)[target] over the real (unpadded) vocabulary.

    `logits` is this rank's vocabulary shard [..., padded_vocab / tp]; `target` holds global token ids [...].
    Differentiable; the logits are not modified.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProb.apply(logits, target, tp_group, vocab_size, float(temperature))
