"""Dynamic sampling (`controller/dynamic_sampling.py`) on a replica's groups, against what it must do: the batch
stays full, a group whose raw rewards differ is never dropped, a dropped group's place goes to the next refill group
with signal and takes its id, the rounds are bounded, and what it drew is reported; and overlong shaping
(`collector.overlong_penalty`) against DAPO's closed form, in the advantages only."""

import random

import pytest
import torch

from megatron_rl.algorithms import AIPOSettings
from megatron_rl.config import load_config, problems
from megatron_rl.controller.collector import batch_with_advantages, overlong_penalty
from megatron_rl.controller.dynamic_sampling import SampledGroup, fill, has_signal, occupancy_over, refill_index
from megatron_rl.controller.scoring import ScoredRollouts


def _group(group: int, rewards: list[float], drawn_from: int = 0) -> SampledGroup:
    return SampledGroup(record=f"r{drawn_from}.{group}", group=group, outputs=[f"o{group}"] * len(rewards),
                        rewards=rewards, drawn_from=drawn_from)


def _run(first, refills: dict[int, list[list[float]]], rounds: int):
    """`fill` on a one-rank replica whose refill round r draws groups with rewards `refills[r]` (the first `count`
    of them), recording each draw."""
    draws = []

    def draw(round_, count):
        draws.append((round_, count))
        return [_group(i, rw, drawn_from=refill_index(7, round_)) for i, rw in enumerate(refills[round_][:count])]

    groups, report = fill(first, draw, lambda x: x, rounds)
    return groups, report, draws


def test_groups_with_signal_stay_and_each_open_place_takes_the_next_refill_group_with_signal():
    first = [_group(0, [1, 0]), _group(1, [0, 0]), _group(2, [1, 1]), _group(3, [0, 1])]
    refills = {1: [[0, 0], [1, 0]], 2: [[0, 1], [1, 1]]}
    groups, report, draws = _run(first, refills, rounds=4)
    assert draws == [(1, 2), (2, 1)]  # as many prompts as places are open; no round once none is
    assert [g.record for g in groups] == ["r0.0", f"r{refill_index(7, 1)}.1", f"r{refill_index(7, 2)}.0", "r0.3"]
    assert [g.group for g in groups] == [0, 1, 2, 3]  # a refill takes the id of the place it fills
    assert all(has_signal(g.rewards) for g in groups)
    assert report == {"prompts_drawn": 7, "groups": 4, "with_signal": 4}


def test_the_bound_keeps_the_batch_full_with_the_groups_it_could_not_replace():
    first = [_group(0, [0, 0]), _group(1, [1, 0]), _group(2, [1, 1])]
    refills = {r: [[0, 0], [1, 1]] for r in (1, 2)}
    groups, report, draws = _run(first, refills, rounds=2)
    assert draws == [(1, 2), (2, 2)]
    assert [g.record for g in groups] == ["r0.0", "r0.1", "r0.2"]  # no signal anywhere: the places keep their own
    assert report == {"prompts_drawn": 7, "groups": 3, "with_signal": 1}


def test_a_group_with_unequal_raw_rewards_is_never_dropped_and_the_batch_never_shrinks():
    rnd = random.Random(0)
    for trial in range(200):
        first = [_group(i, [float(rnd.random() < 0.3) for _ in range(rnd.randint(1, 4))]) for i in range(6)]
        refills = {r: [[float(rnd.random() < 0.5) for _ in range(2)] for _ in range(6)] for r in range(1, 4)}
        groups, report, _ = _run(first, refills, rounds=3)
        assert len(groups) == len(first) and [g.group for g in groups] == list(range(6))
        for before, after in zip(first, groups):
            if has_signal(before.rewards):
                assert after is before, trial
        assert report["with_signal"] == sum(has_signal(g.rewards) for g in groups)


def test_the_draws_of_other_ranks_follow_the_leaders_counts():
    """A replica's other ranks hold no rewards: they sample exactly the rounds and counts the leader shares."""
    shared = iter([2, 1, 0])
    draws = []
    groups, _ = fill(None, lambda r, c: draws.append((r, c)), lambda x: next(shared), rounds=4)
    assert groups is None and draws == [(1, 2), (2, 1)]


def test_overlong_shaping_is_dapos_soft_penalty_and_reaches_only_the_advantages():
    lengths = torch.tensor([10, 12, 14, 16])
    # limit 16, buffer 4: no penalty up to 12 tokens, then linear to -penalty at 16
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]
    part = ScoredRollouts(0, 0, [[1]] * 4, [[2] * n for n in lengths.tolist()], [[0.0] * n for n in lengths.tolist()],
                          [1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], [], 0.0, 0.0, 0.0)
    plain = batch_with_advantages([part], 0, "group_mean")
    shaped = batch_with_advantages([part], 0, "group_mean", overlong=(16, 4, 0.5))
    assert plain.advantages.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert shaped.advantages.tolist() == pytest.approx([0.0, 0.0, 0.125, -0.125])
    assert torch.equal(shaped.rewards, plain.rewards)  # the reported (and filtered) rewards stay the task's


def test_settings_that_cannot_work_are_one_line_each(tmp_path):
    def lines(*overrides):
        return problems(load_config(overrides=[*overrides, f"checkpoint.dir={tmp_path}"]), cluster_files=False)[1]

    assert lines("algorithm.dynamic_sampling=true") == []
    assert lines("algorithm.dynamic_sampling=true", "rollout.in_flight=true") == []  # refills in the live engine
    why = ["algorithm.dynamic_sampling=true filters on the rewards a replica computes as it samples: not with a "
           "reward-model executor or env.agent"]
    on = AIPOSettings(dynamic_sampling=True)
    assert on.job_problems("algorithm", True, False, 64) == on.job_problems("algorithm", False, True, 64) == why
    assert on.job_problems("algorithm", False, False, 64) == []
    assert lines("algorithm.overlong_buffer=64", "rollout.max_new_tokens=64") == [
        "algorithm.overlong_buffer=64 must be less than the longest response (64 tokens)"]
    assert lines("algorithm.dynamic_sampling_rounds=65") == [
        "algorithm.dynamic_sampling_rounds=65 must be in [1, 64] (refill rounds a batch)"]


def test_a_batchs_occupancy_is_over_all_its_rounds_slot_steps():
    """A refilled batch reports its generator's occupancy over the rounds together (each weighted by its
    slot-steps), not the last round's; a round that ran no step, or a pipelined generator's, counts nothing."""
    rounds = [{"occupancy": 0.9, "slot_steps": 300}, {"occupancy": 0.2, "slot_steps": 100}, {"occupancy": None},
              {"tokens_per_s": 1.0}]
    assert occupancy_over(rounds) == pytest.approx((0.9 * 300 + 0.2 * 100) / 400)
    assert occupancy_over(rounds[2:]) is None
