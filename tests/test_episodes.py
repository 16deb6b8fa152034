"""Multi-turn generation (`inference/episodes.py`): an episode's tokens are exactly the ids the model sampled plus
the observations' ids, each turn decoded in the slot the episode keeps, with only the observation's tokens
prefilled; greedy episodes equal playing each turn again from the whole history (no cache kept), at TP1 and TP2,
with and without lookahead; sampled episodes do not depend on how many slots share the decode steps."""

import pytest

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.launch.spawn import run_local
from episode_workers import episodes_worker, reference_worker

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2], [9, 9, 30]]


def _greedy(max_new_tokens=4):
    return [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=max_new_tokens)) for p in PROMPTS]


def test_greedy_episodes_equal_replaying_the_history_every_turn(tiny_hf):
    _, cfg, full = tiny_hf
    want = run_local(reference_worker, 1, cfg, full, 1, _greedy(), 3, 40)[0]
    assert {w[3] for w in want} >= {"done", "turns"} and max(w[4] for w in want) == 3
    # A paged cache of 64 tokens (the longest episode's) for 5 slots: episodes wait for blocks, and those held between
    # turns keep theirs (preemption: test_generator.py). The last: each observation enters 3 steps after its turn
    # ended (`env.answer_steps`), up to 3 starts outstanding, with lookahead.
    cases = ((1, False, 2, None, 1), (1, True, 3, None, 1), (2, False, 8, None, 1), (1, False, 5, 64, 1),
             (1, True, 4, None, 3))
    for tp, lookahead, slots, paged, answer_steps in cases:
        got = run_local(episodes_worker, tp, cfg, full, tp, _greedy(), slots, 3, 40, lookahead, False, paged,
                        answer_steps)
        for episodes, _ in got:  # every rank of the replica
            for (tokens, lps, mask, finish, turns), (wt, wl, wm, wf, wturns) in zip(episodes, want):
                assert (tokens, mask, finish, turns) == (wt, wm, wf, wturns), (tp, lookahead, answer_steps)
                assert max(abs(a - b) for a, b in zip(lps, wl)) < 1e-4
                assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)


def test_only_the_observations_are_prefilled(tiny_hf):
    _, cfg, full = tiny_hf
    (episodes, filled), = run_local(episodes_worker, 1, cfg, full, 1, _greedy(), 8, 3, 40, False, True)
    # Where each episode's observations stand: [start, end) in the episode's tokens.
    spans = {i: [] for i in range(len(PROMPTS))}
    for i, (_, _, mask, _, _) in enumerate(episodes):
        for j in range(1, len(mask)):
            if mask[j - 1] and not mask[j]:
                spans[i].append((j, next((k for k in range(j, len(mask)) if mask[k]), len(mask))))
    assert sum(map(len, spans.values())) >= 5
    # First admission: the prompt but its last token. Each resumption: the last reply token and the observation
    # but its last token, at their positions in the episode (the history before them is not prefilled again).
    first = {req: (lo, hi) for call in filled for req, lo, hi in call if lo == 0}
    assert first == {i: (0, len(p) - 1) for i, p in enumerate(PROMPTS)}
    later = sorted((req, lo, hi) for call in filled for req, lo, hi in call if lo > 0)
    want = sorted((i, len(PROMPTS[i]) + a - 1, len(PROMPTS[i]) + b - 1) for i, s in spans.items() for a, b in s)
    assert later == want


def test_sampled_episodes_do_not_depend_on_the_batch(tiny_hf):
    _, cfg, full = tiny_hf
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=5, seed=40 + i, n=2))
            for i, p in enumerate(PROMPTS)]
    one = run_local(episodes_worker, 1, cfg, full, 1, reqs, 1, 3, 30)[0][0]
    many = run_local(episodes_worker, 1, cfg, full, 1, reqs, 6, 3, 30)[0][0]
    assert [e[0] for e in one] == [e[0] for e in many] and [e[2] for e in one] == [e[2] for e in many]
    assert one[0][0] != one[1][0]  # the two samples of a request are two episodes
    assert all(len(t) <= 30 for t, *_ in many)
