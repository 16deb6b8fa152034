"""GSM8K and MATH-500 loaders, and `load_prompt_dataset` that maps a `data.dataset` config name to a loader.

The files are not part of the package: tests and benchmarks read the shared copies at `<repo>/../shared/data/`,
users pass their own path. Records carry the *final answer* as the reference (GSM8K: the number after `#### `,
commas removed; MATH: the `answer` field), which is what the verifiers in `megatron_rl.rewards` compare against;
the full solution stays in the metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from megatron_rl.data.jsonl import JsonlPromptDataset
from megatron_rl.data.records import DataError
from megatron_rl.data.registry import DATASETS, resolve_dataset

PathLike = Union[str, Path]
DATA_DIR_ENV = "MEGATRON_RL_DATA_DIR"


def default_data_dir() -> Path:
    """The folder where datasets' default files are looked for (train jobs, validation and `eval` alike):
    $MEGATRON_RL_DATA_DIR when set (a cluster's data folder), else `<repo>/../shared/data`, found from this file's
    location (megatron_rl/data/ inside the repo)."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _resolve(path: Optional[PathLike], default_relative: str, what: str) -> Path:
    if path is not None:
        return Path(path)
    p = default_data_dir() / default_relative
    if not p.is_file():
        raise DataError(f"{what} not found at the default location {p}; pass path= to the loader or set "
                        f"{DATA_DIR_ENV}")
    return p


def dataset_files(name: str, path: Optional[PathLike] = None, eval_path: Optional[PathLike] = None
                  ) -> tuple[Optional[Path], Optional[Path]]:
    """The (train, held-out) files a job on dataset `name` reads: `path` and `eval_path` when given, else the
    dataset's files in the data directory (its held-out file only with its own train file). A held-out file of None:
    the train file's first records are held out; (None, None): a dataset generated in code."""
    spec = resolve_dataset(name)
    if spec.generated:
        return None, None
    root = default_data_dir()
    train = Path(path) if path else (root / spec.train_file if spec.train_file else None)
    heldout = Path(eval_path) if eval_path else (root / spec.eval_file if spec.eval_file and not path else None)
    return train, heldout


def gsm8k_final_answer(solution: str) -> str:
    """The reference from a GSM8K solution: the text after the last `#### `, commas removed (`1,600` -> `1600`)."""
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError("a GSM8K answer must end with '#### <number>'")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError("nothing after '####' in the GSM8K answer")
    return answer


def load_gsm8k(split: str = "test", path: Optional[PathLike] = None, limit: Optional[int] = None) -> JsonlPromptDataset:
    """GSM8K as PromptRecords: prompt = question, reference = final number, metadata["solution"] = full answer."""
    if path is None and split not in ("train", "test"):
        raise ValueError(f"GSM8K split {split!r} does not exist; expected 'train' or 'test'")
    spec = DATASETS["gsm8k"]
    file = _resolve(path, spec.train_file if split == "train" else spec.eval_file, f"GSM8K {split} split")
    return JsonlPromptDataset(file, prompt_field="question", answer_field="answer",
                              answer_transform=gsm8k_final_answer, raw_answer_key="solution",
                              name=f"gsm8k-{split}", limit=limit)


def load_math500(path: Optional[PathLike] = None, limit: Optional[int] = None) -> JsonlPromptDataset:
    """MATH-500 as PromptRecords: prompt = problem, reference = answer (LaTeX), id = unique_id; the solution,
    subject and level are in the metadata."""
    file = _resolve(path, DATASETS["math500"].test_file, "MATH-500")
    return JsonlPromptDataset(file, prompt_field="problem", answer_field="answer", id_field="unique_id",
                              name="math500", limit=limit)


def load_prompt_dataset(name: str, path: Optional[PathLike] = None, prompt_field: str = "question",
                        answer_field: Optional[str] = "answer", split: str = "test",
                        limit: Optional[int] = None) -> JsonlPromptDataset:
    """The dataset a config names (`data.registry`): "gsm8k", "math500" (shared files unless `path` is given), or
    "jsonl" (any file at `path`, read with `prompt_field`/`answer_field`). Generated datasets are not files."""
    spec = resolve_dataset(name)
    if spec.name == "gsm8k":
        return load_gsm8k(split=split, path=path, limit=limit)
    if spec.name == "math500":
        return load_math500(path=path, limit=limit)
    if spec.generated:
        raise ValueError(f"dataset {name!r} is a synthetic task generated in code, not a file")
    if path is None:
        raise ValueError(f"dataset {spec.name!r} needs a path")
    return JsonlPromptDataset(path, prompt_field=prompt_field, answer_field=answer_field, limit=limit)
