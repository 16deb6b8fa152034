"""Tiny random Hugging Face Llama models and a word-level tokenizer, written to a directory for the tests."""

import torch
import transformers

WORDS = "the cat sat on a mat and ran".split()


def save_word_tokenizer(d):
    """A word-level HF tokenizer over WORDS (ids 3..10; <unk> 0, <s> 1, </s> 2), saved into `d`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(d)


def save_tiny_llama(d, *, vocab_size=300, num_layers=2, tied=False, seed=0):
    """A random transformers Llama (hidden 64, 4 heads / 2 KV heads, ffn 176) saved as safetensors into `d`;
    returns the model."""
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    return model


# One small shape per family, with each family's own features: Qwen2's QKV biases (tied, like Qwen2.5-0.5B),
# Qwen3's q/k norms with heads wider than hidden/heads (32 vs 16), Mistral untied.
FAMILY_CONFIGS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


# The mixture-of-experts families: 4 experts, 2 per token. Qwen3-MoE with experts narrower than its (unused) dense
# width and its probabilities renormalized over the chosen experts; Mixtral's experts as wide as its dense MLP.
MOE_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(tie_word_embeddings=False, rope_theta=1e6, head_dim=32, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
}


def file_state_dict(model):
    """A transformers model's tensors under the names its safetensors files hold (transformers 5 fuses a
    mixture-of-experts layer's experts in memory and splits them again when it saves)."""
    import os
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}


def tiny_moe_models(scale=1.0):
    """family -> (transformers model, ModelConfig, logical Megatron weights) for each mixture-of-experts family
    (`MOE_CONFIGS`; `scale` multiplies the 2-D weights: 4 gives greedy decoding clear winners)."""
    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    out = {}
    for family in MOE_CONFIGS:
        hf = tiny_family_model(family, scale=scale)
        cfg = model_config_from_hf(hf.config, name=family)
        out[family] = hf, cfg, hf_to_megatron(file_state_dict(hf), cfg)
    return out


def tiny_family_model(family, *, vocab_size=300, num_layers=2, seed=0, scale=1.0, max_positions=512, **overrides):
    """A random transformers model of `family` (hidden 64, 4 heads / 2 KV heads, ffn 176) whose norms, biases and
    q/k norms are perturbed away from their initial values (so each one matters), 2-D weights times `scale`."""
    config_cls, model_cls, extra = {**FAMILY_CONFIGS, **MOE_CONFIGS}[family]
    cfg = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        **{**extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(scale)
            elif "norm" in n or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_chat_word_tokenizer(d):
    """A word-level HF tokenizer shaped like Qwen's: no BOS, `<|im_end|>` as EOS, a ChatML chat template (which
    travels as the tokenizer's own), saved into `d`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + "user assistant how many is of if he she has".split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>",
                                                additional_special_tokens=["<|im_start|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(d)
    return fast
