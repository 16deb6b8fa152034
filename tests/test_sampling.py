"""Seeded sampling draws from the (filtered, tempered) softmax; log-probs are the full tempered softmax's; stream
seeds never collide structurally and every bit of a seed moves its stream."""

import math

import pytest
import torch

from megatron_rl.controller.executors import eval_seed, rollout_seed
from megatron_rl.inference.sampling import SamplingParams, sample, stream_seed, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 20_000


STREAM_SEEDS = torch.tensor([stream_seed(7, i) for i in range(DRAWS)])  # 63-bit seeds, as runs draw with


def _draw(temperature=1.0, top_p=1.0, top_k=0, steps=0, seeds=None):
    """DRAWS rows of the same logits, one seed each (0, 1, ... unless given); returns (tokens, logprobs)."""
    n, v = DRAWS, LOGITS.numel()
    logits = LOGITS.expand(n, v).contiguous()
    full = lambda x, dt=torch.float32: torch.full((n,), x, dtype=dt)  # noqa: E731
    seeds = torch.arange(n) if seeds is None else seeds
    return sample(logits, full(temperature), full(top_p), full(top_k, torch.long), seeds,
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


@pytest.mark.parametrize("small_seeds", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_draws_follow_the_tempered_softmax(temperature, small_seeds):
    tokens, logprobs = _draw(temperature, seeds=None if small_seeds else STREAM_SEEDS)
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


STREAM_1234_0_0 = 5141271349408425056  # stream_seed(1234, 0, 0): run.seed's default, batch 0, prompt 0


def _old_rollout_seed(run_seed, batch, prompt):
    """The formula stream_seed replaced, for the collisions it had."""
    return run_seed * 7919 + batch * 1000 + prompt


def test_stream_seeds_do_not_collide_where_the_old_formulas_did():
    # Batch b's prompt 1000 was batch b + 1's prompt 0; run seeds 37 apart (37 * 7919 = 293003) shifted batches by
    # 293 and prompts by 3; eval prompt i (424242 + i) was a training prompt; samples kept 31 bits of their request's.
    assert _old_rollout_seed(5, 3, 1000) == _old_rollout_seed(5, 4, 0)
    assert _old_rollout_seed(1271, 0, 0) == _old_rollout_seed(1234, 293, 3)
    assert 424242 + 0 == _old_rollout_seed(0, 424, 242)
    assert (5 * 1_000_003) & 0x7FFFFFFF == ((5 + 2**31) * 1_000_003) & 0x7FFFFFFF
    assert rollout_seed(5, 3, 1000) != rollout_seed(5, 4, 0)
    assert rollout_seed(1271, 0, 0) != rollout_seed(1234, 293, 3)
    assert stream_seed(5, 0) != stream_seed(5 + 2**31, 0)

    grid = [(s, b, p) for s in (0, 37, 1234, 1271) for b in (0, 1, 2, 293, 294, 424) for p in range(1004)]
    assert len({_old_rollout_seed(*key) for key in grid}) < len(grid)
    requests = [rollout_seed(*key) for key in grid] + [eval_seed(i) for i in range(1004)]
    samples = [stream_seed(r, k) for r in requests for k in range(4)]
    assert len(set(requests)) == len(requests)
    assert len(set(samples)) == len(samples)
    assert all(0 <= s < 2**63 for s in samples)


def test_stream_seeds_are_a_pure_function_of_their_keys():
    assert rollout_seed(1234, 17, 5) == stream_seed(1234, 17, 5) == stream_seed(1234, 17, 5)
    assert eval_seed(3) == eval_seed(3)
    # Order and length matter; the largest keys are accepted, negative ones and non-integers are not.
    assert len({stream_seed(1, 2), stream_seed(2, 1), stream_seed(1, 2, 0), stream_seed(1), stream_seed()}) == 5
    stream_seed(2**64 - 1, 2**64 - 1)
    for bad in ((-1,), (2**64,), (1.5,)):
        with pytest.raises((ValueError, TypeError)):
            stream_seed(*bad)
    assert SamplingParams(seed=-1).problems() == ["seed=-1 must be in [0, 2**64)"]
    # A recorded value: if it changes, every run's samples change (say so in docs/benchmarks.md).
    assert stream_seed(1234, 0, 0) == STREAM_1234_0_0
    a, _ = _draw(steps=5, seeds=STREAM_SEEDS)
    b, _ = _draw(steps=5, seeds=STREAM_SEEDS.clone())
    assert torch.equal(a, b)


def test_seeds_that_differ_only_in_their_high_bits_draw_different_uniforms():
    steps = torch.arange(256).repeat_interleave(4)
    low = torch.tensor([0, 5, 2**31 + 3, 2**32 - 1]).repeat(256)
    u = uniform(low, steps)
    for high in (1, 2, 2**20 + 7, 2**31 - 1):
        v = uniform(low + (high << 32), steps)
        assert (u != v).all(), high
    # Seeds that differ only in their low half still differ at every step, as before.
    assert (uniform(low ^ 1, steps) != u).all()
