"""The trainer executor's AIPO step under TP/PP/DP equals a single-process step; non-finite steps are skipped."""

import math

import pytest
import torch

from megatron_rl.launch.spawn import run_local
from rl_workers import random_full_state, rl_step_worker


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "full.pt"
    torch.save(random_full_state(), path)
    return str(path)


# The reference is one process with padded micro-batches; the parallel step runs padded, or packed into rows of
# 40 tokens (`training.packing`) from a batch with one long sequence: the DP ranks then hold 3 and 5 sequences.
CASES = [
    ("aipo-token-padded", dict(tp=2, pp=2, dp=2), dict(rho=2.0), None),
    ("sequence-kl-entropy-packed", dict(tp=2, pp=2, dp=2), dict(rho=2.0, normalization="sequence", kl_coef=0.1,
                                                                 entropy_coef=0.01), 40),
    # one weight per response from the mean of its tokens' log-ratios: a per-sequence reduction on the last stage
    ("sequence-weight-packed", dict(tp=2, pp=2, dp=2), dict(rho=1.5, correction="sequence"), 40),
]


def test_the_packed_cases_hold_different_numbers_of_sequences_per_rank_and_several_micro_batches():
    from megatron_rl.models import get_preset
    from megatron_rl.training.packing import plan_rows
    from rl_workers import make_rollouts

    batch = make_rollouts(get_preset("tiny").vocab_size, long_first=True)
    plan = plan_rows((batch.prompt_lengths + batch.response_lengths).tolist(), 2, 40)
    assert len(plan[0]) == len(plan[1]) == 2
    assert [sum(map(len, rows)) for rows in plan] == [3, 5]


@pytest.mark.parametrize("name,layout,aipo,packed", CASES, ids=[c[0] for c in CASES])
def test_parallel_rl_step_matches_single_process(state_path, name, layout, aipo, packed):
    long_first = packed is not None
    ref = run_local(rl_step_worker, 1, dict(tp=1), state_path, aipo, 4, False, None, long_first)[0]
    out = run_local(rl_step_worker, 8, layout, state_path, aipo, 2, False, packed, long_first)
    # One DP rank: the DDP collectives over it are skipped (engine.skip_syncs_of_one_rank); two: they run.
    assert ref["one_rank_syncs_skipped"] and not any(r["one_rank_syncs_skipped"] for r in out)
    full0 = torch.load(state_path)
    assert max((ref["params"][k] - full0[k]).abs().max().item() for k in full0) > 1e-4
    m = ref["metrics"]
    assert 0 < m["is_truncated_frac"] < 1 and m["is_weight_max"] > 2.0  # the batch exercises truncation
    # |logp_pi - logp_mu|: the largest is the log of the largest weight (the largest gap is an overshoot here).
    assert m["logp_diff_max"] >= math.log(m["is_weight_max"]) - 1e-6 and 0 < m["logp_diff_mean"] < m["logp_diff_max"]
    for r in out:
        for key in ("loss", "grad_norm", "is_weight_mean", "is_weight_max", "is_truncated_frac", "kl_mu_pi",
                    "entropy", "kl_ref", "logp_diff_mean", "logp_diff_max"):
            assert r["metrics"][key] == pytest.approx(m[key], rel=1e-5, abs=1e-7), key
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")


def test_nan_in_batch_skips_the_step(state_path):
    out = run_local(rl_step_worker, 4, dict(tp=2, pp=2), state_path, dict(rho=2.0), 2, True)
    for r in out:
        assert r["nan_metrics"]["skipped"] and r["nan_metrics"]["nonfinite_total"] == 1
        assert r["unchanged"]
        assert not r["metrics"]["skipped"]  # the next, finite step trains normally


def test_micro_batches_are_as_few_as_allowed_and_evenly_filled():
    from megatron_rl.training.rl_trainer import micro_batch_rows

    assert [micro_batch_rows(n, 64) for n in (4, 64, 65, 128, 129)] == [4, 64, 33, 64, 43]
    for n in range(1, 300):
        for limit in (1, 3, 8, 64):
            rows = micro_batch_rows(n, limit)
            count = -(-n // rows)
            assert rows <= limit and count == -(-n // limit)  # never more micro-batches than needed
            assert count * rows - n < count  # at most one padding row per micro-batch


def test_logits_at_the_loss_positions_give_the_whole_logits_answer(state_path):
    """The trainer computes logits only where the loss reads them (prompt positions cost the output layer and a
    vocabulary pass for nothing): log-probs, entropies and every gradient equal those from the whole logits."""
    from rl_workers import logits_at_positions_worker

    out = run_local(logits_at_positions_worker, 1, state_path)[0]
    whole, sel = out["some", "whole"], out["some", "selected"]
    n = int((sel["lp"] != 0).sum())
    assert whole["shape"][:2] == (8, 24) and sel["shape"][:2] == (1, n) and 20 < n < 8 * 24 // 2
    torch.testing.assert_close(sel["lp"], whole["lp"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sel["ent"], whole["ent"], atol=1e-6, rtol=1e-6)
    assert whole["grads"]["output_layer.weight"].abs().max() > 1e-3
    for k, v in whole["grads"].items():
        torch.testing.assert_close(sel["grads"][k], v, atol=1e-6, rtol=1e-5, msg=lambda s: f"{k}: {s}")
    # A micro-batch with no response position (all padding) gives zeros and no gradient, not an error.
    empty = out["none", "selected"]
    assert empty["shape"][:2] == (1, 0) and not empty["lp"].any() and not empty["ent"].any()
    assert all(not v.any() for v in empty["grads"].values())


def test_skipping_the_collectives_of_one_data_parallel_rank_changes_no_bit(state_path):
    """With one DP rank, Megatron-Core's gradient reduce-scatter and parameter all-gather return their input; gloo
    runs them as whole-buffer copies. The engine skips them there: two steps give the same bits as with them."""
    from rl_workers import one_rank_syncs_worker

    out = run_local(one_rank_syncs_worker, 1, state_path)[0]
    assert out["skipped", "was_skipped"] and out["run", "was_skipped"]
    full0 = torch.load(state_path)
    assert max((out["run"][k] - full0[k]).abs().max().item() for k in full0) > 1e-4  # the steps moved the weights
    for k, v in out["run"].items():
        assert torch.equal(out["skipped"][k], v), k
