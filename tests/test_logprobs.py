"""Vocabulary-parallel log-probs equal log_softmax of the gathered logits, values and gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.parallel.spawn import run_local
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
    return full, target, w, lp.detach(), shard.grad


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
