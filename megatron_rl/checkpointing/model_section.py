"""The `model` section: a preset by name plus any ModelConfig field as an override, or the initial weights of a
checkpoint whose recorded shape is then the model's; and the rules every model shape must meet."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_rl.models.families import FAMILIES
from megatron_rl.models.presets import ModelConfig, get_preset


@dataclass
class ModelSection:
    """A preset by name, plus any ModelConfig field as an override (`model.num_layers=2`); or the initial weights
    of a checkpoint (`model.checkpoint=PATH`), whose recorded shape is then the model's.

    checkpoint: a megatron-rl checkpoint (`megatron-rl convert --to megatron` output, or a training run's step or
        root); with the local launcher also a Hugging Face Llama, Qwen2/2.5, Qwen3 or Mistral directory, a Llama
        .gguf file or the name of a packaged
        model (`smollm2-135m-instruct`), converted once into the run directory before the job starts.
    tokenizer: "byte", a HF directory, a .gguf or a sentencepiece .model; default: the checkpoint's own tokenizer,
        or the byte tokenizer without a checkpoint.
    """

    preset: Optional[str] = None
    overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint: Optional[str] = None
    tokenizer: Optional[str] = None

    @property
    def name(self) -> str:
        if self.preset:
            return self.preset
        return Path(self.checkpoint).name if self.checkpoint else "tiny"

    def resolve(self) -> ModelConfig:
        if self.checkpoint is None:
            return get_preset(self.preset or "tiny", **self.overrides)
        from megatron_rl.checkpointing.initial import checkpoint_model_config

        model = checkpoint_model_config(self.checkpoint)
        if self.overrides:
            raise ValueError(f"model.{next(iter(self.overrides))} cannot be set with model.checkpoint (the "
                             f"checkpoint's shape is the model's)")
        if self.preset:
            want = dataclasses.asdict(get_preset(self.preset))
            have = dataclasses.asdict(model)
            diff = [k for k in want if k != "name" and want[k] != have.get(k)]
            if diff:
                raise ValueError(f"model.checkpoint={self.checkpoint!r} is not a {self.preset!r} model (differs in "
                                 f"{', '.join(diff)}); drop model.preset or use a matching checkpoint")
        return model

    def tokenizer_problems(self) -> list[str]:
        if self.tokenizer is not None and self.tokenizer != "byte" and not Path(self.tokenizer).exists():
            return [f"model.tokenizer={self.tokenizer!r} does not exist (expected 'byte', a sentencepiece .model "
                    f"file, a .gguf file or a Hugging Face tokenizer directory)"]
        return []


def divides(a_name: str, a: int, b_name: str, b: int) -> list[str]:
    """`a_name=a does not divide b_name=b` (or `must be >= 1`), or nothing."""
    if a <= 0:
        return [f"{a_name}={a} must be >= 1"]
    return [f"{a_name}={a} does not divide {b_name}={b}"] if b % a else []


def _expert_problems(model: ModelConfig) -> list[str]:
    """A mixture-of-experts family has experts (at least one, each of width >= 1, a top-k within their number); a
    dense family has none."""
    if FAMILIES[model.family].experts is None:
        return ([] if model.num_moe_experts is None else
                [f"model.num_moe_experts={model.num_moe_experts} needs a mixture-of-experts family (qwen3_moe, "
                 f"mixtral); model.family={model.family!r} is dense"])
    if model.num_moe_experts is None or model.num_moe_experts < 1:
        return [f"model.family={model.family!r} needs model.num_moe_experts >= 1, got {model.num_moe_experts}"]
    out = [] if model.moe_ffn_hidden_size >= 1 else [f"model.moe_ffn_hidden_size={model.moe_ffn_hidden_size} "
                                                     f"must be >= 1"]
    if not 1 <= model.moe_router_topk <= model.num_moe_experts:
        out.append(f"model.moe_router_topk={model.moe_router_topk} must be within 1..model.num_moe_experts="
                   f"{model.num_moe_experts}")
    return out


def model_problems(model: ModelConfig) -> list[str]:
    """The model's shape: a known family, positive sizes, heads that divide the hidden size (unless the head size
    is given), finite positive constants."""
    out = [] if model.family in FAMILIES else [f"model.family={model.family!r} is not one of {', '.join(FAMILIES)}"]
    out += [f"model.{f}={getattr(model, f)} must be >= 1"
            for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                      "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by") if getattr(model, f) < 1]
    out += [f"model.{f}={getattr(model, f)} must be a finite number > 0"
            for f in ("rotary_base", "rope_scaling_factor", "norm_epsilon", "init_method_std")
            if not (math.isfinite(getattr(model, f)) and getattr(model, f) > 0)]
    if model.head_dim is not None and model.head_dim < 1:
        out.append(f"model.head_dim={model.head_dim} must be >= 1 (or null: hidden_size / num_attention_heads)")
    if not out:
        out += _expert_problems(model)
    if out:
        return out
    heads = [] if model.head_dim else divides("model.num_attention_heads", model.num_attention_heads,
                                              "model.hidden_size", model.hidden_size)
    return heads + divides("model.num_query_groups", model.num_query_groups, "model.num_attention_heads",
                           model.num_attention_heads)
