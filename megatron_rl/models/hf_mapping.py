"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral <-> Megatron-Core GPTModel: configs and logical (TP=1, PP=1)
state dicts.

Megatron's `linear_qkv` interleaves per KV group: rows [q (heads/groups x d), k (d), v (d)] for each group, and
its bias (Qwen2's q/k/v biases) the same way; `linear_fc1` is [gate; up]; Qwen3's per-head `q_norm` / `k_norm` are
Megatron's `q_layernorm` / `k_layernorm` as they are. Both directions are exact permutations and concatenations
(bit for bit).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from megatron_rl.models.families import family
from megatron_rl.models.presets import ModelConfig


def model_config_from_hf(hf: Any, name: str = "hf") -> ModelConfig:
    """ModelConfig from a transformers Llama/Qwen2/Qwen3/MistralConfig (or any object with its attributes)."""
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
    )


def _qkv_from_hf(q, k, v, cfg: ModelConfig) -> torch.Tensor:
    """Interleave q/k/v weights [rows, hidden] or biases [rows] per KV group."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    q = q.view(g, per * d, *rest)
    k = k.view(g, d, *rest)
    v = v.view(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv, cfg: ModelConfig):
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    rest = tuple(qkv.shape[1:])
    x = qkv.view(g, (per + 2) * d, *rest)
    q, k, v = x.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# Per-tensor mapping (used by the streaming converter): each Megatron tensor comes from one or more HF tensors.
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LAYER_HF = {  # Megatron layer parameter -> the HF layer tensors it is made of, in order (every family)
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_QKV_BIAS_HF = {"self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias")}
_QK_NORM_HF = {"self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
               "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",)}
_ANY_LAYER_HF = {**LAYER_HF, **_QKV_BIAS_HF, **_QK_NORM_HF}
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_GLOBAL_HF = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
              "decoder.final_layernorm.weight": "model.norm.weight",
              "output_layer.weight": "lm_head.weight"}


def layer_hf(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Megatron layer parameter -> its HF layer tensors, for this model's family."""
    return {**LAYER_HF, **(_QKV_BIAS_HF if cfg.add_qkv_bias else {}), **(_QK_NORM_HF if cfg.qk_layernorm else {})}


def megatron_names(cfg: ModelConfig) -> list[str]:
    """Logical Megatron tensor names (TP=1, PP=1, global layer index), in model order."""
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in layer_hf(cfg)]
    names.append("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names(name: str) -> tuple[str, ...]:
    """The HF tensors one logical Megatron tensor is made of (any family's)."""
    if name in _GLOBAL_HF:
        return (_GLOBAL_HF[name],)
    m = _LAYER.match(name)
    if m and m.group(2) in _ANY_LAYER_HF:
        return tuple(f"model.layers.{m.group(1)}.{s}" for s in _ANY_LAYER_HF[m.group(2)])
    raise KeyError(f"no Hugging Face counterpart for Megatron tensor {name!r}")


def to_megatron_tensor(name: str, tensors: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """One logical Megatron tensor from its HF tensors (in the order of `hf_names(name)`)."""
    if name.endswith(_QKV):
        return _qkv_from_hf(*tensors, cfg)
    if name.endswith("mlp.linear_fc1.weight"):
        return torch.cat(tensors)
    (t,) = tensors
    return t


def hf_row_blocks(name: str, cfg: ModelConfig) -> list[tuple[int, str, int, int]]:
    """Where the rows of one logical Megatron tensor come from: (first row, HF tensor, rows, first HF row) blocks,
    so a rank can read just the rows (and columns) of its shard from the HF files."""
    names = hf_names(name)
    if name.endswith(_QKV):
        g, d = cfg.num_query_groups, cfg.kv_channels
        per = cfg.num_attention_heads // g
        q, k, v = names
        out = []
        for i in range(g):
            base = i * (per + 2) * d
            out += [(base, q, per * d, i * per * d), (base + per * d, k, d, i * d), (base + (per + 1) * d, v, d, i * d)]
        return out
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = names
        f = cfg.ffn_hidden_size
        return [(0, gate, f, 0), (f, up, f, 0)]
    (only,) = names
    # The others are one HF tensor each: [hidden, ...] (norms, linear_proj, linear_fc2), [head size] (q/k norms)
    # or [vocab, hidden].
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = cfg.vocab_size
    else:
        rows = cfg.kv_channels if name.endswith(tuple(_QK_NORM_HF)) else cfg.hidden_size
    return [(0, only, rows, 0)]


def to_hf_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one logical Megatron tensor (views where the layout allows, copies for q/k/v)."""
    names = hf_names(name)
    if name.endswith(_QKV):
        parts = _qkv_to_hf(t, cfg)
    elif name.endswith("mlp.linear_fc1.weight"):
        parts = t.chunk(2)
    else:
        parts = (t,)
    return list(zip(names, parts))


def hf_shapes(cfg: ModelConfig, lm_head: Optional[bool] = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF tensors of this model, in model order (`lm_head` defaults to untied)."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f)}
    if cfg.add_qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_layernorm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    out["model.norm.weight"] = (h,)
    if (not cfg.tie_word_embeddings) if lm_head is None else lm_head:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF *ForCausalLM state dict -> logical Megatron GPTModel state dict (global layer names)."""
    sd = dict(sd)
    if not cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    return {n: to_megatron_tensor(n, [sd[k] for k in hf_names(n)], cfg) for n in megatron_names(cfg)}


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical Megatron GPTModel state dict -> HF *ForCausalLM state dict (`lm_head.weight` included)."""
    out = {}
    for n in megatron_names(cfg):
        out.update(to_hf_tensors(n, sd[n], cfg))
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["embedding.word_embeddings.weight"]
    return out
