"""What the generator executor is told: the `generator` section (its layout, weights, batch, precision) and the
`rollout` section (what a batch of rollouts is, how it is sampled, and how far the generator may run ahead of the
trainer). Imports nothing heavy, so that a configuration is checked without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.settings import Section, ranged


@dataclass
class GeneratorSettings(Section):
    """The `generator` section. `push_check_interval`: every N-th weight push is checked end to end
    (ddma/fingerprint.py); 0: never; "auto": push 0, then as often as keeps the checks under 1% of the pushes'
    time, measured."""

    SECTION: ClassVar[str] = "generator"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    colocated: bool = False
    quantization: Literal["none", "int8", "fp8"] = "none"
    push_check_interval: Union[int, Literal["auto"]] = ranged("auto", ">= 0", "(0 never checks a weight push)")
    max_batch_size: int = ranged(64, ">= 1", "(sequences decoded together)")
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.dp)

    def rules(self, path: str) -> list[str]:
        if self.quantization != "none" and self.attention == "te":
            return [f"{path}.quantization={self.quantization!r} needs Megatron-Core's own linear layers: set "
                    f"{path}.attention to 'sdpa' or 'local' (not 'te')"]
        return []


@dataclass
class RolloutSettings(Section):
    """The `rollout` section: `prompts_per_step` prompts of `samples_per_prompt` samples each per step, sampled at
    `temperature` / `top_p` / `top_k`; "async" lets the generator run up to `staleness` weight versions ahead."""

    SECTION: ClassVar[str] = "rollout"
    mode: Literal["async", "sync"] = "async"
    staleness: int = ranged(1, ">= 0")
    prompts_per_step: int = ranged(16, ">= 1")
    samples_per_prompt: int = ranged(4, ">= 1")
    max_prompt_length: int = ranged(48, ">= 1")
    max_new_tokens: int = ranged(16, ">= 1")
    temperature: float = ranged(1.0, "> 0", "(use top_k=1 for greedy)")
    top_p: float = ranged(1.0, "in (0, 1]")
    top_k: int = ranged(0, ">= 0", "(0 disables it)")

    @property
    def lag(self) -> int:
        """How many weight versions the generator may run ahead: `staleness` when async, 0 when sync."""
        return self.staleness if self.mode == "async" else 0
