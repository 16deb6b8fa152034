"""One tokenizer interface for sentencepiece models, Hugging Face tokenizers (GGUF included) and bytes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class Tokenizer(ABC):
    """Text <-> token ids, special tokens and chat formatting.

    `stop_ids` are the ids that end a response: EOS plus the chat format's end-of-turn token when it differs
    (e.g. Llama 3's <|eot_id|>).
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_id(self) -> Optional[int]: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int:
        return self.eos_id

    @property
    def stop_ids(self) -> set[int]:
        return {self.eos_id}

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries its model's own chat template (a Hugging Face tokenizer that has one): what
        `data.chat` and `eval --chat` default to. The fallback formats of `apply_chat_template` do not count."""
        return False

    @abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """`encode` of each text (a tokenizer with a batch path of its own overrides this)."""
        return [self.encode(t, add_bos) for t in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: Optional[list] = None) -> str:
        """The conversation as the model's chat format expects it (a plain fallback when it has none). `tools`
        (OpenAI function tools) are rendered only by a template that knows them (`tokenizers/turns.py` describes
        them in a system message otherwise)."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))
