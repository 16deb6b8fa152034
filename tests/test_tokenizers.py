"""Tokenizers: byte, sentencepiece (trained here), Hugging Face (built here), and the GGUF one of SmolLM2."""

import copy

import pytest

from megatron_rl.tokenizers import ByteTokenizer, load_tokenizer, tokenizer_kind


def test_byte_tokenizer_round_trip_and_specials():
    t = load_tokenizer("byte")
    assert isinstance(t, ByteTokenizer) and t.vocab_size == 259
    ids = t.encode("12+30=é", add_bos=True)
    assert ids[0] == t.bos_id and len(ids) == 1 + len("12+30=é".encode())
    assert t.decode(ids + [t.eos_id]) == "12+30=é"
    assert t.decode([t.eos_id], skip_special_tokens=False) == "<eos>"
    assert t.stop_ids == {t.eos_id} and t.pad_id not in (t.bos_id, t.eos_id)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    text = d / "corpus.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(d / "tok"), vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, pad_id=0, unk_id=3)
    return d / "tok.model"


def test_sentencepiece(spm_model):
    t = load_tokenizer(spm_model)
    assert t.vocab_size == 60 and (t.bos_id, t.eos_id, t.pad_id) == (1, 2, 0)
    ids = t.encode("the lazy dog", add_bos=True)
    assert ids[0] == 1 and t.decode(ids) == "the lazy dog"
    chat = t.apply_chat_template([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}])
    assert chat == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"
    d = spm_model.parent
    (d / "tokenizer.model").write_bytes(spm_model.read_bytes())
    assert load_tokenizer(d).vocab_size == 60
    assert tokenizer_kind(spm_model) == tokenizer_kind(d) == "sentencepiece" and tokenizer_kind("byte") == "byte"


def test_hugging_face_directory(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([f"question {i}: what is {i} plus {i}?" for i in range(200)],
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>", "<|eot_id|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eot_id|>{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(tmp_path)
    t = load_tokenizer(tmp_path)
    assert tokenizer_kind(tmp_path) == "hf"
    assert t.eos_id == fast.eos_token_id and t.bos_id == fast.bos_token_id
    assert t.stop_ids == {fast.eos_token_id, fast.convert_tokens_to_ids("<|eot_id|>")}
    ids = t.encode("what is 3 plus 3?", add_bos=True)
    assert ids[0] == t.bos_id and t.decode(ids) == "what is 3 plus 3?"
    texts = ["what is 3 plus 3?", "", "question 7: what is 70 plus 1?", "<s>question"]
    for add_bos in (False, True):  # the batch path gives what one `encode` per text gives
        assert t.encode_batch(texts, add_bos=add_bos) == [t.encode(x, add_bos=add_bos) for x in texts]
    assert t.encode_batch([]) == []
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<|eot_id|><assistant>"
    assert t.has_chat_template and not load_tokenizer("byte").has_chat_template
    fast.chat_template = None
    fast.save_pretrained(tmp_path / "plain")
    assert not load_tokenizer(tmp_path / "plain").has_chat_template


def test_gguf_tokenizer_of_smollm2(smollm2_tokenizer):
    t = smollm2_tokenizer  # load_tokenizer(gguf_path()), read once per session
    assert t.vocab_size == 49152
    assert [t.decode([i], skip_special_tokens=False) for i in (t.bos_id, t.eos_id, t.pad_id)] == [
        "<|im_start|>", "<|im_end|>", "<|im_end|>"]  # SmolLM2-Instruct's model card; the file says the same
    assert t.decode(t.encode("Natalia sold 48 clips.")) == "Natalia sold 48 clips."
    chat = t.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
    assert chat.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_gguf_tokenizer_takes_its_special_tokens_from_the_file(smollm2_tokenizer):
    """transformers 5.17 reads SmolLM2-Instruct's EOS from the GGUF as `<|im_start|>` and leaves PAD unset (seen on
    the H200 image, 2026-11-27); the file's ids win, whatever transformers made of them."""
    from megatron_rl.models.smollm2 import gguf_path
    from megatron_rl.tokenizers.hf import take_gguf_special_tokens

    misread = copy.deepcopy(smollm2_tokenizer.tok)
    misread.eos_token, misread.pad_token = "<|im_start|>", None  # what 5.17 made of it
    take_gguf_special_tokens(misread, gguf_path())
    assert (misread.bos_token, misread.eos_token, misread.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (misread.bos_token_id, misread.eos_token_id, misread.pad_token_id) == (1, 2, 2)


def test_unknown_tokenizer_path(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "nothing")
    assert tokenizer_kind(tmp_path / "nothing") is None and tokenizer_kind(tmp_path) is None
