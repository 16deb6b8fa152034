"""The generator of a mixture-of-experts model (Qwen3-MoE, Mixtral): its MoE layers run as the model's own module in
the incremental forward (`inference/kv_forward.py`), at TP1 and at TP2 with the experts split over TP (ep=2,
etp=1); its tokens and log-probs against the trainer's teacher-forced forward and transformers' greedy decoding;
the paged cache, the pipelined generator, the CUDA-rules path (no decode graph), and the `generator.ep` rules."""

import pytest
import torch

from megatron_rl.launch.spawn import run_local
from moe_gen_workers import PROMPTS, cuda_rules_worker, generate_worker, pipeline_worker
from tiny_hf import tiny_moe_models

transformers = pytest.importorskip("transformers")

# Log-probs the generator records against the teacher-forced forward (measured: 4.8e-7 at TP1 and TP2 x EP2).
LP_GAP = 1e-5


@pytest.fixture(scope="module")
def moe_cases():
    """family -> (transformers model, ModelConfig, logical Megatron weights); weights scaled up so that greedy
    decoding has clear winners."""
    return tiny_moe_models(scale=4.0)


@pytest.fixture(scope="module")
def greedy_hf(moe_cases) -> dict[str, list[list[int]]]:
    """family -> transformers' greedy `generate` of each prompt (10 tokens)."""
    return {family: [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
            for family, (hf, _, _) in moe_cases.items()}


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2, ep=2, etp=1)], ids=["tp1", "tp2-ep2"])
def test_generator_equals_teacher_forcing_and_transformers(moe_cases, greedy_hf, layout):
    """Greedy and sampled outputs (2 slots for 12 sequences: slots reused, prefill beside decode) record the
    log-probs of the trainer's forward of the same sequences; greedy tokens are transformers' `generate`'s; a paged
    cache of 48 tokens (sequences preempted) gives the slot cache's tokens. At TP2 x EP2 every TP rank holds two
    whole experts and routes half of each step's tokens (`models.moe.TokenSplitMoELayer`)."""
    cases = [(cfg, full) for _, cfg, full in moe_cases.values()]
    results = run_local(generate_worker, layout["tp"], cases, layout, [(2, None), (3, 48)])
    for i, family in enumerate(moe_cases):
        want = greedy_hf[family]
        (slot, slot_gap), (paged, paged_gap) = results[0][i]
        assert [t for t, _ in slot[:len(PROMPTS)]] == want, family
        assert slot_gap < LP_GAP and paged_gap < LP_GAP, (family, slot_gap, paged_gap)
        assert [t for t, _ in paged] == [t for t, _ in slot], family
        assert all(r[i] == results[0][i] for r in results[1:]), family  # every TP rank returns the same
        assert slot[len(PROMPTS)][0] != slot[len(PROMPTS) + 1][0]  # the n samples of a request differ


def test_pipelined_moe_generator_equals_one_stage(moe_cases):
    """PP2 (one MoE layer per stage): the one-stage generator's tokens and log-probs."""
    _, cfg, full = moe_cases["qwen3_moe"]
    one = run_local(generate_worker, 1, [(cfg, full)], dict(tp=1), [(3, None)])[0][0][0][0]
    for got in run_local(pipeline_worker, 2, cfg, full, 2):
        assert [t for t, _ in got] == [t for t, _ in one]
        assert max(abs(a - b) for (_, x), (_, y) in zip(got, one) for a, b in zip(x, y)) < LP_GAP


def test_moe_generator_under_cuda_rules_decodes_eagerly(moe_cases):
    """On the GPU paths (CUDA-rules mode, TP2 x EP2) an MoE generator takes no decode graph, refuses
    `cuda_graphs=True`, keeps its lookahead, and gives the CPU path's tokens and recorded routes (copied to pinned
    host buffers without waiting, under CUDA's rules); the capture check refuses its MoE
    layer's forward (the expert dispatch selects each expert's tokens: a data-dependent shape), which is why."""
    _, cfg, full = moe_cases["mixtral"]
    for r in run_local(cuda_rules_worker, 2, cfg, full, dict(tp=2, ep=2, etp=1)):
        rules, cpu = r["1"], r["0"]
        assert rules["graph"] is False and rules["lookahead"] is True
        assert "mixture-of-experts" in rules["refused"] and "mixture-of-experts" in cpu["refused"]
        assert [t for t, _ in rules["outputs"]] == [t for t, _ in cpu["outputs"]]
        assert all(torch.equal(a, b) for a, b in zip(rules["routes"], cpu["routes"], strict=True))
        gap = max(abs(a - b) for (_, x), (_, y) in zip(rules["outputs"], cpu["outputs"]) for a, b in zip(x, y))
        assert gap < 1e-4, gap
        assert r["capture"] is not None and "inside a CUDA graph capture" in r["capture"]


MOE_MODEL = ["model.preset=qwen3-30b-a3b", "model.num_layers=4"]


@pytest.mark.parametrize("overrides,message", [
    (MOE_MODEL + ["generator.tp=2", "generator.ep=4"],
     r"^generator.ep=4 must divide generator.tp=2 \(a generator keeps each layer's experts within its TP group"),
    (["generator.tp=2", "generator.ep=2"],
     r"^generator.ep=2 needs a mixture-of-experts model \(this one is dense\)$"),
    (MOE_MODEL + ["model.num_moe_experts=6", "model.moe_router_topk=2", "generator.tp=4", "generator.ep=4"],
     r"^generator.ep=4 does not divide model.num_moe_experts=6$"),
    (MOE_MODEL + ["generator.ep=0"], r"^generator.ep=0 must be >= 1"),
])
def test_generator_ep_rules(overrides, message):
    from megatron_rl.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides), cluster_files=False)


def test_generator_ep_layout_keeps_experts_within_tp():
    from megatron_rl.config import load_config, validate

    cfg = load_config(None, MOE_MODEL + ["generator.tp=4", "generator.ep=2", "generator.dp=2"])
    validate(cfg, cluster_files=False)
    layout = cfg.generator.layout
    assert (layout.tp, layout.dp, layout.ep, layout.etp) == (4, 2, 2, 2)
    # every replica holds all the experts: a rank's expert coordinates depend on its TP rank alone
    assert all(layout.expert_coords(t, 0) == layout.expert_coords(t, 1) for t in range(4))
    assert sorted(layout.expert_coords(t, 0) for t in range(4)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_8bit_moe_generator_holds_its_experts_in_8_bits_and_decodes_with_them(moe_cases):
    """int8 and fp8 at TP2 x EP2 (each TP rank two whole experts): every expert linear the rank holds is an 8-bit
    weight (routers and norms are not), each expert's dequantized weight is an independent per-row round trip of its
    shard (int8: the nearest multiple of max|row| / 127), and the generator decodes, greedy and sampled, exactly as a
    full-precision generator holding those rounded weights."""
    from moe_gen_workers import quantized_worker

    _, cfg, full = moe_cases["qwen3_moe"]
    per_rank = run_local(quantized_worker, 2, cfg, full, dict(tp=2, ep=2, etp=1), ["int8", "fp8"])
    for rank, results in enumerate(per_rank):
        for fmt, (got, want, names, experts) in zip(["int8", "fp8"], results):
            assert [t for t, _ in got] == [t for t, _ in want], (fmt, rank)
            assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) < 1e-6, (fmt, rank)
            assert not any("router" in n or "norm" in n for n in names), names
            # 2 local experts x 2 linears per layer
            assert len(experts) == cfg.num_layers * 2 * 2 and all(n in names for n in experts), (fmt, sorted(experts))
            for name, (deq, shard) in experts.items():
                if fmt == "int8":
                    scale = shard.abs().amax(dim=1, keepdim=True) / 127
                    torch.testing.assert_close(deq, torch.round(shard / scale) * scale, atol=1e-6, rtol=0)
                assert 0 < (deq - shard).abs().max() <= shard.abs().max() / 8, (fmt, name)  # rounded, not zeroed
