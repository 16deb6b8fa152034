"""Prompt data: the registry of dataset names, records, JSONL datasets with a field mapping, GSM8K and MATH-500
loaders, and chat prompts, and a resumable sharded sampler. (The built-in synthetic
task lives with the job's other tasks, in `controller/tasks.py`.)"""

from megatron_rl.data.chat import (GSM8K_INSTRUCTION, INSTRUCTIONS, MATH_INSTRUCTION, PLAIN_INSTRUCTION,
                                   ChatPromptBuilder)
from megatron_rl.data.datasets import (default_data_dir, gsm8k_final_answer, load_gsm8k, load_math500,
                                       load_prompt_dataset)
from megatron_rl.data.jsonl import JsonlPromptDataset
from megatron_rl.data.records import DataError, Message, PromptRecord
from megatron_rl.data.registry import DatasetSpec, UnknownDatasetError, resolve_dataset
from megatron_rl.data.sampler import ResumableSampler

__all__ = [
    "ChatPromptBuilder", "DataError", "DatasetSpec", "GSM8K_INSTRUCTION", "INSTRUCTIONS",
    "JsonlPromptDataset", "MATH_INSTRUCTION", "Message", "PLAIN_INSTRUCTION",
    "PromptRecord", "ResumableSampler", "UnknownDatasetError", "default_data_dir", "gsm8k_final_answer",
    "load_gsm8k", "load_math500", "load_prompt_dataset", "resolve_dataset",
]
