"""Per-token log-probabilities and entropies from vocabulary-parallel logits, without gathering the vocabulary.

Megatron-Core's `vocab_parallel_cross_entropy` reduces over the global `parallel_state` TP group (an executor
has its own group), modifies fp32 logits in place, keeps an fp32 softmax of the whole [tokens, vocab] block for
the backward pass, and counts the padding columns of the vocabulary in the softmax (padding depends on TP, so
losses would depend on the layout). These functions take an explicit group and a temperature, mask the padding,
leave the logits untouched, and work in chunks of tokens: per token they keep only the max and the partition
function, and recompute the softmax chunk by chunk in the backward pass. With a 128K vocabulary that is the
difference between several fp32 copies of the logits (8 GB each at 16K tokens) and about 0.5 GB of scratch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Scratch per chunk: chunk_tokens x local_vocab fp32 values.
_CHUNK_BYTES = 512 * 2**20


def _chunks(n_tokens: int, local_vocab: int):
    step = max(1, _CHUNK_BYTES // (4 * local_vocab))
    for start in range(0, n_tokens, step):
        yield slice(start, min(start + step, n_tokens))


def _maybe_compile(fn):
    """On GPUs, fuse each chunk's elementwise work and reductions into a few kernels (one read of the logits
    instead of one per operation); on CPUs run eagerly (compiling costs more than it saves in tests)."""
    compiled = {}

    def run(*args):
        if not args[0].is_cuda:
            return fn(*args)
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(fn, dynamic=False)
        return compiled["fn"](*args)

    return run


def _scaled(chunk: torch.Tensor, temperature: float, first_pad: int) -> torch.Tensor:
    """fp32 logits / T with the padded vocabulary columns at -inf."""
    x = chunk.float() / temperature
    if first_pad < x.shape[-1]:
        cols = torch.arange(x.shape[-1], device=x.device)
        x = torch.where(cols < first_pad, x, torch.full_like(x, float("-inf")))
    return x


@_maybe_compile
def _forward_chunk(chunk, idx, temperature: float, first_pad: int):
    """Per token, local to this vocabulary shard: max m, sum exp(x - m), sum exp(x - m)(x - m), x[target]."""
    x = _scaled(chunk, temperature, first_pad)
    # A shard of vocabulary padding only (small vocabularies at TP > 1) has max -inf; the most negative finite
    # value instead keeps its sums exact zeros (no inf - inf), and the other shards set the global max.
    m = x.amax(-1).clamp(min=torch.finfo(x.dtype).min)
    xs = x - m[:, None]
    e = torch.exp(xs)
    z = e.sum(-1)
    s = torch.where(e > 0, e * xs, torch.zeros_like(e)).sum(-1)
    picked = x.gather(1, idx[:, None]).squeeze(1)
    return m, z, s, picked


@_maybe_compile
def _backward_chunk(chunk, idx, local, m, z, mean_xs, g_lp, g_ent, temperature: float, first_pad: int):
    """d/dx of g_lp * logp(target) + g_ent * H, divided by T: (onehot - p) g_lp - p (x - m - mean_xs) g_ent."""
    x = _scaled(chunk, temperature, first_pad)
    xs = x - m[:, None]
    p = torch.exp(xs) / z[:, None]
    cols = torch.arange(x.shape[-1], device=x.device)
    onehot = ((cols[None, :] == idx[:, None]) & local[:, None]).float()
    d = (onehot - p) * g_lp[:, None]
    d = d - torch.where(p > 0, p * (xs - mean_xs[:, None]), torch.zeros_like(p)) * g_ent[:, None]
    return (d / temperature).to(chunk.dtype)


class _LogProbEntropy(torch.autograd.Function):
    """(log softmax(x)[target], entropy(softmax(x))) with x = logits / T over the real vocabulary."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size: int, temperature: float):
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        v = logits.shape[-1]
        start = tp_rank * v
        first_pad = min(max(vocab_size - start, 0), v)
        logits2d = logits.reshape(-1, v)
        t = target.reshape(-1)
        local = (t >= start) & (t < start + first_pad)
        idx = torch.where(local, t - start, torch.zeros_like(t))
        n = logits2d.shape[0]
        m, z, s, picked = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
        for sl in _chunks(n, v):
            m[sl], z[sl], s[sl], picked[sl] = _forward_chunk(logits2d[sl], idx[sl], temperature, first_pad)
        picked = torch.where(local, picked, torch.zeros_like(picked))
        if tp_group is not None and tp_group.size() > 1:
            # Combine shards: rescale each shard's sums to the global max M.
            big = m.clone()
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=tp_group)
            scale = torch.exp(m - big)
            sums = torch.stack([z * scale, (s + (m - big) * z) * scale, picked])
            dist.all_reduce(sums, group=tp_group)
            m, (z, s, picked) = big, sums
        mean_xs = s / z  # E_p[x - m]
        logprob = picked - m - torch.log(z)
        entropy = torch.log(z) - mean_xs
        ctx.save_for_backward(logits, idx, local, m, z, mean_xs)
        ctx.temperature, ctx.first_pad = temperature, first_pad
        return logprob.view(target.shape), entropy.view(target.shape)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, idx, local, m, z, mean_xs = ctx.saved_tensors
        v = logits.shape[-1]
        logits2d = logits.reshape(-1, v)
        n = logits2d.shape[0]
        g_lp = g_lp.reshape(-1).float() if g_lp is not None else torch.zeros(n, device=logits.device)
        g_ent = g_ent.reshape(-1).float() if g_ent is not None else torch.zeros(n, device=logits.device)
        grad = torch.empty_like(logits2d)
        for sl in _chunks(n, v):
            grad[sl] = _backward_chunk(logits2d[sl], idx[sl], local[sl], m[sl], z[sl], mean_xs[sl], g_lp[sl],
                                       g_ent[sl], ctx.temperature, ctx.first_pad)
        return grad.view_as(logits), None, None, None, None


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group, vocab_size: int,
                                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T), over the real (unpadded)
    vocabulary, as float32 [...]; one pass over the logits, both differentiable.

    `logits` is this rank's vocabulary shard [..., padded_vocab / tp]; `target` holds global token ids [...].
    The logits are not modified.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _LogProbEntropy.apply(logits, target, tp_group, vocab_size, float(temperature))


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] over the real vocabulary (see vocab_parallel_logprobs_and_entropy)."""
    return vocab_parallel_logprobs_and_entropy(logits, target, tp_group, vocab_size, temperature)[0]


def vocab_parallel_entropy(logits: torch.Tensor, tp_group, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the real vocabulary, per token (float32, differentiable)."""
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs_and_entropy(logits, target, tp_group, vocab_size, temperature)[1]


def target_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, tp_group, vocab_size: int,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] log-probs and entropies aligned with `tokens`: position t holds log p(tokens[t] | tokens[<t]) and
    the entropy of that distribution (computed from the logits at t - 1); position 0 holds 0.

    The logits are used whole (no slicing, which would copy a [b, s, vocab] block): the last position scores a
    dummy target and is dropped.
    """
    next_tokens = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, next_tokens, tp_group, vocab_size, temperature)
    shift = lambda t: torch.nn.functional.pad(t[:, :-1], (1, 0))  # noqa: E731
    return shift(lp), shift(ent)


def target_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tp_group, vocab_size: int,
                    temperature: float = 1.0) -> torch.Tensor:
    """The log-probs of `target_logprobs_and_entropy`."""
    return target_logprobs_and_entropy(logits, tokens, tp_group, vocab_size, temperature)[0]
