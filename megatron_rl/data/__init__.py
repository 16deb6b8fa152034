"""Prompt data: records, JSONL datasets with a field mapping, GSM8K and MATH-500 loaders, chat prompts, synthetic
arithmetic with a curriculum, and a resumable sharded sampler."""

from megatron_rl.data.chat import (GSM8K_INSTRUCTION, INSTRUCTIONS, MATH_INSTRUCTION, PLAIN_INSTRUCTION,
                                   ChatPromptBuilder)
from megatron_rl.data.datasets import (default_data_dir, gsm8k_final_answer, load_gsm8k, load_math500,
                                       load_prompt_dataset)
from megatron_rl.data.jsonl import JsonlPromptDataset
from megatron_rl.data.records import DataError, Message, PromptRecord
from megatron_rl.data.sampler import PromptIterator, ResumableSampler
from megatron_rl.data.synthetic import ArithmeticTask, LinearCurriculum, arithmetic_task_from_name, evaluate

__all__ = [
    "ArithmeticTask", "ChatPromptBuilder", "DataError", "GSM8K_INSTRUCTION", "INSTRUCTIONS", "JsonlPromptDataset",
    "LinearCurriculum", "MATH_INSTRUCTION", "Message", "PLAIN_INSTRUCTION", "PromptIterator", "PromptRecord",
    "ResumableSampler", "arithmetic_task_from_name", "default_data_dir", "evaluate", "gsm8k_final_answer",
    "load_gsm8k", "load_math500", "load_prompt_dataset",
]
