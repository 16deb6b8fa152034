"""Presets carry the published shapes: parameter counts against the models' published totals."""

import pytest

from megatron_rl.models.families import FAMILIES
from megatron_rl.models.presets import PRESETS, get_preset

# Published parameter counts (Hugging Face model cards / safetensors metadata).
PUBLISHED = {
    "smollm2-135m": 134_515_008,
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B shape
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.1": 7_241_732_096,
    "mistral-7b": 7_248_023_552,  # v0.3: the v0.1 shape with 768 more tokens
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "mixtral-8x7b": 46_702_792_704,
}
# Mixtures of experts: parameters a token runs through, as the model cards give them (billions) and how far the
# card's rounding is from the count (Qwen3-30B-A3B's 3.35 is written "3.3", Qwen3-235B-A22B's 22.19 "22").
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": (3.3, 0.06), "qwen3-235b-a22b": (22, 0.5), "mixtral-8x7b": (12.9, 0.05)}
# Qwen3's model cards give totals and non-embedding counts in billions, rounded.
PUBLISHED_QWEN3 = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-8b": (8.2, 6.95)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts(name):
    assert PRESETS[name].num_parameters(tp=1) == PUBLISHED[name]


@pytest.mark.parametrize("name", PUBLISHED_ACTIVE)
def test_active_parameter_counts(name):
    published, rounding = PUBLISHED_ACTIVE[name]
    assert abs(PRESETS[name].num_active_parameters() / 1e9 - published) < rounding
    dense = get_preset("llama3-8b")
    assert dense.num_active_parameters() == dense.num_parameters()


def _in_memory_shapes(shapes: dict, m) -> dict:
    """HF file shapes as transformers 5 holds a mixture of experts in memory: each layer's experts fused into
    `mlp.experts.gate_up_proj` [E, 2F, h] and `down_proj` [E, h, F], Mixtral's `block_sparse_moe` as `mlp`."""
    from megatron_rl.models.families import family

    names = family(m.family).experts
    if names is None:
        return shapes
    out, h, f, e = {}, m.hidden_size, m.moe_ffn_hidden_size, m.num_moe_experts
    for k, v in shapes.items():
        if f".{names.prefix}.experts." not in k:
            out[k.replace(f".{names.prefix}.", ".mlp.")] = v
        elif k.endswith(f".experts.0.{names.down}.weight"):
            layer = k.split(f".{names.prefix}.")[0]
            out[f"{layer}.mlp.experts.gate_up_proj"] = (e, 2 * f, h)
            out[f"{layer}.mlp.experts.down_proj"] = (e, h, f)
    return out


@pytest.mark.parametrize("name", PUBLISHED_QWEN3)
def test_qwen3_parameter_counts(name):
    m = PRESETS[name]
    total, body = PUBLISHED_QWEN3[name]
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    digits = len(str(total).split(".")[1])
    assert round(m.num_parameters(tp=1) / 1e9, digits) == total
    assert round((m.num_parameters(tp=1) - embeddings) / 1e9, len(str(body).split(".")[1])) == body


@pytest.mark.parametrize("name", [n for n, m in PRESETS.items() if m.family != "llama"])
def test_parameter_counts_equal_transformers_model_of_the_preset(name):
    """The preset's count and shapes against the transformers model its config.json builds (on the meta device)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from megatron_rl.models.families import hf_config_dict
    from megatron_rl.models.hf_mapping import hf_shapes, model_config_from_hf

    m = PRESETS[name]
    raw = hf_config_dict(m, "float32")
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == _in_memory_shapes(hf_shapes(m, lm_head=True), m)
    pad_rows = m.padded_vocab_size(1) - m.vocab_size
    padding = pad_rows * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    assert sum(p.numel() for p in model.parameters()) == m.num_parameters(tp=1) - padding
    assert model_config_from_hf(config, name=name) == m


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_param_spec_matches_a_tiny_transformers_model_of_each_family(family, tied):
    """`param_spec` (which the HF mapping, DDMA and `num_parameters` read) against transformers itself: every HF
    tensor's shape and the parameter count of a tiny model of each family, with its features (QKV bias, q/k norms
    on heads wider than hidden/heads); each Megatron tensor holds exactly its HF tensors' elements."""
    transformers = pytest.importorskip("transformers")
    import math

    import torch

    from megatron_rl.models.families import hf_config_dict
    from megatron_rl.models.param_spec import model_params

    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2) if FAMILIES[family].experts else {}
    m = get_preset("tiny", family=family, tie_word_embeddings=tied, head_dim=32 if "qwen3" in family else None,
                   make_vocab_size_divisible_by=1, **moe)  # no vocabulary padding: counts compare as they are
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf_config_dict(m, "float32")))
    params = model_params(m, output_layer=True)
    assert _in_memory_shapes({n: s for p in params for n, s in zip(p.hf, p.hf_shapes())}, m) == {
        k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == m.num_parameters()
    for p in params:
        assert sum(math.prod(s) for s in p.hf_shapes()) == p.numel, p.name


def test_vocab_padding_is_a_multiple_of_128_times_tp():
    m = get_preset("llama3-8b")
    assert m.padded_vocab_size(1) == 128256
    assert m.padded_vocab_size(8) == 129024
    assert get_preset("tiny").padded_vocab_size(1) == 384
    assert get_preset("tiny").padded_vocab_size(2) == 512


def test_llama3_shapes():
    m = get_preset("llama3-405b")
    assert (m.num_query_groups, m.rotary_base, m.rope_scaling, m.tie_word_embeddings) == (8, 500000.0, True, False)
    assert get_preset("smollm2-135m").tie_word_embeddings
    with pytest.raises(ValueError, match="did you mean 'llama3-70b'"):
        get_preset("llama3-70")


def test_presets_command_lists_each_preset_with_its_experts(capsys):
    """`megatron-rl presets`: one JSON line per preset; a mixture of experts also gives its experts, how many a
    token uses and its active parameters."""
    import json

    from megatron_rl.cli import main

    assert main(["presets"]) == 0
    lines = {d["preset"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(lines) == list(PRESETS)
    assert lines["mixtral-8x7b"]["experts"] == 8 and lines["mixtral-8x7b"]["experts_per_token"] == 2
    assert lines["qwen3-30b-a3b"]["active_parameters"] == PRESETS["qwen3-30b-a3b"].num_active_parameters()
    assert "experts" not in lines["llama3-8b"]
