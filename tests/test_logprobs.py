"""Vocabulary-parallel log-probs equal log_softmax of the gathered logits, values and gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.launch.spawn import run_local
from megatron_rl.training.logprobs import vocab_parallel_logprobs


def _reference(full_logits, target, vocab, temperature):
    lp = torch.log_softmax(full_logits[..., :vocab].double() / temperature, dim=-1)
    return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def test_single_rank_matches_log_softmax_and_leaves_logits_alone(monkeypatch):
    from megatron_rl.training import logprobs as lp_mod

    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * 40 * 4)  # 4 tokens per chunk: exercise the chunking
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40, requires_grad=True)
    target = torch.randint(0, 33, (3, 5))
    before = logits.detach().clone()
    lp = vocab_parallel_logprobs(logits, target, None, vocab_size=33, temperature=0.7)
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(lp.double(), _reference(logits.detach(), target, 33, 0.7), atol=1e-6, rtol=0)
    w = torch.randn(3, 5)
    (lp * w).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    (_reference(ref_logits, target, 33, 0.7) * w.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad.double(), atol=1e-6, rtol=0)
    assert torch.all(logits.grad[..., 33:] == 0)  # padding columns get no gradient


def _tp_worker(rank, world_size, vocab):
    torch.manual_seed(0)
    full = torch.randn(2, 6, 64)
    target = torch.randint(0, vocab, (2, 6))
    w = torch.randn(2, 6)
    group = dist.new_group([0, 1])
    shard = full.chunk(world_size, -1)[rank].clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(shard, target, group, vocab_size=vocab, temperature=1.3)
    (lp * w).sum().backward()
    mask = target % 2 == 0  # the same on both ranks
    masked = shard.detach().clone().requires_grad_(True)
    from megatron_rl.training.logprobs import vocab_parallel_logprobs_and_entropy

    lp_m = vocab_parallel_logprobs_and_entropy(masked, target, group, vocab, 1.3, mask)[0]
    (lp_m * w).sum().backward()
    return full, target, w, lp.detach(), shard.grad, mask, lp_m.detach(), masked.grad


# 50 real columns of 64: padding at the end of shard 1; 16 of 64: shard 1 is all padding (a small vocabulary at TP 2).
@pytest.mark.parametrize("vocab", [50, 16])
def test_tensor_parallel_matches_gathered_log_softmax(vocab):
    results = run_local(_tp_worker, 2, vocab)
    full, target, w = results[0][:3]
    ref_logits = full.clone().requires_grad_(True)
    ref = _reference(ref_logits, target, vocab, 1.3)
    (ref * w.double()).sum().backward()
    grads = torch.cat([r[4] for r in results], -1)
    for r in results:
        torch.testing.assert_close(r[3].double(), ref.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grads.double(), ref_logits.grad.double(), atol=1e-6, rtol=0)
    # With a mask: the selected positions' values, and the gradient of their sum only.
    mask = results[0][5]
    masked_ref = full.clone().requires_grad_(True)
    (_reference(masked_ref, target, vocab, 1.3) * w.double() * mask).sum().backward()
    for r in results:
        torch.testing.assert_close(r[6][mask].double(), ref.detach()[mask], atol=1e-6, rtol=0)
        assert torch.all(r[6][~mask] == 0)
    torch.testing.assert_close(torch.cat([r[7] for r in results], -1).double(), masked_ref.grad.double(),
                               atol=1e-6, rtol=0)


def test_chunked_entropy_matches_reference_values_and_gradients(monkeypatch):
    from megatron_rl.training import logprobs as lp_mod
    from megatron_rl.training.logprobs import vocab_parallel_entropy

    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * 40 * 3)  # 3 tokens per chunk: exercise the chunking
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 40, dtype=torch.float64, requires_grad=True)
    ent = vocab_parallel_entropy(logits, None, vocab_size=35, temperature=1.7)
    ref_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref_logits[..., :35] / 1.7, -1)
    ref = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(ent.double(), ref.detach(), atol=1e-6, rtol=0)
    w = torch.randn(2, 7, dtype=torch.float64)
    (ent * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)



def test_a_mask_computes_only_its_positions_with_the_same_values_and_gradients(monkeypatch):
    from megatron_rl.training import logprobs as lp_mod
    from megatron_rl.training.logprobs import vocab_parallel_logprobs_and_entropy

    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * 20 * 3)  # 3 selected tokens per chunk
    torch.manual_seed(2)
    full = torch.randn(3, 8, 40, dtype=torch.float64)
    target = torch.randint(0, 37, (3, 8))
    mask = torch.rand(3, 8) < 0.5
    w_lp, w_ent = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    out = {}
    for masked in (False, True):
        logits = full.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs_and_entropy(logits, target, None, 37, 1.3, mask if masked else None)
        ((lp * w_lp + ent * w_ent) * mask).sum().backward()
        out[masked] = (lp.detach(), ent.detach(), logits.grad)
    (lp_all, ent_all, g_all), (lp_m, ent_m, g_m) = out[False], out[True]
    torch.testing.assert_close(lp_m[mask], lp_all[mask], atol=1e-9, rtol=0)
    torch.testing.assert_close(ent_m[mask], ent_all[mask], atol=1e-9, rtol=0)
    assert torch.all(lp_m[~mask] == 0) and torch.all(ent_m[~mask] == 0)
    torch.testing.assert_close(g_m, g_all, atol=1e-9, rtol=0)
    assert torch.all(g_m[~mask] == 0)


def test_logits_spread_past_exps_range_give_exact_logprobs_entropies_and_gradients():
    """A trained model's logits at temperature < 1 spread over more than 87, where exp(x - max) is subnormal or 0
    (slow on CPUs; `_FLOOR` keeps the sums away from it): the log-probs, the entropies and their gradients still
    equal the float64 closed forms, targets far below the max included."""
    from megatron_rl.training.logprobs import vocab_parallel_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[:, :200] -= torch.linspace(40, 200, 200)  # two thirds of the vocabulary 70 to 330 below the rest at T=0.6
    logits.requires_grad_(True)
    target = torch.tensor([0, 10, 150, 250, 299, 199])  # three far below the max
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, target, None, 300, 0.6)
    w_lp, w_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    (lp * w_lp + ent * w_ent).sum().backward()
    ref = logits.detach().double().requires_grad_(True)
    ref_lp_all = torch.log_softmax(ref / 0.6, -1)
    ref_lp = ref_lp_all.gather(1, target[:, None]).squeeze(1)
    ref_ent = -(ref_lp_all.exp() * ref_lp_all).sum(-1)
    (ref_lp * w_lp.double() + ref_ent * w_ent.double()).sum().backward()
    assert ref_lp.min() < -100  # the far targets' log-probs are themselves far below exp's range
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
