"""What the generator executor is told: the `generator` section (its layout, weights, batch, precision) and the
`rollout` section (what a batch of rollouts is, how it is sampled, and how far the generator may run ahead of the
trainer). Imports nothing heavy, so that a configuration is checked without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.settings import Section, ranged


# Positions per block of a paged KV cache (`generator.kv_cache_tokens`): what the generator allocates and the
# planner counts.
KV_BLOCK_SIZE = 16


@dataclass
class GeneratorSettings(Section):
    """The `generator` section. `push_check_interval`: every N-th weight push is checked end to end
    (ddma/fingerprint.py); 0: never; "auto": push 0, then as often as keeps the checks under 1% of the pushes'
    time, measured."""

    SECTION: ClassVar[str] = "generator"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    # Expert parallelism of a mixture-of-experts model, within each TP group (`layout`).
    ep: int = ranged(1, ">= 1", "(each layer's experts split over ep of a replica's TP ranks)")
    colocated: bool = False
    quantization: Literal["none", "int8", "fp8"] = "none"
    push_check_interval: Union[int, Literal["auto"]] = ranged("auto", ">= 0", "(0 never checks a weight push)")
    max_batch_size: int = ranged(64, ">= 1", "(sequences decoded together)")
    # A paged KV cache of this many tokens in all (`inference/paging.py`): memory follows the tokens sequences hold,
    # so max_batch_size can exceed what slots of the longest sequence would fit. 0: a slot cache.
    kv_cache_tokens: int = ranged(0, ">= 0", "(0: a slot cache, each slot the longest sequence)")
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"

    @property
    def layout(self) -> ParallelLayout:
        """TP x PP x DP, with a mixture-of-experts model's experts split over `ep` ranks of each TP group and each
        expert over the tp / ep others (`ParallelLayout.etp`): every replica holds all the experts, so DP replicas
        decode different requests independently (no expert all-to-all between them). An `ep` that does not divide
        `tp` (which `rules` refuses) gives no expert parallelism here."""
        if self.ep > 1 and self.tp % self.ep == 0:
            return ParallelLayout(self.tp, self.pp, self.dp, ep=self.ep, etp=self.tp // self.ep)
        return ParallelLayout(self.tp, self.pp, self.dp)

    @property
    def model_attention(self) -> str:
        """The attention the generator's model is built with (by the job's executor and by `megatron-rl plan`):
        `attention`, except that "auto" is "sdpa" for a quantized generator, whose 8-bit layers are Megatron-Core's
        own linears, not transformer-engine's."""
        if self.quantization != "none" and self.attention == "auto":
            return "sdpa"
        return self.attention

    def rules(self, path: str) -> list[str]:
        out = []
        if self.quantization != "none" and self.attention == "te":
            out.append(f"{path}.quantization={self.quantization!r} needs Megatron-Core's own linear layers: set "
                       f"{path}.attention to 'sdpa' or 'local' (not 'te')")
        if self.ep > 1 and self.tp % self.ep:
            out.append(f"{path}.ep={self.ep} must divide {path}.tp={self.tp} (a generator keeps each layer's experts "
                       f"within its TP group, so its DP replicas decode independently)")
        if self.kv_cache_tokens and self.pp > 1:
            out.append(f"{path}.kv_cache_tokens={self.kv_cache_tokens}: a paged KV cache needs {path}.pp=1 (the "
                       f"pipeline's lanes split a slot cache)")
        return out



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
    # The generator as a live engine (`inference/live.py`): the next batch's prompts (or episodes) take the slots the
    # current batch's finished sequences free, and pushed weights land under running sequences, which keep their caches;
    # `staleness` then bounds each sample's oldest token (`schedule_staleness`). `recompute_cache`: recompute the
    # running sequences' caches under the new weights at every push (one prefill of each), so that every token's
    # log-prob is exactly its version's (without it, only at the push after a checkpoint: `Engine.switch`).
    in_flight: bool = False
    recompute_cache: bool = False

    @property
    def context_length(self) -> int:
        """The longest sequence a generator holds: a prompt cut to `max_prompt_length` plus `max_new_tokens` (its
        KV cache's length; the model's `max_position_embeddings` must cover it)."""
        return self.max_prompt_length + self.max_new_tokens

    def replica_prompts(self, replica: int, replicas: int) -> list[int]:
        """Which of a step's `prompts_per_step` prompts generator replica `replica` of `replicas` samples: every
        `replicas`-th, from its own index, so replica 0 holds the most (`samples_per_replica`)."""
        return list(range(self.prompts_per_step))[replica::replicas]

    def samples_per_replica(self, replicas: int) -> int:
        """The most samples a generator replica draws in one step (replica 0's): what its KV-cache slots hold."""
        return len(self.replica_prompts(0, replicas)) * self.samples_per_prompt

    @property
    def effective_staleness(self) -> int:
        """How many weight versions the generator may run ahead of the trainer, as the job runs it: `staleness` in
        async mode, 0 in sync mode, whatever `staleness` is set to there (the setting counts only when async). The
        job (its schedule, the batches a checkpoint keeps, its banner and summary) reads this, never `staleness`."""
        return self.staleness if self.mode == "async" else 0

    @property
    def schedule_staleness(self) -> int:
        """The versions a batch's generation starts behind the trainer (`controller/schedule.py`): with `in_flight`,
        one less than `effective_staleness`, because each batch's first sequences start while the batch before it
        drains, one version earlier; so no token of a sample is more than `effective_staleness` versions old."""
        return self.effective_staleness - 1 if self.in_flight else self.effective_staleness

    def rules(self, path: str) -> list[str]:
        out = []
        if self.in_flight and self.effective_staleness < 1:
            out.append(f"{path}.in_flight=true starts each batch under the weights before its own, one version older: "
                       f"it needs {path}.mode=async with {path}.staleness >= 1 (the bound on a sample's oldest token)")
        if self.recompute_cache and not self.in_flight:
            out.append(f"{path}.recompute_cache=true recomputes caches at weight pushes under running sequences: it "
                       f"needs {path}.in_flight=true")
        return out
