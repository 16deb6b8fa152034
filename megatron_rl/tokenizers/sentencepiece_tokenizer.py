"""Sentencepiece models (Llama 2 style `tokenizer.model`), with Llama 2's chat format."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.tokenizers.base import Message, Tokenizer


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        self.path = str(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=self.path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> Optional[int]:
        i = self.sp.bos_id()
        return i if i >= 0 else None

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def pad_id(self) -> int:
        i = self.sp.pad_id()
        return i if i >= 0 else self.eos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = {self.bos_id, self.eos_id, self.sp.pad_id()}
            ids = [i for i in ids if i not in special]
        return self.sp.decode(ids)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: Optional[list] = None) -> str:
        """Llama 2 chat: [INST] <<SYS>>system<</SYS>> user [/INST] assistant (BOS is added by encode)."""
        system = ""
        out = []
        pending_user = None
        for m in messages:
            role, content = m["role"], m["content"].strip()
            if role == "system":
                system = f"<<SYS>>\n{content}\n<</SYS>>\n\n"
            elif role == "user":
                pending_user = f"[INST] {system}{content} [/INST]"
                system = ""
            elif role == "assistant":
                out.append(f"{pending_user or ''} {content} ")
                pending_user = None
            else:
                raise ValueError(f"unknown chat role {role!r}")
        if pending_user is not None:
            out.append(pending_user)
        return "".join(out)
