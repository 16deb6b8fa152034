"""The generator against transformers' greedy decoding, across TP, batching and seeds; bad requests."""

import pytest
import torch

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.launch.spawn import run_local
from gen_workers import generate_worker, lookahead_worker, paged_worker, parity_worker

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


def test_lookahead_decoding_gives_the_same_outputs(tiny_hf):
    """Launching step t + 1 before reading step t (the GPU default) changes no token: sequences that stop early,
    hit their length or the context end, and slots handed on to waiting sequences, at TP=1 and TP=2."""
    _, cfg, full = tiny_hf
    sampled = lambda i, **kw: SamplingParams(temperature=1.0, top_p=0.95, seed=i, **kw)  # noqa: E731
    at_context_end = GenerationRequest(list(range(1, 60)), sampled(7, max_new_tokens=20))  # 5 tokens to 64
    mixed = [GenerationRequest(p, sampled(i, n=2, max_new_tokens=4 + 3 * i)) for i, p in enumerate(PROMPTS)]
    mixed += [at_context_end, GenerationRequest([9, 9], SamplingParams(temperature=0, max_new_tokens=1))]
    # A slot freed at the context end stays free while the other sequence runs on: its position must not run
    # past the cache.
    lone = [at_context_end, GenerationRequest([7], sampled(3, max_new_tokens=30))]
    for tp in (1, 2):
        for rank_out in run_local(lookahead_worker, tp, cfg, full, tp, [(mixed, 3), (lone, 2)]):
            for read_at_once, one_step_late in rank_out:
                assert [t for t, _, _ in one_step_late] == [t for t, _, _ in read_at_once]
                assert [f for _, _, f in one_step_late] == [f for _, _, f in read_at_once]
                assert max(abs(a - b) for (_, x, _), (_, y, _) in zip(read_at_once, one_step_late)
                           for a, b in zip(x, y)) < 1e-5
            lengths = [[len(t) for t, _, _ in mode[0]] for mode in rank_out]
            assert lengths == [[4, 4, 7, 7, 10, 10, 13, 13, 5, 1], [5, 30]]


def test_a_paged_cache_decodes_as_the_slot_cache_does_in_less_memory(tiny_hf):
    """Sequences of uneven lengths (1 to 40 new tokens), sampled: a paged cache (16-token blocks) gives the slot
    cache's tokens, with room for as many sequences in fewer tokens than slots x 64; a pool too small for them all at
    once preempts the latest and prefills it again later, tokens unchanged; at TP1 and TP2."""
    _, cfg, full = tiny_hf
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, top_p=0.95, seed=i, n=2, max_new_tokens=1 + 13 * i))
            for i, p in enumerate(PROMPTS)]
    runs = [(8, None), (8, 8 * 48), (8, 64)]  # slot cache 8 x 64; paged 384 and 64 tokens
    for tp in (1, 2):
        for (slot, _), (paged, stats), (small, tight) in run_local(paged_worker, tp, cfg, full, tp, reqs, runs):
            for other in (paged, small):
                assert [t for t, _, _ in other] == [t for t, _, _ in slot]
                assert [f for _, _, f in other] == [f for _, _, f in slot]
                assert max(abs(a - b) for (_, x, _), (_, y, _) in zip(slot, other) for a, b in zip(x, y)) < 1e-5
            assert stats["preempted"] == 0 and stats["kv_blocks_peak"] * 16 < 8 * 64
            assert tight["preempted"] > 0 and tight["kv_blocks_peak"] <= tight["kv_blocks"] == 4


def test_no_cache_slot_is_an_error_not_a_hang():
    """generator.max_batch_size=0 used to leave every sequence waiting for a slot, forever."""
    from megatron_rl.inference.generator import Generator

    with pytest.raises(ValueError, match=r"^generator max_batch_size=0 must be >= 1"):
        Generator(None, 16, None, max_batch_size=0)


@pytest.mark.parametrize("dtype, native",
                         [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_the_cpu_linear_equals_f_linear_at_decode_and_prefill_sizes(dtype, native, monkeypatch):
    """The CPU decode's linear (`kv_forward._cpu_linear`: `W @ x^T` for a few fp32 rows) gives F.linear's result,
    with and without bias, for a strided input (SwiGLU's halves) too, and returns a contiguous tensor; long fp32
    chunks are F.linear's own, and so is bf16 on a CPU with native bf16. Without it, bf16 from
    BF16_IN_FP32_MIN_ROWS rows on is within one bf16 rounding of the exact product of its inputs (F.linear's, with
    a bias, within two)."""
    from megatron_rl.inference import kv_forward
    from megatron_rl.inference.kv_forward import BF16_IN_FP32_MIN_ROWS, SMALL_BATCH_ROWS, _cpu_linear

    monkeypatch.setattr(kv_forward, "native_bf16", lambda: native)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    for rows in (1, 2, 7, BF16_IN_FP32_MIN_ROWS - 1, BF16_IN_FP32_MIN_ROWS, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1):
        x = torch.randn(1, rows, 80, generator=g).to(dtype)[..., ::2]  # [1, rows, 40], strided
        for bias in (None, b):
            got, want = _cpu_linear(x, w, bias), torch.nn.functional.linear(x, w, bias)
            assert got.shape == want.shape == (1, rows, 48) and got.is_contiguous() and got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            elif native or rows < BF16_IN_FP32_MIN_ROWS:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            else:  # one rounding to bf16 (unit roundoff 2^-8); the fp32 sums add far less (atol)
                product = torch.nn.functional.linear(x.double(), w.double())
                exact = product if bias is None else product + bias.double()
                assert torch.all((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4), rows
                # F.linear's bf16 rounds the product, then its sum with the bias: a second rounding
                assert torch.all((want.double() - exact).abs() <= 2 ** -8 * (product.abs() + exact.abs()) + 1e-4)
    if dtype == torch.bfloat16:  # a weight of 2^24 elements is converted from 32 rows on only (its cost pays then)
        big, x = torch.randn(16384, 1024, generator=g).to(dtype), torch.randn(1, 32, 1024, generator=g).to(dtype)
        linear, kernels = torch.nn.functional.linear, []
        monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: kernels.append(a[0].dtype) or linear(*a))
        for rows in (31, 32):
            kernels.clear()
            assert _cpu_linear(x[:, :rows], big, None).dtype == dtype
            assert (torch.bfloat16 in kernels) == (native or rows < 32), (rows, kernels)
