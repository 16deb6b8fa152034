"""The live engine (`inference/live.py`, `rollout.in_flight`): weights switched under running sequences, every token
tagged with the version that sampled it and scored by that version's weights exactly, a snapshot restored into a
fresh generator going on bit for bit, an abort freeing its slot and blocks; on a slot and a paged cache, and under
CUDA's rules."""

import pytest

from megatron_rl.launch.spawn import run_local
from gen_workers import live_worker
from episode_workers import live_episodes_worker

pytest.importorskip("transformers")


@pytest.mark.parametrize("kv_cache_tokens, rules", [(None, False), (160, False), (None, True)],
                         ids=["slots", "paged", "slots-cuda-rules"])
def test_switched_weights_score_every_token_by_its_own_version(tiny_hf, kv_cache_tokens, rules):
    """With the caches recomputed at the switch (`rollout.recompute_cache`)."""
    _, cfg, full = tiny_hf
    got = run_local(live_worker, 1, cfg, full, 1, kv_cache_tokens, rules)[0]
    assert got["lookahead"] == rules  # under CUDA's rules a step is launched before the last one is read
    outs, scored = got["outs"], got["scored"]
    mixed = 0
    for i, (tokens, logprobs, versions, _) in enumerate(outs):
        assert len(versions) == len(tokens) and versions == sorted(versions), i  # versions only move forward
        for j, v in enumerate(versions):
            assert abs(logprobs[j] - scored[v][i][j]) < 1e-5, (i, j, v, logprobs[j], scored[v][i][j])
        mixed += len(set(versions)) == 2
    assert all(set(v) == {0} for _, _, v, _ in outs[:5])  # batch A ran before the switch
    assert mixed >= 1  # some of batch B started under version 0 and finished under version 1
    # The other version's weights give the tokens after the switch other log-probs: the check above can fail.
    assert max(abs(lp - scored[0][i][j]) for i, (_, lps, vs, _) in enumerate(outs)
               for j, (lp, v) in enumerate(zip(lps, vs)) if v == 1) > 1e-2
    assert got["restored"] == outs  # snapshot after A, restore into a fresh generator: the same B, bit for bit
    assert got["occupancy"] > 0.8  # B's sequences filled the slots A's short ones freed
    finish, blocks, (slots_before, blocks_before), (slots_after, blocks_after) = got["abort"]
    assert finish == "abort" and slots_after == slots_before + 1 and blocks_after == blocks_before + blocks
    assert got["rest"] == ["length"] * 3
    assert got["ahead"] == list(range(2 + 5))  # two queued ahead, then the five queued before them, in order


def test_a_kept_cache_makes_the_tokens_after_a_switch_the_new_weights_over_the_old_cache(tiny_hf):
    """The default switch keeps the caches: a token after it has the log-prob of version 1's weights attending to the
    keys and values version 0 wrote for the positions before it (as the docs say), not version 1's teacher-forced one;
    a token before it, version 0's. The restore (whose first switch recomputes) still goes on bit for bit."""
    _, cfg, full = tiny_hf
    got = run_local(live_worker, 1, cfg, full, 1, None, False, False)[0]
    outs, scored, kept = got["outs"], got["scored"], got["kept"]
    gap_to_v1 = 0.0
    for i, (tokens, logprobs, versions, _) in enumerate(outs):
        for j, v in enumerate(versions):
            assert abs(logprobs[j] - kept[i][j]) < 1e-5, (i, j, v, logprobs[j], kept[i][j])
            if v == 0:
                assert abs(logprobs[j] - scored[0][i][j]) < 1e-5, (i, j)
            elif len(set(versions)) == 2:  # a token after the switch, in a sequence that spans it
                gap_to_v1 = max(gap_to_v1, abs(logprobs[j] - scored[1][i][j]))
    assert gap_to_v1 > 1e-3  # the old cache shows: version 1's teacher-forced log-probs differ


# Each turn's length is fixed (no stop token) and so is each observation's: which step a turn ends at does not depend
# on what the model samples. These lengths make a turn of B end at the step at which A's last episode ends (read one
# step later with lookahead).
# With answer_steps=3 (`env.answer_steps`) the snapshot holds several starts, each with the steps it has left.
@pytest.mark.parametrize("lookahead, a_new, b_new, answer_steps",
                         [(False, (3,), (1, 2, 1, 2, 1), 1), (True, (5,), (2, 1, 1, 2, 1), 1),
                          (False, (3,), (1, 2, 1, 2, 1), 3)],
                         ids=["read-each-step", "lookahead", "answers-3-steps-later"])
def test_episodes_in_the_live_engine_span_a_switch_and_resume_with_their_answers_outstanding(tiny_hf, lookahead,
                                                                                             a_new, b_new,
                                                                                             answer_steps):
    """Episodes (`Turns.empty`/`join`): batch A's equal batch mode's; batch B's, played beside A and across a switch,
    tag each token with the version that sampled it (an observation with its reply's) and score by it exactly; a
    snapshot taken with B's answers outstanding, restored into a fresh generator, goes on bit for bit. With
    lookahead, the turns a switch or the end of a `run` reads are answered at the next step."""
    _, cfg, full = tiny_hf
    got = run_local(live_episodes_worker, 1, cfg, full, 1, lookahead, a_new, b_new, answer_steps)[0]
    outs, scored = got["outs"], got["scored"]
    assert got["lookahead"] == lookahead
    assert got["outstanding"] > 0  # the snapshot cut B's environments off mid-answer
    assert got["restored"] == outs
    for (tokens, lps, mask, versions, finish, turns), (r_tokens, r_lps, r_mask, _, r_finish, r_turns) in zip(
            outs[:len(a_new)], got["reference"], strict=True):
        assert (tokens, mask, finish, turns) == (r_tokens, r_mask, r_finish, r_turns)
        assert max(abs(x - y) for x, y in zip(lps, r_lps)) < 1e-5
        assert set(versions) == {0}
    spanning = 0
    for i, (tokens, lps, mask, versions, finish, turns) in enumerate(outs):
        assert len(versions) == len(tokens) and versions == sorted(versions) and turns >= 2, i
        for j, v in enumerate(versions):
            if mask[j]:
                assert abs(lps[j] - scored[v][i][j]) < 1e-5, (i, j, v)
            else:  # an observation: the version of the reply before it
                assert j > 0 and v == versions[j - 1], (i, j)
        spanning += len(set(versions)) == 2
    assert spanning >= 1  # an episode of B sampled under both versions
