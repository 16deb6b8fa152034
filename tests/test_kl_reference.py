"""The KL penalty against a frozen reference: its gradient in closed form, the reference frozen through training,
and kept by a checkpoint.

aipo.py's estimator is k3 (Schulman's "approximating KL divergence"): per response token, with d = logp_ref - logp_pi
and r = exp(d) = ref(y) / pi(y),

    k3 = r - 1 - log r = exp(d) - d - 1  >= 0, = 0 exactly when logp_pi == logp_ref,

added to the loss as kl_coef * k3. Its derivative w.r.t. the policy's log-prob of the token is

    d k3 / d logp_pi = -exp(d) + 1 = 1 - ref(y) / pi(y),

so a token's total gradient is -min(w, rho) * A + kl_coef * (1 - r) (the KL term is not importance-weighted), and
the mean over tokens divides by their number. Averaged over tokens y ~ pi, sum_y pi(y) (1 - ref(y)/pi(y)) grad logp(y)
= -sum_y ref(y) grad log pi(y) = grad KL(ref || pi): as a loss, k3 pulls pi towards the reference.
"""

import pytest
import torch

from megatron_rl.algorithms import AIPOSettings, aipo_token_loss
from megatron_rl.launch.spawn import run_local
from kl_workers import load_reference, train_and_save
from rl_workers import random_full_state


def test_k3_gradient_wrt_policy_logprobs_is_one_minus_the_ratio():
    logp_pi = torch.tensor([-1.2, -0.3, -2.5, -0.7, -4.0], dtype=torch.float64, requires_grad=True)
    logp_ref = torch.tensor([-1.0, -0.3, -3.5, -0.2, -1.5], dtype=torch.float64)
    w = torch.tensor([0.5, 1.0, 8.0, 2.0, 1.0], dtype=torch.float64)  # 8 > rho = 4: truncated
    logp_mu = logp_pi.detach() - torch.log(w)
    adv = torch.tensor([1.5, -0.5, 2.0, 0.0, -1.0], dtype=torch.float64)
    kl_coef = 0.3
    loss, stats = aipo_token_loss(logp_pi, logp_mu, adv, AIPOSettings(rho=4.0, kl_coef=kl_coef), logp_ref)
    loss.mean().backward()
    r = torch.exp(logp_ref - logp_pi.detach())
    expected = (-torch.clamp(w, max=4.0) * adv + kl_coef * (1 - r)) / 5
    torch.testing.assert_close(logp_pi.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats["kl_ref"], r - 1 - torch.log(r), rtol=1e-12, atol=1e-12)
    assert stats["kl_ref"][1] == 0 and (stats["kl_ref"] > 0).sum() == 4  # zero exactly where pi = ref


def test_k3_pulls_the_policy_towards_the_reference_in_expectation():
    """Over every token y weighted by pi(y): the KL term's gradient is kl_coef * grad KL(ref || pi)."""
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0], dtype=torch.float64), -1)
    logp_pi = torch.log_softmax(theta, -1)
    y = torch.arange(5)
    kl_coef = 0.7
    zero = torch.zeros(5, dtype=torch.float64)
    loss, _ = aipo_token_loss(logp_pi[y], logp_pi[y].detach(), zero, AIPOSettings(kl_coef=kl_coef), ref.log()[y])
    (torch.softmax(theta, -1).detach() * loss).sum().backward()
    theta_kl = theta.detach().clone().requires_grad_(True)
    (kl_coef * (ref * (ref.log() - torch.log_softmax(theta_kl, -1))).sum()).backward()
    torch.testing.assert_close(theta.grad, theta_kl.grad, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kl") / "full.pt"
    torch.save(random_full_state(), path)
    return str(path)


@pytest.mark.parametrize("tp", [1, 2])
def test_reference_is_a_frozen_copy_kept_by_checkpoints(state_path, tmp_path, tp):
    out = run_local(train_and_save, tp, dict(tp=tp), state_path, str(tmp_path))
    for r in out:
        assert "needs a reference model" in r["no_reference_error"]
        assert r["rng_untouched"] and r["frozen"] and r["no_grad"]
        for k, v in r["policy_start"].items():
            assert torch.equal(r["reference_start"][k], v), k  # a copy of the policy as RL starts
            assert torch.equal(r["reference_end"][k], v), k  # untouched by two optimizer steps
        assert max((r["policy_end"][k] - v).abs().max().item() for k, v in r["policy_start"].items()) > 1e-3
        first, second = r["metrics"]
        # The first step's policy is the reference itself: the same forward, so k3 is exactly 0; then it moved.
        assert first["kl_ref"] == 0.0 and second["kl_ref"] > 0
        assert r["saved_with_reference"] == [True, False]  # runs without a reference: the format as before
    ref = out[0]
    layouts = [dict(tp=tp)] + ([dict(tp=1)] if tp > 1 else [])  # also restored at another layout
    for layout in layouts:
        loaded = run_local(load_reference, layout["tp"], layout, ref["path"], ref["path_without"])
        for r in loaded:
            assert any(not torch.equal(r["before"][k], v) for k, v in ref["reference_end"].items())
            for k, v in ref["reference_end"].items():
                assert torch.equal(r["reference"][k], v), k
                assert torch.equal(r["policy"][k], ref["policy_end"][k]), k
            assert "saved without a KL reference model" in r["refused"]


def test_job_with_kl_trains_against_its_reference_and_resumes_with_it(tmp_path):
    """A job with algorithm.kl_coef > 0 end to end: the reference is the policy as RL starts (KL 0 on the first
    step, which trains on weights equal to it), the KL grows as the policy moves, and a resumed run's reference
    came back from the checkpoint: a reference rebuilt from the resumed policy would give KL 0 on its first step.
    (That the restored reference equals the saved one, bit for bit, is `test_reference_is_a_frozen_copy_kept_by_
    checkpoints`.)"""
    import json

    import warm_cli

    def job(name, steps):
        cmd = ["train", f"run.steps={steps}", "trainer.sft_warmup_steps=20",
               "algorithm.kl_coef=0.1", "rollout.mode=sync", "rollout.prompts_per_step=4", "data.eval_size=8",
               "run.eval_interval=100", "checkpoint.save_interval=2", "trainer.dtype=fp32", "generator.dtype=fp32",
               f"checkpoint.dir={tmp_path}", f"run.name={name}"]
        out = warm_cli.run(cmd, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    first = job("run", 2)
    assert first[0]["kl_ref"] == 0.0 and first[1]["kl_ref"] > 0
    rows = job("run", 4)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[:2] == first
    assert all(r["kl_ref"] > 0 for r in rows[2:]), rows
