"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral <-> Megatron-Core GPTModel: configs and
logical (TP=1, PP=1) state dicts (HF's names as its files hold them: one tensor per expert).

Which HF tensors each Megatron tensor is made of, and how their rows are stacked, is `param_spec`'s table:
`linear_qkv` interleaves per KV group [q (heads/groups x d), k (d), v (d)], and its bias (Qwen2's q/k/v biases) the
same way; `linear_fc1` is [gate; up]; the rest (Qwen3's per-head q/k norms among them) are one HF tensor as it is.
Both directions are exact permutations and concatenations (bit for bit).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.models.families import family
from megatron_rl.models.param_spec import ParamSpec, find_param, model_params
from megatron_rl.models.presets import ModelConfig


def model_config_from_hf(hf: Any, name: str = "hf") -> ModelConfig:
    """ModelConfig from a transformers config of one of `families.FAMILIES` (or any object with its attributes)."""
    fam = family(getattr(hf, "model_type", "llama"))
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} (supported: none, llama3)")
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in expected.items():
            if float(rope.get(k, v)) != v:
                raise ValueError(f"Megatron-Core's Llama 3 RoPE scaling fixes {k}={v}, the checkpoint has {rope[k]}")
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return ModelConfig(
        name=name,
        family=fam.model_type,
        head_dim=getattr(hf, "head_dim", None),
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rotary_base=float(theta),
        rope_scaling=rope_type == "llama3",
        rope_scaling_factor=float(rope.get("factor", 8.0)),
        norm_epsilon=hf.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        init_method_std=getattr(hf, "initializer_range", 0.02),
        **_experts_from_hf(hf, fam),
    )


def _experts_from_hf(hf: Any, fam) -> dict:
    """ModelConfig's mixture-of-experts fields from a Qwen3-MoE or Mixtral config (none for a dense family)."""
    if fam.experts is None:
        return {}
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    return dict(num_moe_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=hf.num_experts_per_tok,
                moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", True))


def _from_hf(p: ParamSpec, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack HF tensors' rows in `p`'s pattern (one tensor: itself)."""
    if len(p.hf) == 1:
        (t,) = tensors
        return t
    rest = tuple(tensors[0].shape[1:])
    blocks = [t.reshape(p.groups, rows, *rest) for t, rows in zip(tensors, p.pieces, strict=True)]
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def _to_hf(p: ParamSpec, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of `_from_hf`: views where the rows are contiguous (one group), copies otherwise (q/k/v)."""
    if len(p.hf) == 1:
        return (t,)
    rest = tuple(t.shape[1:])
    return tuple(x.reshape(-1, *rest) for x in t.reshape(p.groups, -1, *rest).split(p.pieces, dim=1))


def megatron_names(cfg: ModelConfig) -> list[str]:
    """Logical Megatron tensor names (TP=1, PP=1, global layer index), in model order."""
    return [p.name for p in model_params(cfg)]


def hf_row_blocks(name: str, cfg: ModelConfig) -> list[tuple[int, str, int, int]]:
    """Where the rows of one logical Megatron tensor come from: (first row, HF tensor, rows, first HF row) blocks,
    so a rank can read just the rows (and columns) of its shard from the HF files."""
    return find_param(name, cfg).hf_row_blocks()


def to_hf_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one logical Megatron tensor (views where the layout allows, copies for q/k/v)."""
    p = find_param(name, cfg)
    return list(zip(p.hf, _to_hf(p, t)))


def hf_shapes(cfg: ModelConfig, lm_head: Optional[bool] = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF tensors of this model, in model order (`lm_head` defaults to untied)."""
    return {n: s for p in model_params(cfg, output_layer=lm_head) for n, s in zip(p.hf, p.hf_shapes())}


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF *ForCausalLM state dict -> logical Megatron GPTModel state dict (global layer names)."""
    sd = dict(sd)
    if not cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    return {p.name: _from_hf(p, [sd[k] for k in p.hf]) for p in model_params(cfg)}


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical Megatron GPTModel state dict -> HF *ForCausalLM state dict (`lm_head.weight` included)."""
    out = {}
    for p in model_params(cfg):
        out.update(zip(p.hf, _to_hf(p, sd[p.name])))
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["embedding.word_embeddings.weight"]
    return out
