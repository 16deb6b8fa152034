"""From a PromptRecord to the prompt text a model sees: an instruction around the problem, then the chat template.

Datasets store bare problems; how to ask for the answer depends on the verifier (GSM8K wants `#### n`, MATH wants
`\\boxed{}`) and the template depends on the model, so both are applied here, at rollout time.

Templates mark the problem with the literal `{question}` (plain substitution, not str.format, so LaTeX braces such
as `\\boxed{}` need no escaping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from megatron_rl.data.records import Message, PromptRecord

PLACEHOLDER = "{question}"

GSM8K_INSTRUCTION = ("Solve the following math problem step by step. Write the final answer as a number on the "
                     "last line, after ####.\n\n{question}")
MATH_INSTRUCTION = ("Solve the following math problem step by step. Put the final answer in \\boxed{}.\n\n"
                    "{question}")
NUMBER_INSTRUCTION = "{question} Answer with a single number."
PLAIN_INSTRUCTION = "{question}"

INSTRUCTIONS = {"gsm8k": GSM8K_INSTRUCTION, "math": MATH_INSTRUCTION, "number": NUMBER_INSTRUCTION,
                "plain": PLAIN_INSTRUCTION}


@dataclass(frozen=True)
class ChatPromptBuilder:
    """instruction: a template containing `{question}`; system: an optional system message.

    The tokenizer is any object with `apply_chat_template(messages, add_generation_prompt=True) -> str` (see
    `megatron_rl.tokenizers.base.Tokenizer`); with tokenizer=None the filled-in instruction is returned as is,
    which is what base models and the byte-level tiny model take.
    """

    instruction: str = PLAIN_INSTRUCTION
    system: Optional[str] = None

    def __post_init__(self):
        if PLACEHOLDER not in self.instruction:
            raise ValueError(f"the instruction template must contain {PLACEHOLDER!r} where the problem goes; "
                             f"got {self.instruction!r:.80}")

    @classmethod
    def for_task(cls, task: str, system: Optional[str] = None) -> "ChatPromptBuilder":
        """The builder with the instruction our verifier for `task` ("gsm8k", "math", "plain") expects."""
        if task not in INSTRUCTIONS:
            raise ValueError(f"no instruction for task {task!r}; expected one of {', '.join(map(repr, INSTRUCTIONS))}")
        return cls(INSTRUCTIONS[task], system)

    def text(self, question: str) -> str:
        return self.instruction.replace(PLACEHOLDER, question)

    def messages(self, item: Union[PromptRecord, str]) -> list[Message]:
        """The conversation for a record. A record that already holds chat messages is used as it is (plus the
        system message if it has none): its author chose the wording."""
        prompt = item.prompt if isinstance(item, PromptRecord) else item
        if isinstance(prompt, str):
            out = [{"role": "user", "content": self.text(prompt)}]
        else:
            out = [dict(m) for m in prompt]
        if self.system is not None and out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": self.system})
        return out

    def build(self, item: Union[PromptRecord, str], tokenizer: Any = None) -> str:
        """The prompt text: the chat template applied with a generation prompt, or plain text without a tokenizer."""
        if tokenizer is None:
            prompt = item.prompt if isinstance(item, PromptRecord) else item
            if not isinstance(prompt, str):
                raise ValueError("a chat-message prompt needs a tokenizer with apply_chat_template")
            text = self.text(prompt)
            return text if self.system is None else f"{self.system}\n\n{text}"
        return tokenizer.apply_chat_template(self.messages(item), add_generation_prompt=True)
