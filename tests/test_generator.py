"""The generator against transformers' greedy decoding, across TP, batching and seeds; bad requests."""

import pytest
import torch

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.parallel.spawn import run_local
from gen_workers import generate_worker, parity_worker

transformers = pytest.importorskip("transformers")


PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2]]


def test_greedy_equals_transformers_at_tp1_and_tp2(tiny_hf):
    hf, cfg, full = tiny_hf
    want = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in PROMPTS]
    for tp in (1, 2):
        got = run_local(generate_worker, tp, cfg, full, tp, reqs, 2)  # 2 slots for 4 prompts: slots are reused
        for r in got:
            assert [t for t, _, _, _ in r] == want, f"tp={tp}"
            assert all(f == "length" for _, _, f, _ in r)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_hf):
    _, cfg, full = tiny_hf
    params = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=10, seed=seed, n=2)  # noqa: E731
    reqs = [GenerationRequest(p, params(i)) for i, p in enumerate(PROMPTS)]
    batched = run_local(generate_worker, 1, cfg, full, 1, reqs, 8)[0]
    one_slot = run_local(generate_worker, 1, cfg, full, 1, reqs, 1)[0]  # one sequence at a time
    again = run_local(generate_worker, 1, cfg, full, 1, reqs, 3)[0]
    assert [t for t, *_ in batched] == [t for t, *_ in one_slot] == [t for t, *_ in again]
    for (t1, lp1, *_), (t2, lp2, *_) in zip(batched, one_slot):
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-5
    assert batched[0][0] != batched[1][0]  # the n samples of a request differ
    other = run_local(generate_worker, 1, cfg, full, 1, [GenerationRequest(PROMPTS[0], params(99))], 2)[0]
    assert other[0][0] != batched[0][0]


def test_stop_tokens_and_bad_requests_are_handled_one_by_one(tiny_hf):
    hf, cfg, full = tiny_hf
    greedy = run_local(generate_worker, 1, cfg, full, 1,
                       [GenerationRequest(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))], 1)[0][0][0]
    stop = greedy[3]
    reqs = [
        GenerationRequest(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,))),
        GenerationRequest([], SamplingParams()),
        GenerationRequest([1] * 80, SamplingParams()),
        GenerationRequest([1, 2], SamplingParams(temperature=-1)),
        GenerationRequest([1, 2], SamplingParams(top_p=0.0)),
        GenerationRequest([1, 2], SamplingParams(top_p=1.5)),
        GenerationRequest([1, 2], SamplingParams(temperature=0, max_new_tokens=3)),
    ]
    out = run_local(generate_worker, 1, cfg, full, 1, reqs, 4)[0]
    assert out[0][0] == greedy[: greedy.index(stop) + 1] and out[0][2] == "stop"
    errors = [o[3] for o in out[1:6]]
    assert all(o[2] == "error" for o in out[1:6])
    assert "empty prompt" in errors[0] and "context" in errors[1] and "temperature" in errors[2]
    assert "top_p" in errors[3] and "top_p" in errors[4]
    assert out[6][2] == "length" and len(out[6][0]) == 3


def test_behaviour_logprobs_match_the_trainer_forward(tiny_hf):
    _, cfg, full = tiny_hf
    for tp in (1, 2):
        diffs = run_local(parity_worker, tp, cfg, full, tp)
        assert max(max(d) for d in diffs) < 1e-5, (tp, diffs)
