"""8-bit weight-only generation: int8 against transformers' Llama holding the same int8-rounded weights; fp8
after a DDMA push against an independent e4m3 rounding of the same shards."""

import pytest
import torch

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.launch.spawn import run_local
from gen_workers import fp8_push_worker, int8_generate_worker

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2]]
ROW_PARALLEL = ("o_proj", "down_proj")  # Megatron splits their columns (inputs) over TP ranks


def _round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8: scale = max |row| / 127, w ~ round(w / scale) * scale."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def _int8_reference(hf, tp: int):
    """A copy of `hf` whose projection weights are int8 round trips of each TP rank's local shard (the rows of a
    row-parallel weight are split by columns, and each part has its own scale); embeddings, output and norms
    stay in full precision."""
    import copy

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() != 2 or "embed_tokens" in name or "lm_head" in name:
                continue
            parts = p.chunk(tp, dim=1) if any(k in name for k in ROW_PARALLEL) else [p]
            p.copy_(torch.cat([_round_trip(x) for x in parts], dim=1))
    return ref


@pytest.mark.parametrize("tp,how", [(1, "quantize"), (2, "quantize"), (2, "build")])
def test_int8_generator_equals_transformers_on_int8_rounded_weights(tiny_hf, tp, how):
    hf, cfg, full = tiny_hf
    ref = _int8_reference(hf, tp)
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in PROMPTS]
    got = run_local(int8_generate_worker, tp, cfg, full, tp, reqs, how)
    want, want_lp, changed = [], [], 0
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
        with torch.no_grad():
            lp = torch.log_softmax(ref(out).logits[0, len(p) - 1:-1].double(), dim=-1)
        want_lp.append(lp.gather(1, out[0, len(p):, None])[:, 0])
        plain = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        changed += plain[0, len(p):].tolist() != want[-1]
    for outs, before, after, names in got:
        assert [t for t, _ in outs] == want
        for (_, lp), ref_lp in zip(outs, want_lp):
            assert (torch.tensor(lp, dtype=torch.float64) - ref_lp).abs().max() < 1e-4
        # q/k/v, projection, fc1 and fc2 of every layer are int8; embedding, output layer and norms are not
        assert len(names) == 4 * cfg.num_layers and not any("embedding" in n or "output" in n for n in names)
        # fp32 model: the quantized matrices shrink 4x (plus a float32 scale per row)
        assert after < 0.6 * before
    assert changed > 0  # the rounding is visible: this is not the full-precision model in disguise


def test_int8_generator_of_each_family_equals_transformers_on_int8_rounded_weights():
    """Qwen2 (the QKV bias stays in full precision beside the int8 weight), Qwen3 (q/k norms) and Mistral at TP2."""
    from family_workers import int8_families_worker
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf
    from tiny_hf import FAMILY_CONFIGS, tiny_family_model

    models, cases = [], []
    for family in FAMILY_CONFIGS:
        hf = tiny_family_model(family, scale=4.0)
        cfg = model_config_from_hf(hf.config, name=family)
        models.append(hf)
        cases.append((cfg, hf_to_megatron(dict(hf.state_dict()), cfg)))
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in PROMPTS]
    got = run_local(int8_families_worker, 2, cases, reqs)[0]
    for family, hf, outs in zip(FAMILY_CONFIGS, models, got):
        ref = _int8_reference(hf, 2)
        want = [ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
        assert [t for t, _ in outs] == want, family


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_fp8_generator_after_a_ddma_push_holds_per_channel_e4m3_weights(tiny_hf, gen_tp):
    """A TP2 trainer pushes twice into an fp8 generator (its row-parallel weights arrive in column pieces from both
    trainer ranks, so the row scales are global). The dequantized weights equal an independent per-channel e4m3
    round trip of the generator's local shards bit for bit; the generator then decodes exactly as a dense model
    holding those rounded weights, and close to the full-precision model."""
    _, cfg, full = tiny_hf
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in PROMPTS]
    got = run_local(fp8_push_worker, 2 + gen_tp, cfg, full, 2, gen_tp, reqs)[2:]
    for r in got:
        assert r["fp8_bad"] == [] and r["other_bad"] == [] and r["in_place"]
        assert r["codes"] == {"torch.float8_e4m3fn"}
        assert len(r["names"]) == 4 * cfg.num_layers and not any("embedding" in n or "output" in n for n in r["names"])
        dense, fp8 = r["bytes"]
        assert fp8 < 0.6 * dense  # fp32 model: the quantized matrices shrink 4x (plus a float32 scale per row)
        out = r["outputs"]
        # the fp8 path computes the dense model on the rounded weights: same tokens, log-probs to fp32 rounding
        assert [t for t, _ in out["fp8"]] == [t for t, _ in out["rounded"]]
        for (_, a), (_, b) in zip(out["fp8"], out["rounded"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        # Against full precision, on the fp8 generator's own tokens: e4m3 rounds each weight by up to 1/16 of
        # itself (3 mantissa bits), which moves the log-probs of this model (weights enlarged 4x, confident) by
        # about a tenth of a nat at most; the bound leaves twice that.
        gaps = [abs(x - y) for (_, a), b in zip(out["fp8"], r["scored"]) for x, y in zip(a, b)]
        assert max(gaps) < 0.25 and sum(gaps) / len(gaps) < 0.1
