"""The unit every prompt source produces: one prompt with its reference answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class DataError(ValueError):
    """Bad data: the message names the file and line (or the record) and what is wrong with it."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt for rollouts.

    prompt: the problem text (a chat template and instruction are applied later, by the chat-prompt builder, so
        one dataset serves any model) or a ready list of chat messages.
    reference: what the reward function compares against (for GSM8K the bare number, for MATH the LaTeX answer);
        None for reward functions that need none.
    metadata: anything else worth keeping (full solution, subject, level, source line).
    """

    id: str
    prompt: Union[str, list[Message]]
    reference: Optional[str] = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.prompt, str):
            return
        check_messages(self.prompt, where=f"record {self.id!r}")

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def as_dict(self) -> dict:
        """Every field of the record, as a reward function or an environment gets it: the metadata's fields (a
        JSONL record's other fields, such as test cases), then id, prompt and reference."""
        return {**self.metadata, "id": self.id, "prompt": self.prompt, "reference": self.reference}


def check_messages(messages: Any, where: str) -> None:
    """Raise DataError unless `messages` is a non-empty list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: the prompt must be a string or a non-empty list of chat messages")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: chat message {k} must be a dict with string 'role' and 'content', "
                            f"got {m!r:.100}")
