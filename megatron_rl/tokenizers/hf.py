"""Hugging Face tokenizers: a model directory (Llama 3, SmolLM2, ...) or the tokenizer inside a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.tokenizers.base import Message, Tokenizer


class HFTokenizer(Tokenizer):
    def __init__(self, path: str | Path, gguf_file: Optional[str] = None):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("Hugging Face tokenizers need the 'hf' extra: pip install 'megatron-rl[hf]'") from e
        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, gguf_file=gguf_file)

    @classmethod
    def from_gguf(cls, gguf_path: str | Path) -> "HFTokenizer":
        p = Path(gguf_path)
        return cls(p.parent, gguf_file=p.name)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def bos_id(self) -> Optional[int]:
        return self.tok.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tok.eos_token_id

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    @property
    def stop_ids(self) -> set[int]:
        ids = {self.eos_id}
        for name in ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>"):
            i = self.tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i != self.tok.unk_token_id and i is not None and i >= 0:
                ids.add(i)
        return ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """One call for the whole batch (a fast tokenizer encodes it in Rust): GSM8K's 7,473 training prompts, which a
        job encodes at its start to drop those longer than `rollout.max_prompt_length`, 2.4x faster than one
        `encode` per prompt (SmolLM2's tokenizer, this project's 2-core CPU: 1.7 s -> 0.7 s)."""
        if not texts:
            return []
        out = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        if add_bos and self.bos_id is not None:
            out = [ids if ids and ids[0] == self.bos_id else [self.bos_id, *ids] for ids in out]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        if self.has_chat_template:
            return self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
        return super().apply_chat_template(messages, add_generation_prompt)
