"""Seeded sampling draws from the (filtered, tempered) softmax; log-probs are the full tempered softmax's."""

import math

import pytest
import torch

from megatron_rl.inference.sampling import sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 20_000


def _draw(temperature=1.0, top_p=1.0, top_k=0, steps=0):
    """DRAWS rows of the same logits, one seed each; returns (tokens, logprobs)."""
    n, v = DRAWS, LOGITS.numel()
    logits = LOGITS.expand(n, v).contiguous()
    full = lambda x, dt=torch.float32: torch.full((n,), x, dtype=dt)  # noqa: E731
    return sample(logits, full(temperature), full(top_p), full(top_k, torch.long), torch.arange(n),
                  full(steps, torch.long), filtering=top_p < 1 or top_k > 0, noise=temperature > 0)


def _chi2_ok(tokens, probs):
    """Pearson's chi-square against `probs` below its 0.999 quantile (tokens of probability 0 must never occur)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = probs[support].double() * DRAWS
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile.
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    return stat <= bound, stat, bound


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_draws_follow_the_tempered_softmax(temperature):
    tokens, logprobs = _draw(temperature)
    probs = torch.softmax(LOGITS / temperature, -1)
    ok, stat, bound = _chi2_ok(tokens, probs)
    assert ok, (stat, bound)
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-6)


def test_top_k_and_top_p_draw_from_the_truncated_distribution_and_report_the_full_one():
    probs = torch.softmax(LOGITS, -1)
    tokens, logprobs = _draw(top_k=3)
    want = torch.where(torch.arange(6) < 3, probs, torch.zeros_like(probs))
    ok, stat, bound = _chi2_ok(tokens, want / want.sum())
    assert ok, (stat, bound)
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-6)  # mu is the untruncated softmax
    # top_p: the smallest prefix (by probability) whose mass reaches p. Here p = 0.8 keeps the first 3 tokens.
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    tokens, _ = _draw(top_p=0.8)
    ok, stat, bound = _chi2_ok(tokens, want / want.sum())
    assert ok, (stat, bound)


def test_the_same_seed_and_step_give_the_same_token_and_other_steps_differ():
    a, _ = _draw(steps=3)
    b, _ = _draw(steps=3)
    c, _ = _draw(steps=4)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.3


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens, logprobs = sample(logits, temperature, torch.ones(4), torch.zeros(4, dtype=torch.long),
                              torch.arange(4), torch.zeros(4, dtype=torch.long), filtering=False, noise=True)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1).max())
