"""The `data` section: which problems a job trains and is evaluated on, and how they are put to the model.

`problems()` checks the fields (a dataset the registry knows, a JSONL file named); `file_problems()` checks what
a rank would otherwise find minutes into the job: each file the job reads exists and its first record loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_rl.settings import Section, ranged


@dataclass
class DataSettings(Section):
    """dataset: "synthetic-arithmetic" (built in), "gsm8k", "math500" or "jsonl". GSM8K trains on `path` (default:
    the shared train split) and evaluates on `eval_path` (default: the shared test split); a single file (MATH-500,
    JSONL without eval_path) holds out its first `eval_size` records. `prompt_field`/`answer_field` map JSONL
    fields. `chat`: apply the tokenizer's chat template (default: when it has one). `system`: a system message.
    Held-out reward: `eval_samples` samples per held-out problem at the rollout temperature."""

    SECTION: ClassVar[str] = "data"
    dataset: str = "synthetic-arithmetic"
    path: Optional[str] = None
    eval_path: Optional[str] = None
    prompt_field: str = "question"
    answer_field: Optional[str] = "answer"
    eval_size: int = ranged(64, ">= 1")
    eval_samples: int = ranged(4, ">= 1")
    chat: Optional[bool] = None
    system: Optional[str] = None
    # The built-in tasks only: the share of the warm start's demonstrations that are right (the rest are off by one);
    # in the guessing game, the share of demonstrated guesses that use the answers so far.
    # The default imitates a careless demonstrator, which leaves RL something to learn beyond the demonstrations
    # (with perfect ones, RL only re-learns the supervised signal; see docs/benchmarks.md).
    demo_accuracy: float = ranged(0.3, "in [0, 1]")

    @property
    def key(self) -> Optional[str]:
        """The dataset's canonical name; None for the built-in synthetic task. Raises ValueError for an unknown
        name (`rules` reports it)."""
        from megatron_rl.data.registry import dataset_key

        return dataset_key(self.dataset)

    def rules(self, path: str) -> list[str]:
        out = []
        try:
            key = self.key
        except ValueError as e:
            out.append(str(e))
            key = None
        if key == "jsonl" and not self.path:
            out.append(f"{path}.dataset='jsonl' needs {path}.path (a JSONL file of prompts)")
        if not self.prompt_field:
            out.append(f"{path}.prompt_field must not be empty")
        if self.answer_field == "":
            out.append(f"{path}.answer_field must not be empty (null: the records have no reference answer)")
        return out

    def file_problems(self, path: str = "data") -> list[str]:
        """The files a dataset job reads exist and their first record loads (the job reads them the same way)."""
        from megatron_rl.data.datasets import DATA_DIR_ENV, dataset_files, default_data_dir, load_prompt_dataset
        from megatron_rl.data.records import DataError

        try:
            key = self.key
        except ValueError:
            return []  # `rules` names the dataset
        if key is None or (key == "jsonl" and not self.path):
            return []
        out = []
        train, heldout = dataset_files(key, self.path, self.eval_path)
        for name, given, file in (("path", self.path, train), ("eval_path", self.eval_path, heldout)):
            if file is None:
                continue
            where = f"{path}.{name}={given!r}" if given else (
                f"{path}.dataset={self.dataset!r} (its default file {file}; set {path}.{name}, or {DATA_DIR_ENV} to "
                f"the folder holding {file.relative_to(default_data_dir())})")
            if not file.exists():
                out.append(f"{where} does not exist")
            elif not file.is_file():
                out.append(f"{where} is not a file")
            else:
                try:
                    load_prompt_dataset(key, path=file, prompt_field=self.prompt_field,
                                        answer_field=self.answer_field, limit=1)
                except DataError as e:
                    out.append(f"{path}.{name}: {e}")
                except OSError as e:
                    out.append(f"{where} cannot be read ({e.strerror or e})")
        return out
