"""AIPO and advantages against hand computations."""

import pytest
import torch

from megatron_rl.algorithms import AIPOSettings, aipo_token_loss, compute_advantages, normalize


def _policy(theta, tokens):
    # A "policy" over 5 tokens whose log-probs are log_softmax(theta) (one context for every position).
    return torch.log_softmax(theta, -1)[tokens]


def _grad_logp(theta, y):
    g = -torch.softmax(theta, -1).detach().clone()
    g[y] += 1.0
    return g


def test_gradient_equals_closed_form_with_truncation():
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 3, 2, 3])
    adv = torch.tensor([1.5, -0.5, 2.0, 1.0], dtype=torch.float64)
    logp_pi = _policy(theta, y)
    # Behaviour log-probs chosen so the weights are 0.5, 1, 8 (> rho = 4, truncated) and 2.
    w_true = torch.tensor([0.5, 1.0, 8.0, 2.0], dtype=torch.float64)
    logp_mu = logp_pi.detach() - torch.log(w_true)
    settings = AIPOSettings(rho=4.0)
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, settings)
    loss.mean().backward()
    w = torch.clamp(w_true, max=4.0)
    expected = -sum(w[i] * adv[i] * _grad_logp(theta, y[i]) for i in range(4)) / 4
    torch.testing.assert_close(theta.grad, expected, rtol=1e-12, atol=1e-12)
    assert stats["truncated"].tolist() == [0.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(stats["ratio"], w_true)


def test_without_importance_weights_the_behaviour_policy_is_ignored():
    """The uncorrected baseline: grad = -mean(A * grad logp_pi) whatever mu was; the statistics still report the
    trainer-generator gap |logp_pi - logp_mu|."""
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 3, 2])
    adv = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
    logp_pi = _policy(theta, y)
    logp_mu = logp_pi.detach() - torch.log(torch.tensor([0.5, 3.0, 8.0], dtype=torch.float64))
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(importance_weights=False))
    loss.mean().backward()
    expected = -sum(adv[i] * _grad_logp(theta, y[i]) for i in range(3)) / 3
    torch.testing.assert_close(theta.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats["abs_log_ratio"], torch.log(torch.tensor([2.0, 3.0, 8.0], dtype=torch.float64)))
    with pytest.raises(ValueError, match="ppo_clip needs algorithm.importance_weights"):
        AIPOSettings(importance_weights=False, ppo_clip=0.2)


def test_on_policy_reduces_to_reinforce_with_baseline():
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, 4, 4, 0, 2, 3])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = compute_advantages(rewards, groups, "group_mean").double()
    logp = _policy(theta, y)
    loss, _ = aipo_token_loss(logp, logp.detach(), adv, AIPOSettings(rho=2.0))
    loss.mean().backward()
    reinforce = theta.detach().clone().requires_grad_(True)
    (-(adv * _policy(reinforce, y)).mean()).backward()
    torch.testing.assert_close(theta.grad, reinforce.grad)


def test_ppo_clip_kl_and_entropy_terms():
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1])
    logp = _policy(theta, y)
    logp_mu = logp.detach() - torch.log(torch.tensor([1.5, 0.9], dtype=torch.float64))  # ratios 1.5, 0.9
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = aipo_token_loss(logp, logp_mu, adv, AIPOSettings(ppo_clip=0.2))
    # ratio 1.5 with A > 0 is clipped to 1.2 (no gradient); ratio 0.9 with A < 0: min(-0.9, -0.9) unclipped.
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, 0.9], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(theta.grad, 0.9 * _grad_logp(theta, 1))
    ref = logp.detach() + 0.1
    ent = torch.tensor([0.7, 0.2], dtype=torch.float64)
    loss2, stats = aipo_token_loss(logp.detach(), logp.detach(), torch.zeros(2, dtype=torch.float64),
                                   AIPOSettings(kl_coef=0.5, entropy_coef=0.1), logp_ref=ref, entropy=ent)
    k3 = torch.exp(torch.tensor(0.1)) - 0.1 - 1
    torch.testing.assert_close(loss2, (0.5 * k3 - 0.1 * ent).to(loss2.dtype))


def test_advantage_estimators_match_hand_computation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    g = torch.tensor([7, 7, 7, 7, 2, 2])
    # group 7: mean 0.5, population std 0.5; group 2: mean 2, std 1
    torch.testing.assert_close(compute_advantages(r, g, "group_mean"), torch.tensor([0.5, -0.5, -0.5, 0.5, 1, -1]))
    # RLOO: r_i - mean of the others
    rloo = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 1, 1 - 3])
    torch.testing.assert_close(compute_advantages(r, g, "rloo"), rloo)
    torch.testing.assert_close(compute_advantages(r, g, "grpo"), torch.tensor([1.0, -1, -1, 1, 1, -1]),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        compute_advantages(torch.ones(3), torch.tensor([0, 0, 1]), "rloo")


def test_token_and_sequence_normalisation():
    v = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    s, c = normalize(v, m, "token")
    assert (s.item(), c.item()) == (10.0, 4.0)
    s, c = normalize(v, m, "sequence")
    assert (s.item(), c.item()) == (2.0 + 4.0, 2.0)  # means 2 and 4; the empty row does not count


def test_prompt_and_padding_positions_get_no_gradient():
    from megatron_rl.training.rl_trainer import RLTrainerSettings, aipo_microbatch_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 16, requires_grad=True)
    tokens = torch.randint(0, 12, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    mb = {"tokens": tokens, "loss_mask": mask, "logp_mu": torch.where(mask, torch.full((2, 6), -2.0),
                                                                        torch.full((2, 6), float("nan"))),
          "adv": torch.tensor([1.0, -2.0])}
    loss, count, _ = aipo_microbatch_loss(logits, mb, None, 12, RLTrainerSettings())
    assert count.item() == 4 and torch.isfinite(loss)
    loss.backward()
    # logits at position t score token t + 1: only positions whose next token is a response token get gradient.
    has_grad = logits.grad.abs().sum(-1) > 0
    assert has_grad.tolist() == [[False, True, True, True, False, False], [False, False, True, False, False, False]]


# ---- the peers' corrections (algorithm.correction), each against its closed form -----------------------------------
def _tokens(weights):
    """A policy over 5 tokens, four sampled tokens, and behaviour log-probs that make pi/mu = `weights`."""
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 3, 2, 3])
    adv = torch.tensor([1.5, -0.5, 2.0, 1.0], dtype=torch.float64)
    logp_pi = _policy(theta, y)
    logp_mu = logp_pi.detach() - torch.log(torch.tensor(weights, dtype=torch.float64))
    return theta, y, adv, logp_pi, logp_mu


def _expected(theta, y, adv, w):
    return -sum(w[i] * adv[i] * _grad_logp(theta, y[i]) for i in range(len(y))) / len(y)


def test_masked_importance_sampling_drops_tokens_out_of_range_in_either_direction():
    """w = pi/mu inside [1/rho, rho], else 0 (not the bound): 0.1 < 1/4 and 8 > 4 carry no gradient."""
    theta, y, adv, logp_pi, logp_mu = _tokens([0.1, 1.0, 8.0, 2.0])
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=4.0, correction="mask"))
    loss.mean().backward()
    torch.testing.assert_close(theta.grad, _expected(theta, y, adv, [0.0, 1.0, 0.0, 2.0]), rtol=1e-12, atol=1e-12)
    assert stats["truncated"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_decoupled_weights_by_the_behaviour_policy_drops_above_the_cap_and_clips_around_the_proximal_one():
    """AReaL: w = pi_prox/mu (pi_prox = the step's own weights), 0 above rho; the clip of pi/pi_prox = 1 does not
    bind in one step. Naive PPO (`ppo_clip` on pi/mu) instead gives the far-off tokens no gradient at all."""
    theta, y, adv, logp_pi, logp_mu = _tokens([0.5, 1.0, 8.0, 2.0])
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=4.0, correction="decoupled", ppo_clip=0.2))
    loss.mean().backward()
    torch.testing.assert_close(theta.grad, _expected(theta, y, adv, [0.5, 1.0, 0.0, 2.0]), rtol=1e-12, atol=1e-12)
    assert stats["truncated"].tolist() == [0.0, 0.0, 1.0, 0.0]
    theta, y, adv, logp_pi, logp_mu = _tokens([0.5, 1.0, 8.0, 2.0])
    aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=4.0, ppo_clip=0.2))[0].mean().backward()
    # PPO's surrogate: ratio r in [0.8, 1.2] -> r A grad; out of range, the clipped (constant) branch wins when it is
    # the smaller: A > 0 and r > 1.2 (token 2: 8.0, token 3: 2.0), or A < 0 and r < 0.8 (none); token 0 (r = 0.5,
    # A > 0) keeps r A grad.
    torch.testing.assert_close(theta.grad, _expected(theta, y, adv, [0.5, 1.0, 0.0, 0.0]), rtol=1e-12, atol=1e-12)


def test_the_sequence_weight_is_the_truncated_geometric_mean_of_a_responses_ratios():
    """Two responses of two tokens each, padded to three: w_i = min(exp(mean_t log(pi/mu)), rho) for each of its
    tokens; the padding position neither counts in the mean nor gets a gradient (its advantage is zero here)."""
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[0, 3, 1], [2, 3, 4]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([[1.5, 1.5, 0.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    logp_pi = torch.log_softmax(theta, -1)[y]
    token_w = torch.tensor([[2.0, 8.0, 1.0], [0.25, 1.0, 1.0]], dtype=torch.float64)
    logp_mu = logp_pi.detach() - torch.log(token_w)
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=3.0, correction="sequence"), mask=mask)
    (loss * mask).sum().backward()
    w = [min((2.0 * 8.0) ** 0.5, 3.0), (0.25 * 1.0) ** 0.5]  # 4 -> truncated at 3; 0.5
    expected = -sum(w[i] * adv[i, t] * _grad_logp(theta, y[i, t]) for i in range(2) for t in range(2))
    torch.testing.assert_close(theta.grad, expected, rtol=1e-12, atol=1e-12)
    assert stats["truncated"][mask].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_a_correction_needs_importance_weights_and_ppo_clip_only_where_it_clips():
    with pytest.raises(ValueError, match="correction='mask' needs algorithm.importance_weights=true"):
        AIPOSettings(correction="mask", importance_weights=False)
    with pytest.raises(ValueError, match="ppo_clip applies to algorithm.correction 'truncate'"):
        AIPOSettings(correction="sequence", ppo_clip=0.2)
    AIPOSettings(correction="decoupled", ppo_clip=0.1)  # its clip


@pytest.mark.parametrize("correction", ["truncate", "mask", "decoupled", "sequence", "ppo_clip", "uncorrected"])
def test_the_token_band_drops_exactly_the_tokens_outside_it_and_changes_nothing_inside(correction):
    """The collapse guard's band (token_band = 3 nats, on by default): tokens with |logp_pi - logp_mu| > 3 (ratios
    e^-4 and e^5 here) carry no policy gradient, under every correction; a batch inside the band gives the loss of no
    band at all, value and gradient (the reference: the same call with token_band=None)."""
    kw = {"ppo_clip": {"ppo_clip": 0.2}, "uncorrected": {"importance_weights": False}}.get(
        correction, {"correction": correction})
    gaps = [-4.0, 0.5, 2.9, 5.0, -2.9, 0.0]  # logp_pi - logp_mu
    inside = [abs(g) <= 3.0 for g in gaps]

    def grad(band, keep):
        theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
        y = torch.tensor([0, 3, 2, 3, 1, 4])[keep]
        adv = torch.tensor([1.5, -0.5, 2.0, 1.0, 0.7, -1.2], dtype=torch.float64)[keep]
        logp_pi = _policy(theta, y).unsqueeze(0)  # one row: [1, tokens]
        logp_mu = logp_pi.detach() - torch.tensor(gaps, dtype=torch.float64)[keep]
        adv = adv.unsqueeze(0)
        rho = 200.0 if correction == "mask" else 4.0  # the mask's own range, [1/rho, rho], wider than the band
        loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=rho, token_band=band, **kw))
        loss.sum().backward()
        return loss.detach()[0], theta.grad, {k: v[0] for k, v in stats.items()}

    keep_all, keep_in = torch.ones(6, dtype=torch.bool), torch.tensor(inside)
    loss, g, stats = grad(3.0, keep_all)
    assert stats["out_of_band"].tolist() == [0.0 if i else 1.0 for i in inside]
    assert loss[~keep_in].tolist() == [0.0, 0.0]
    if correction != "sequence":  # its weight averages the whole response's ratios, so the batch is not separable
        ref_loss, ref_g, _ = grad(None, keep_in)  # the in-band tokens alone, with no band
        torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(loss[keep_in], ref_loss, rtol=1e-12, atol=1e-12)
    in_loss, in_g, in_stats = grad(3.0, keep_in)  # a batch inside the band: exactly the unguarded loss
    ref_loss, ref_g, _ = grad(None, keep_in)
    assert torch.equal(in_loss, ref_loss) and torch.equal(in_g, ref_g) and in_stats["out_of_band"].sum() == 0
    _, unguarded, _ = grad(None, keep_all)
    assert not torch.allclose(g, unguarded)  # the check can fail: the out-of-band tokens did carry gradient
