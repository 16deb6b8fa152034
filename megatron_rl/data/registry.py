"""Every dataset a job (`data.dataset`) or `megatron-rl eval --dataset` can name, in one table.

A `DatasetSpec` says where a dataset's problems come from (files in the data directory, a JSONL file the user
passes, or generated in code), how a problem is put to the model (`instruction`) and which verifier scores the
answer when `reward.kind` is "auto" (`verifier`). Training (`controller.tasks`), evaluation (`evaluation.eval`), the
loaders (`data.datasets`) and the reward registry (`rewards.registry`) all read this table, and `resolve_dataset` is
the one place where a name or an alias is looked up.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional

from megatron_rl.data.chat import INSTRUCTIONS


@dataclass(frozen=True)
class DatasetSpec:
    """name: the canonical name; aliases: other names for it (all matched case-insensitively).
    title: how messages name it. verifier: the `reward.kind` that "auto" means for it (None: the dataset does not
    say, the user sets reward.kind). instruction: the key of `data.chat.INSTRUCTIONS` put around each problem (None:
    the prompt is shown as it is). train_file / eval_file: default files inside the data directory; a dataset with a
    train file and no eval file has one split, whose first `data.eval_size` problems are held out. generated:
    problems are made in code, no file is read."""

    name: str
    title: str
    verifier: Optional[str]
    instruction: Optional[str]
    aliases: tuple[str, ...] = ()
    train_file: Optional[str] = None
    eval_file: Optional[str] = None
    generated: bool = False
    env: Optional[str] = None
    demonstrations: bool = False

    def __post_init__(self):
        if self.instruction is not None and self.instruction not in INSTRUCTIONS:
            raise ValueError(f"dataset {self.name!r}: no instruction {self.instruction!r}")
        if self.generated and (self.train_file or self.eval_file):
            raise ValueError(f"dataset {self.name!r} is generated and cannot name files")

    @property
    def test_file(self) -> Optional[str]:
        """The file `megatron-rl eval` scores: the held-out split, or the only file there is."""
        return self.eval_file or self.train_file


SYNTHETIC = "synthetic-arithmetic"
GUESS = "guess-number"
CALCULATOR = "calculator"

DATASETS: dict[str, DatasetSpec] = {s.name: s for s in (
    # The built-in default ("a+b=", controller.tasks.AdditionTask): no files, byte tokenizer, exact match.
    DatasetSpec(SYNTHETIC, "synthetic arithmetic", verifier="synthetic", instruction=None,
                aliases=("synthetic", "arithmetic"), generated=True, demonstrations=True),
    DatasetSpec("gsm8k", "GSM8K", verifier="gsm8k", instruction="gsm8k", aliases=("gsm8k-test",),
                train_file="gsm8k/train.jsonl", eval_file="gsm8k/test.jsonl"),
    DatasetSpec("math500", "MATH-500", verifier="math", instruction="math", aliases=("math-500", "math"),
                train_file="math500/test.jsonl"),
    # Any JSONL file of prompts: the job's data.path, read with data.prompt_field / data.answer_field.
    DatasetSpec("jsonl", "JSONL prompts", verifier=None, instruction="plain"),
    # The answer is one number, checked as GSM8K's are (megatron_rl.data.word_problems).
    DatasetSpec("word-problems", "arithmetic word problems", verifier="gsm8k", instruction="number",
                generated=True),
    # A multi-turn task: find a hidden number from "higher"/"lower" replies (env.cls, environments/guess.py).
    DatasetSpec(GUESS, "guess the number", verifier=None, instruction=None, aliases=("guess",), generated=True,
                env="megatron_rl.environments.guess:GuessNumber", demonstrations=True),
    # A tool-use task: word problems of two or three changes with a calculator the model calls (env.cls,
    # environments/calculator.py).
    DatasetSpec(CALCULATOR, "word problems with a calculator", verifier=None, instruction=None,
                aliases=("calculator-problems",), generated=True, env="megatron_rl.environments.calculator:Calculator",
                demonstrations=True),
)}

_BY_NAME: dict[str, DatasetSpec] = {n: s for s in DATASETS.values() for n in (s.name, *s.aliases)}


class UnknownDatasetError(ValueError):
    """A dataset name the registry does not know (or that the caller does not accept); one line."""


def resolve_dataset(name: str, among: Optional[Iterable[str]] = None) -> DatasetSpec:
    """The dataset `name` (a canonical name or an alias, any case) means. `among`: the canonical names the caller
    accepts (default: all). Raises UnknownDatasetError listing the accepted names, with the closest one."""
    accepted = tuple(among) if among is not None else tuple(DATASETS)
    key = str(name).strip().lower()
    spec = _BY_NAME.get(key)
    if spec is not None and spec.name in accepted:
        return spec
    known = [n for n, s in _BY_NAME.items() if s.name in accepted]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {_BY_NAME[close[0]].name!r}?)" if close else ""
    raise UnknownDatasetError(f"unknown dataset {name!r}{hint}; expected one of {', '.join(accepted)}")


def dataset_key(name: str) -> Optional[str]:
    """The canonical name of a `data.dataset` value, or None for the built-in synthetic task (no files, no
    instruction, its own exact-match reward). Raises UnknownDatasetError for a name the registry does not know."""
    spec = resolve_dataset(name)
    return None if spec.name == SYNTHETIC else spec.name
