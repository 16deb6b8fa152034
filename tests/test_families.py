"""Qwen2/2.5, Qwen3 and Mistral end to end, on small random models that transformers builds from a config: HF ->
Megatron at TP2 and back bit for bit, with the tokenizer and its chat template; logits at TP2 x PP2 against
transformers' own model class; `megatron-rl eval` (greedy, fp32, TP2) against transformers' greedy `generate`; a TP2
trainer's step pushed into a TP1 generator; `reshard-check`; config.json read as transformers reads it; refusals in
one line; the model section's family and head size."""

import json

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.data import GSM8K_INSTRUCTION

transformers = pytest.importorskip("transformers")

from tiny_hf import FAMILY_CONFIGS, save_chat_word_tokenizer, tiny_family_model  # noqa: E402

LIMIT, NEW = 2, 10


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """For each family: its HF directory (weights, Qwen-like tokenizer with a chat template), the model, and its
    conversion at TP2 (Qwen2, whose embeddings are tied, at TP2 x PP2: the last stage holds a copy of them)."""
    from megatron_rl.checkpointing.convert import convert

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILY_CONFIGS:
        src = root / f"{family}-hf"
        tok = save_chat_word_tokenizer(src)
        # Enlarged weights: confident, varied greedy continuations over the small vocabulary.
        model = tiny_family_model(family, vocab_size=len(tok), scale=4.0, seed=1)
        model.save_pretrained(src, safe_serialization=True)
        pp = 2 if family == "qwen2" else 1
        summary = convert(src, root / family, "megatron", tp=2, pp=pp)
        assert summary["layout"] == {"tp": 2, "pp": pp, "dp": 1} and summary["tokenizer"]
        out[family] = (src, model, root / family)
    return out


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_tp2_conversion_and_back_is_bit_exact_and_carries_the_chat_template(families, family, tmp_path):
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models.hf_mapping import model_config_from_hf

    src, model, ckpt = families[family]
    cfg, meta = read_model(ckpt)
    assert cfg.family == family and meta.tokenizer == {"type": "hf", "path": "tokenizer"}
    convert(ckpt, tmp_path / "back", "hf", shard_bytes=50_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(model)
    sd = model.state_dict()
    assert set(back.state_dict()) == set(sd)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert model_config_from_hf(back.config, name=src.name) == cfg
    messages = [{"role": "user", "content": "how many cat"}]
    want = transformers.AutoTokenizer.from_pretrained(src).apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path / "back").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert got == want and "<|im_start|>assistant" in got


def _reference(model, tok, rows):
    """transformers' greedy generation of the eval prompts, built with the source directory's tokenizer."""
    out = []
    for row in rows:
        messages = [{"role": "user", "content": GSM8K_INSTRUCTION.replace("{question}", row["question"])}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        out.append({"prompt": prompt, "output": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True),
                    "new_tokens": gen.shape[1] - ids.shape[1]})
    return out


def test_eval_greedy_at_tp2_writes_what_transformers_generate_writes(shared_data, families, tmp_path, capsys):
    rows = [json.loads(line) for line in
            (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:LIMIT]]
    for family, (src, model, ckpt) in families.items():
        samples = tmp_path / f"{family}.jsonl"
        rc = main(["eval", str(ckpt), "--limit", str(LIMIT), "--max-new-tokens", str(NEW), "--tp", "2",
                   "--samples-out", str(samples)])
        out = capsys.readouterr()
        assert rc == 0, out.err[-3000:]
        assert json.loads(out.out)["dtype"] == "float32"
        got = [json.loads(line) for line in samples.read_text().splitlines()]
        want = _reference(model, transformers.AutoTokenizer.from_pretrained(src), rows)
        assert [(g["prompt"], g["output"], g["new_tokens"]) for g in got] == \
            [(w["prompt"], w["output"], w["new_tokens"]) for w in want], family
        assert any(w["output"] for w in want)  # the outputs are words, not nothing


# config.json files with the family's defaults left out (transformers fills them in, and so must we).
SPARSE = {
    "qwen2": {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "rope_theta": 1e6,
              "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "mistral": {"model_type": "mistral", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "vocab_size": 500, "max_position_embeddings": 4096},
    "qwen2-window-off": {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4,
                         "hidden_size": 64, "use_sliding_window": True, "max_window_layers": 2},
}


@pytest.mark.parametrize("name", SPARSE)
def test_config_json_is_read_as_transformers_reads_it(name, tmp_path):
    from megatron_rl.checkpointing.hf_sources import hf_model_config
    from megatron_rl.models.hf_mapping import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(SPARSE[name]))
    want = model_config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path), name=tmp_path.name)
    assert hf_model_config(tmp_path) == want


REFUSED = {
    "mistral-window": ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768},
                       "sliding-window attention is not supported (sliding_window=4096 < "
                       "max_position_embeddings=32768"),
    "mistral-default-window": ({"model_type": "mistral"}, "sliding-window attention is not supported"),
    "qwen2-window": ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096,
                      "max_window_layers": 0, "max_position_embeddings": 32768},
                     "sliding-window attention is not supported"),
    "qwen3-layer-types": ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 1024,
                           "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]},
                          "sliding-window attention is not supported"),
    "qwen2-moe": ({"model_type": "qwen2_moe"},
                  "architecture 'qwen2_moe' is not supported: mixture-of-experts with shared experts"),
    "deepseek-v3": ({"model_type": "deepseek_v3"}, "is not supported: mixture-of-experts with multi-head latent"),
    "experts-key": ({"model_type": "qwen3", "num_experts": 8},
                    "mixture-of-experts layers are not supported in the dense family 'qwen3'"),
    "qwen3-moe-dense-layers": ({"model_type": "qwen3_moe", "mlp_only_layers": [0]},
                               "dense layers between expert layers are not supported"),
    "mixtral-jitter": ({"model_type": "mixtral", "router_jitter_noise": 0.1},
                       "router_jitter_noise=0.1 is not supported"),
    "qwen3-bias": ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
    "gelu": ({"model_type": "qwen2", "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_features_are_refused_in_one_line_naming_them(name, tmp_path):
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError

    raw, message = REFUSED[name]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConversionError) as e:
        convert(tmp_path / "src", tmp_path / "dst", "megatron")
    text = str(e.value)
    assert message in text and "\n" not in text and not (tmp_path / "dst").exists()


def test_train_at_tp2_and_push_to_a_tp1_generator():
    """Per family: one RL step of a TP2 trainer pushed by DDMA into a TP1 generator equals the same step taken at
    TP1 (q/k norm gradients summed over TP ranks, QKV bias gradients sharded with their rows); every tensor
    arrives, and the generator's sampling log-probs are its own forward's."""
    from family_workers import train_push_worker
    from megatron_rl.launch.spawn import run_local
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    cases = []
    for family in FAMILY_CONFIGS:
        hf = tiny_family_model(family)
        cfg = model_config_from_hf(hf.config, name=family)
        cases.append((family, cfg, hf_to_megatron(dict(hf.state_dict()), cfg)))
    results = run_local(train_push_worker, 3, cases)[2]
    for family, gap, unchanged, untrained, lp_gap in results:
        assert unchanged == untrained == [] and gap < 1e-5 and lp_gap < 1e-5, (family, gap, unchanged, lp_gap)


def test_logits_at_tp2_pp2_match_transformers(families):
    """The TP2 conversions loaded at TP2 x PP2: logits equal transformers' own model's, within the Llama bound."""
    from family_workers import checkpoint_logits_worker
    from megatron_rl.launch.spawn import run_local

    tokens = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(3))
    ckpts = [families[f][2] for f in FAMILY_CONFIGS]
    got = [r for r in run_local(checkpoint_logits_worker, 4, ckpts, dict(tp=2, pp=2), tokens) if r[0] is not None]
    assert len(got) == 1
    for family, logits in zip(FAMILY_CONFIGS, got[0]):
        with torch.no_grad():
            want = families[family][1](tokens).logits
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0, msg=lambda m: f"{family}: {m}")


def test_the_model_section_takes_a_family_and_a_head_size_and_names_a_wrong_one():
    from megatron_rl.config import ConfigError, load_config, validate

    cfg = load_config(None, ["model.family=qwen3", "model.head_dim=32", "model.hidden_size=70"])
    validate(cfg)  # 4 heads of 32 over a hidden size of 70: only a given head size allows it
    model = cfg.model.resolve()
    assert (model.kv_channels, model.qk_layernorm, model.add_qkv_bias) == (32, True, False)
    families = "llama, qwen2, qwen3, mistral, qwen3_moe, mixtral"
    with pytest.raises(ConfigError, match=rf"model.family='gpt2' is not one of {families}"):
        validate(load_config(None, ["model.family=gpt2"]))
    for overrides, message in [
            (["model.num_moe_experts=4"], "model.num_moe_experts=4 needs a mixture-of-experts family"),
            (["model.family=mixtral"], "model.family='mixtral' needs model.num_moe_experts >= 1, got None"),
            (["model.family=mixtral", "model.num_moe_experts=4", "model.moe_router_topk=5"],
             r"model.moe_router_topk=5 must be within 1..model.num_moe_experts=4")]:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, overrides))
    with pytest.raises(ConfigError, match=r"model.num_attention_heads=4 does not divide model.hidden_size=70"):
        validate(load_config(None, ["model.hidden_size=70"]))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_reshard_check_covers_the_qkv_bias_and_the_qk_norms(family, capsys):
    """`megatron-rl reshard-check` moves and checks every tensor of the family, the new ones included."""
    from megatron_rl.ddma.descriptors import logical_params
    from megatron_rl.models import get_preset

    sets = ["--set", f"family={family}", "--set", "num_layers=2", "--set", "head_dim=32"]
    assert main(["reshard-check", "--model", "tiny", "--src", "tp=2", "--dst", "tp=1", *sets]) == 0
    summary = json.loads(capsys.readouterr().out)
    cfg = get_preset("tiny", family=family, num_layers=2, head_dim=32)
    names = [p.name for p in logical_params(cfg)]
    assert summary["ok"] and summary["params_checked"] == len(names)
    assert any(n.endswith("linear_qkv.bias" if family == "qwen2" else "q_layernorm.weight") for n in names)
