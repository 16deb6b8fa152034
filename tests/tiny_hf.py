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
