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

from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_rules
from megatron_rl.compat.compiled import CompiledKernel

# Scratch per chunk: chunk_tokens x local_vocab fp32 values.
_CHUNK_BYTES = 512 * 2**20
# x - max is floored here before exp: a token that far below the max has probability below e^-60 (1e-26), which no
# fp32 sum holding the max's exp(0) = 1 can see, nor any gradient. Without the floor, logits that spread over more
# than 87 (common for a trained model at temperature < 1 over a 49K+ vocabulary) make exp, and the products with
# its results, subnormal; CPUs compute those several times slower (an eager exp on a [521, 49152] chunk: 277 ms
# instead of about 50), and a subnormal probability times a per-token gradient underflows anyway.
_FLOOR = -60.0


def _chunks(n_tokens: int, local_vocab: int):
    step = max(1, _CHUNK_BYTES // (4 * local_vocab))
    for start in range(0, n_tokens, step):
        yield slice(start, min(start + step, n_tokens))


def _chunk_key(chunk, idx, *rest) -> tuple:
    first_pad = rest[-1]  # the temperature, a float, is part of every argument signature already
    return (first_pad == 0, first_pad == 1, first_pad == chunk.shape[1])


def _maybe_compile(name: str):
    """On GPUs, fuse each chunk's elementwise work and reductions into a few kernels (one read of the logits
    instead of one per operation); on CPUs run eagerly (compiling costs more than it saves in tests), except in the
    CUDA-rules mode. The number of tokens is dynamic, so micro-batches of any length share a graph; the
    specializations are the logits' dtype, the temperature, whether the shard is all, some or none padding, and a
    single token or several."""

    def wrap(fn):
        # Two graphs a key: on an H100 one key recompiled once for a reason the CPU's tracing does not show (the
        # alignment of a chunk sliced from the logits is now in the key, the likely one).
        kernel = CompiledKernel(fn, name, _chunk_key, max_keys=8, graphs_per_key=2)

        def run(*args):
            return kernel(*args) if cuda_rules.gpu_path(args[0], cuda_rules.enabled()) else fn(*args)

        run.kernel = kernel
        return run

    return wrap


@_maybe_compile("logprobs.forward_chunk")
def _forward_chunk(chunk, idx, temperature: float, first_pad: int):
    """Per token, local to this vocabulary shard: max m, sum exp(x - m), sum exp(x - m)(x - m), x[target], with
    x = logits / T over the shard's real columns (the padded ones, from `first_pad` on, are left out), x - m floored
    at `_FLOOR` in the sums.

    Written as few passes over the chunk as eager mode allows (in-place where the value is not needed again):
    on CPUs nothing fuses them, and each pass reads and writes a whole [tokens, vocab] fp32 block."""
    n = chunk.shape[0]
    if first_pad == 0:
        # A shard of vocabulary padding only (small vocabularies at TP > 1): the most negative finite max keeps
        # its sums exact zeros (no inf - inf), and the other shards set the global max.
        m = torch.full((n,), torch.finfo(torch.float32).min, device=chunk.device)
        zero = torch.zeros(n, device=chunk.device)
        return m, zero, zero.clone(), zero.clone()
    x = chunk[:, :first_pad].to(torch.float32, copy=True)  # a copy even of fp32 logits: they stay untouched
    if temperature != 1.0:
        x.div_(temperature)
    picked = x.gather(1, idx.clamp(max=first_pad - 1)[:, None]).squeeze(1)
    m = x.amax(-1)
    xs = x.sub_(m[:, None]).clamp_min_(_FLOOR)
    e = torch.exp(xs)
    z = e.sum(-1)
    s = torch.linalg.vecdot(e, xs)
    return m, z, s, picked


@_maybe_compile("logprobs.backward_chunk")
def _backward_chunk(chunk, idx, local, m, z, mean_xs, g_lp, g_ent, temperature: float, first_pad: int):
    """d/dx of g_lp * logp(target) + g_ent * H, divided by T: (onehot - p) g_lp - p (x - m - mean_xs) g_ent,
    i.e. -p (g_lp + g_ent (x - m - mean_xs)) plus g_lp at the target, over the real columns only (the caller
    writes it into the gradient, whose padded columns stay 0; first_pad > 0)."""
    x = chunk[:, :first_pad].to(torch.float32, copy=True)  # a copy even of fp32 logits: they stay untouched
    if temperature != 1.0:
        x.div_(temperature)
    xs = x.sub_(m[:, None]).clamp_min_(_FLOOR)
    p = torch.exp(xs).div_(z[:, None])
    weight = xs.sub_(mean_xs[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
    d = p.mul_(weight).neg_()
    rows = torch.arange(d.shape[0], device=d.device)
    d.index_put_((rows, idx.clamp(max=first_pad - 1)), torch.where(local, g_lp, torch.zeros_like(g_lp)),
                 accumulate=True)
    if temperature != 1.0:
        d.div_(temperature)
    return d.to(chunk.dtype)


def _combine_shards(m, z, s, picked, tp_group):
    """The per-token statistics over the whole vocabulary from every shard's (`_forward_chunk`), in one
    collective: each shard's sums are rescaled from its own max to the global max M and added in rank order.

    An all-gather of the four statistics, where a max all-reduce followed by a sum all-reduce would cost two: on a
    CPU a collective costs more than this arithmetic. With two shards every sum adds the same two values either
    way, so the results are the same bits."""
    tp = tp_group.size()
    parts = torch.empty(tp * 4, m.shape[0], dtype=torch.float32, device=m.device)
    dist.all_gather_into_tensor(parts, torch.stack([m, z, s, picked]), group=tp_group)
    parts = parts.view(tp, 4, -1)
    big = parts[:, 0].amax(0)
    total = None
    for m_i, z_i, s_i, picked_i in parts:
        scale = torch.exp(m_i - big)
        terms = torch.stack([z_i * scale, (s_i + (m_i - big) * z_i) * scale, picked_i])
        total = terms if total is None else total + terms
    return big, total[0], total[1], total[2]


class _LogProbEntropy(torch.autograd.Function):
    """(log softmax(x)[target], entropy(softmax(x))) with x = logits / T over the real vocabulary."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size: int, temperature: float, mask):
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        v = logits.shape[-1]
        start = tp_rank * v
        first_pad = min(max(vocab_size - start, 0), v)
        logits2d = logits.reshape(-1, v)
        # The positions computed: all, or those `mask` selects (the others get 0 and no gradient).
        rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
        t = target.reshape(-1) if rows is None else target.reshape(-1)[rows]
        local = (t >= start) & (t < start + first_pad)
        idx = torch.where(local, t - start, torch.zeros_like(t))
        n = t.shape[0]
        m, z, s, picked = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
        for sl in _chunks(n, v):
            chunk = logits2d[sl] if rows is None else logits2d[rows[sl]]
            m[sl], z[sl], s[sl], picked[sl] = _forward_chunk(chunk, idx[sl], temperature, first_pad)
        picked = torch.where(local, picked, torch.zeros_like(picked))
        if tp_group is not None and tp_group.size() > 1:
            m, z, s, picked = _combine_shards(m, z, s, picked, tp_group)
        mean_xs = s / z  # E_p[x - m]
        logprob = picked - m - torch.log(z)
        entropy = torch.log(z) - mean_xs
        if rows is not None:
            logprob = torch.zeros(target.numel(), device=logits.device).index_copy_(0, rows, logprob)
            entropy = torch.zeros(target.numel(), device=logits.device).index_copy_(0, rows, entropy)
        ctx.save_for_backward(logits, idx, local, m, z, mean_xs, rows)
        ctx.temperature, ctx.first_pad = temperature, first_pad
        return logprob.view(target.shape), entropy.view(target.shape)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, idx, local, m, z, mean_xs, rows = ctx.saved_tensors
        v = logits.shape[-1]
        logits2d = logits.reshape(-1, v)
        n = idx.shape[0]
        pick = (lambda g: g.reshape(-1).float()) if rows is None else (lambda g: g.reshape(-1)[rows].float())
        g_lp = pick(g_lp) if g_lp is not None else torch.zeros(n, device=logits.device)
        g_ent = pick(g_ent) if g_ent is not None else torch.zeros(n, device=logits.device)
        first_pad = ctx.first_pad
        # Written only where computed: zeros first wherever some part is not (unselected rows, padded columns).
        whole = rows is None and first_pad == v
        grad = torch.empty_like(logits2d) if whole else torch.zeros_like(logits2d)
        if first_pad == 0:
            return grad.view_as(logits), None, None, None, None, None
        for sl in _chunks(n, v):
            chunk = logits2d[sl] if rows is None else logits2d[rows[sl]]
            d = _backward_chunk(chunk, idx[sl], local[sl], m[sl], z[sl], mean_xs[sl], g_lp[sl], g_ent[sl],
                                ctx.temperature, first_pad)
            if rows is None:
                grad[sl, :first_pad] = d
            else:
                grad[rows[sl], :first_pad] = d
        return grad.view_as(logits), None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group, vocab_size: int,
                                        temperature: float = 1.0,
                                        mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T), over the real (unpadded)
    vocabulary, as float32 [...]; one pass over the logits, both differentiable.

    `logits` is this rank's vocabulary shard [..., padded_vocab / tp]; `target` holds global token ids [...].
    The logits are not modified. `mask` [...] (bool) limits the work to the positions it selects (a loss over
    response tokens needs no prompt position): the others hold 0 and get no gradient. Every TP rank must pass
    the same mask.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if mask is not None and mask.shape != target.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from target shape {tuple(target.shape)}")
    return _LogProbEntropy.apply(logits, target, tp_group, vocab_size, float(temperature),
                                 None if mask is None else mask.bool())


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] over the real vocabulary (see vocab_parallel_logprobs_and_entropy)."""
    return vocab_parallel_logprobs_and_entropy(logits, target, tp_group, vocab_size, temperature)[0]


def vocab_parallel_entropy(logits: torch.Tensor, tp_group, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the real vocabulary, per token (float32, differentiable)."""
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs_and_entropy(logits, target, tp_group, vocab_size, temperature)[1]


def logit_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions whose logits give the log-probs `mask` asks for: position t's logits score tokens[t + 1], so
    [b, s] `mask` (aligned with the tokens) shifted one to the left, the last column False."""
    return torch.nn.functional.pad(mask[:, 1:].bool(), (0, 1))


def target_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, tp_group, vocab_size: int,
                                temperature: float = 1.0, mask: Optional[torch.Tensor] = None,
                                logits_at_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] log-probs and entropies aligned with `tokens`: position t holds log p(tokens[t] | tokens[<t]) and
    the entropy of that distribution (computed from the logits at t - 1); position 0 holds 0, and so does every
    position outside `mask` when one is given.

    `logits` are [b, s, v/tp], used whole (no slicing, which would copy a [b, s, vocab] block: the last position
    scores a dummy target and is dropped); or, with `logits_at_mask`, only the `logit_positions(mask)` ones, as
    [1, n, v/tp] in row-major order (what the model returns under `engine.logits_only_at`).
    """
    next_tokens = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    # `mask` is aligned with tokens (position t: is log p(tokens[t]) needed?), computed from the logits at t - 1.
    next_mask = None if mask is None else logit_positions(mask)
    shift = lambda t: torch.nn.functional.pad(t[:, :-1], (1, 0))  # noqa: E731
    if logits_at_mask:
        n = None if next_mask is None else int(next_mask.sum())
        if logits.shape[:2] != (1, n):
            raise ValueError(f"logits {tuple(logits.shape)} are not the {n} positions the mask selects")
        lp, ent = vocab_parallel_logprobs_and_entropy(logits, next_tokens[next_mask][None], tp_group, vocab_size,
                                                      temperature)
        whole = [torch.zeros(tokens.shape, dtype=t.dtype, device=t.device).masked_scatter(next_mask, t[0])
                 for t in (lp, ent)]
        return shift(whole[0]), shift(whole[1])
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, next_tokens, tp_group, vocab_size, temperature,
                                                  next_mask)
    return shift(lp), shift(ent)


def target_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tp_group, vocab_size: int,
                    temperature: float = 1.0, mask: Optional[torch.Tensor] = None,
                    logits_at_mask: bool = False) -> torch.Tensor:
    """The log-probs of `target_logprobs_and_entropy`."""
    return target_logprobs_and_entropy(logits, tokens, tp_group, vocab_size, temperature, mask, logits_at_mask)[0]
