"""Packed micro-batches (`training.packing`): the plan (every sequence once, rows within the budget, token-balanced
DP shares with equal micro-batch counts), and the model on a packed row against each sequence run alone. The RL
step packed against padded at TP2 x PP2 x DP2 is in test_rl_trainer.py."""

import pytest
import torch

from megatron_rl.launch.spawn import run_local
from megatron_rl.training.packing import dp_shares, plan_rows, row_length


@pytest.mark.parametrize("dp,budget", [(1, 64), (2, 40), (3, 100), (4, 37)])
def test_the_plan_packs_every_sequence_once_within_the_budget_and_agrees_on_the_count(dp, budget):
    lengths = torch.randint(1, 38, (23,), generator=torch.Generator().manual_seed(dp)).tolist()
    plan = plan_rows(lengths, dp, budget)
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(len(lengths)))
    assert len({len(rows) for rows in plan}) == 1  # every rank runs as many micro-batches
    assert all(sum(lengths[i] for i in row) <= budget for rows in plan for row in rows)
    t = row_length(plan, lengths)
    assert t % 8 == 0 and t - 8 < max(sum(lengths[i] for i in row) for rows in plan for row in rows) <= t


def test_dp_shares_balance_tokens_not_sequences():
    lengths = [36, 12, 12, 9, 13, 11, 14, 14]
    shares = dp_shares(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert shares == [[0, 1, 5], [2, 3, 4, 6, 7]] and loads == [59, 62]
    # A sequence over the budget is one line, naming the setting.
    with pytest.raises(ValueError, match="a sequence of 36 tokens does not fit trainer.max_tokens_per_micro_batch=30"):
        plan_rows(lengths, 2, 30)


def _packed_worker(rank, world_size, fusions):
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward
    from megatron_rl.training.packing import packed_micro_batches
    from rl_workers import make_rollouts

    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("x", ParallelLayout())])["x"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", fusions=fusions)
    batch = make_rollouts(cfg.vocab_size, n=4, long_first=True)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()

    def packed_logits(b):
        (mb,) = packed_micro_batches(b, 1, 0, budget=200)
        with torch.no_grad():
            return model_forward(model, mb["tokens"], False, packed={**mb, "cp_group": g.pgs.cp})[0], mb

    out = {"lengths": lengths}
    out["packed"], mb = packed_logits(batch)
    out["bounds"] = mb["host_bounds"]
    with torch.no_grad():
        out["alone"] = [model_forward(model, batch.tokens[i:i + 1, :n], False)[0] for i, n in enumerate(lengths)]
    changed = batch.select(torch.arange(batch.size))
    changed.tokens = changed.tokens.clone()
    changed.tokens[1] = (changed.tokens[1] + 1) % cfg.vocab_size
    out["changed"], _ = packed_logits(changed)
    return out


@pytest.mark.parametrize("fusions", ["none", "rope"])
def test_each_packed_sequence_sees_only_itself(fusions):
    """Every sequence's logits in the packed row equal its logits run alone (positions and RoPE restart, attention
    stays within it; "rope": our fused RoPE's packed path), and changing one sequence changes no other's."""
    out = run_local(_packed_worker, 1, fusions)[0]
    bounds, packed, changed = out["bounds"], out["packed"], out["changed"]
    assert bounds[:5] == [0, *torch.tensor(out["lengths"]).cumsum(0).tolist()] and bounds[-1] == packed.shape[0]
    for i, alone in enumerate(out["alone"]):
        a, b = bounds[i], bounds[i + 1]
        torch.testing.assert_close(packed[a:b], alone, atol=1e-5, rtol=0, msg=lambda s: f"sequence {i}: {s}")
        if i != 1:
            assert torch.equal(changed[a:b], packed[a:b]), f"sequence {i} changed with sequence 1"
    assert not torch.allclose(changed[bounds[1]:bounds[2]], packed[bounds[1]:bounds[2]])
