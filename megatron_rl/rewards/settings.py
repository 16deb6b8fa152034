"""The `reward` section: which verifier, user function or reward model scores the responses, and where a reward
model runs. Imports nothing heavy; the user's function is imported (to check it) only by `job_problems`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.rewards.kinds import RewardKind
from megatron_rl.settings import Section, ranged


@dataclass
class RewardExecutorSettings(Section):
    """Where the reward model runs. `dp` = 0: in each generator replica's leader process, on its device (small
    models). `dp` >= 1: on ranks of its own, after the trainer's and the generator's: `dp` replicas of `tp` ranks,
    each scoring the batches of every dp-th generator replica as they arrive."""

    SECTION: ClassVar[str] = "reward.executor"
    tp: int = ranged(1, ">= 1")
    dp: int = ranged(0, ">= 0", "(0: the reward model runs in the generator replicas' leaders)")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, 1, self.dp)


def _is_hf_dir(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


@dataclass
class RewardSettings(Section):
    """kind: the verifier (or "function", or "reward-model": the reward model's score alone). `model`: a Hugging Face
    sequence-classification directory (num_labels=1). With a verifier kind and `model` both set (the reward model on
    its own ranks), the reward is the verifier's plus `model_coef` times the model's score."""

    SECTION: ClassVar[str] = "reward"
    kind: RewardKind = "auto"
    function: Optional[str] = None
    model: Optional[str] = None
    model_coef: float = 1.0  # either sign
    timeout_s: float = ranged(5.0, "> 0")
    num_workers: int = ranged(1, ">= 1")
    executor: RewardExecutorSettings = field(default_factory=RewardExecutorSettings)

    @property
    def model_executor(self) -> bool:
        """Does the reward model run on ranks of its own?"""
        return self.model is not None and self.executor.dp >= 1

    def rules(self, path: str) -> list[str]:
        out, e = [], self.executor
        if e.dp >= 1 and not self.model:
            out.append(f"{path}.executor.dp={e.dp} places a reward model on ranks of its own, but {path}.model is not "
                       f"set")
        if self.model and self.kind != "reward-model" and e.dp == 0:
            out.append(f"{path}.model is set with {path}.kind={self.kind!r}: a verifier's reward plus a reward "
                       f"model's score needs the reward model on ranks of its own ({path}.executor.dp >= 1), or set "
                       f"{path}.kind='reward-model' for the model's score alone")
        if self.model_coef != 1.0 and not self.model_executor:
            out.append(f"{path}.model_coef={self.model_coef} weighs a reward model on ranks of its own; set "
                       f"{path}.model and {path}.executor.dp >= 1")
        if self.model and not _is_hf_dir(self.model):
            out.append(f"{path}.model={self.model!r} is not a Hugging Face model directory (no config.json)")
        elif self.model_executor and e.tp >= 1 and self.model:
            from megatron_rl.rewards.sequence_classifier import reward_model_config

            try:
                reward_model_config(self.model, e.tp)
            except ValueError as err:
                out.append(str(err))
        if self.kind == "reward-model" and not self.model:
            out.append(f"{path}.model must be set (a Hugging Face sequence-classification directory) when "
                       f"{path}.kind='reward-model'")
        if self.kind == "function" and not self.function:
            out.append(f"{path}.function must be set (module:function) when {path}.kind='function'")
        if self.function and self.kind != "function":
            out.append(f"{path}.function={self.function!r} is set but {path}.kind={self.kind!r}: set "
                       f"{path}.kind=function to use it")
        elif self.function and ":" not in self.function:
            out.append(f"{path}.function={self.function!r} must look like 'module:function'")
        return out

    def job_problems(self, dataset: Optional[str], generator_dp: int, import_function: bool,
                     path: str = "reward") -> list[str]:
        """Against the rest of the job: the dataset (`data.key`: None is the synthetic task, which has its own
        exact-match reward), the generator replicas a reward model serves, and (`import_function`) the user's
        function imported here, as each reward worker will, so that a bad spec is one line now."""
        out = []
        if self.executor.dp > generator_dp:
            out.append(f"{path}.executor.dp={self.executor.dp} is more than generator.dp={generator_dp}: each reward "
                       f"replica scores whole generator replicas, so {self.executor.dp - generator_dp} would never "
                       f"score; use at most {generator_dp}")
        if self.kind == "reward-model" and dataset is None:
            out.append(f"{path}.kind='reward-model': the built-in synthetic task has its own exact-match reward; use "
                       f"data.dataset='jsonl' with your prompts to train on a reward model")
        elif self.kind == "auto" and dataset is not None:
            from megatron_rl.rewards.registry import kind_for_dataset

            try:
                kind_for_dataset(dataset)
            except ValueError as e:
                out.append(str(e))
        elif (dataset is None and self.kind not in ("auto", "reward-model")
              and not (self.kind == "function" and not self.function)):
            out.append(f"{path}.kind={self.kind!r} does nothing here: the built-in synthetic task has its own "
                       f"exact-match reward (leave reward.kind 'auto'); use data.dataset='jsonl' with your prompts to "
                       f"train on another reward")
        if import_function and self.function and self.kind == "function" and ":" in self.function \
                and dataset is not None:
            out += _function_problems(self.function)
        return out


def _function_problems(spec: str) -> list[str]:
    """Import the user's reward function here, as each reward worker will."""
    from megatron_rl.sandbox import SpecError, resolve

    try:
        resolve(spec, "reward function")
    except SpecError as e:
        return [str(e)]
    return []
