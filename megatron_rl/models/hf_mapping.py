"""Hugging Face Llama <-> Megatron-Core GPTModel: configs and logical (TP=1, PP=1) state dicts.

Megatron's `linear_qkv` interleaves per KV group: rows [q (heads/groups x d), k (d), v (d)] for each group;
`linear_fc1` is [gate; up]. Both directions are exact permutations and concatenations (bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.models.presets import ModelConfig


def model_config_from_hf(hf: Any, name: str = "hf") -> ModelConfig:
    """ModelConfig from a transformers LlamaConfig (or any object with its attributes)."""
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
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    h = q.shape[-1]
    q = q.view(g, per * d, h)
    k = k.view(g, d, h)
    v = v.view(g, d, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def _qkv_to_hf(qkv, cfg: ModelConfig):
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    h = qkv.shape[-1]
    x = qkv.view(g, (per + 2) * d, h)
    q, k, v = x.split([per * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> logical Megatron GPTModel state dict (global layer names)."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv_from_hf(
            sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"],
            cfg)
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical Megatron GPTModel state dict -> HF LlamaForCausalLM state dict."""
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = sd["embedding.word_embeddings.weight" if cfg.tie_word_embeddings else "output_layer.weight"]
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        q, k, v = _qkv_to_hf(sd[m + "self_attention.linear_qkv.weight"], cfg)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"], out[p + "self_attn.v_proj.weight"] = q, k, v
        out[p + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
    return out
