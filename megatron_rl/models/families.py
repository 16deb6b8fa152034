"""The Hugging Face model families we convert, train and generate with, and what each is made of.

Every family is a pre-norm decoder with RMSNorm, RoPE, grouped-query attention and SwiGLU MLPs without biases;
they differ only in the few features this table names, each of which is a Megatron-Core option:

| family    | HF class            | QKV bias | q/k RMSNorm (`qk_layernorm`) | sliding window          | MLP     |
| --------- | ------------------- | -------- | ---------------------------- | ----------------------- | ------- |
| llama     | LlamaForCausalLM    | no       | no                           | none                    | dense   |
| qwen2     | Qwen2ForCausalLM    | yes      | no                           | if `use_sliding_window` | dense   |
| qwen3     | Qwen3ForCausalLM    | no       | yes (per head, before RoPE)  | if `use_sliding_window` | dense   |
| mistral   | MistralForCausalLM  | no       | no                           | if `sliding_window` set | dense   |
| qwen3_moe | Qwen3MoeForCausalLM | no       | yes (per head, before RoPE)  | if `use_sliding_window` | experts |
| mixtral   | MixtralForCausalLM  | no       | no                           | if `sliding_window` set | experts |

A mixture-of-experts layer (`num_moe_experts` SwiGLU experts of `moe_ffn_hidden_size`, a bias-free linear router
choosing `moe_router_topk` of them per token) is Megatron-Core's MoE layer. The router's weights are a softmax over
the chosen experts' logits (Mixtral; Qwen3-MoE's `norm_topk_prob=true`), which equals the top-k of the softmax
over all experts renormalized; Qwen3-MoE's `norm_topk_prob=false` keeps the top-k of the full softmax unnormalized
(Megatron-Core's `moe_router_pre_softmax`). Hugging Face files hold one tensor per expert (`ExpertNames`: the
layer's MoE prefix and the gate, up and down projections' names); transformers 5 fuses them in memory only.

A head size other than hidden/heads (`head_dim`, Qwen3's 128) is Megatron-Core's `kv_channels`. Anything else a
config.json may ask for is refused in one line naming the feature (`unsupported_feature`): sliding-window attention
that a sequence can actually reach (a window shorter than `max_position_embeddings`; with a window at least that
long, full attention computes the same thing), other mixture-of-experts designs (shared experts, multi-head latent
attention: `_MOE_TYPES`), dense layers between expert layers, a router with jitter noise, biases beyond the QKV
projection, an activation other than SiLU.

config.json is read without importing transformers (`hf_config_fields`: transformers' defaults for each family fill
the keys a file leaves out) and written back the same way (`hf_config_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# transformers' config defaults shared by every family, for keys a config.json leaves out.
_COMMON_DEFAULTS = {"num_key_value_heads": None, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
                    "rope_parameters": None, "hidden_act": "silu", "head_dim": None, "vocab_size": 32000,
                    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}


@dataclass(frozen=True)
class ExpertNames:
    """How a mixture-of-experts family names its layer's tensors in Hugging Face files: the router is
    `{prefix}.gate.weight` and expert j's projections `{prefix}.experts.{j}.{gate|up|down}.weight`."""

    prefix: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Family:
    """One Hugging Face model type as a Megatron-Core GPTModel: its features and its config.json conventions.

    sliding_window: when the config's `sliding_window` applies: "never" (the family has none), "always" (every
        layer, whenever it is set) or "use_sliding_window" (only with that flag, and only on the layers
        `layer_types` or `max_window_layers` mark).
    defaults: transformers' defaults for the config.json keys we read that differ from `_COMMON_DEFAULTS`.
    biases: config keys that add biases we do not map (refused when true).
    experts: the Hugging Face names of a mixture-of-experts family's layer (None: a dense family).
    """

    model_type: str
    architecture: str
    qkv_bias: bool
    qk_norm: bool
    sliding_window: str
    defaults: dict[str, Any] = field(default_factory=dict)
    biases: tuple[str, ...] = ()
    experts: Optional[ExpertNames] = None


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, sliding_window="never",
           defaults={"intermediate_size": 11008, "max_position_embeddings": 2048},
           biases=("attention_bias", "mlp_bias")),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, sliding_window="use_sliding_window",
           defaults={"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
                     "num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28}),
    Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, sliding_window="use_sliding_window",
           defaults={"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
                     "num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096,
                     "max_window_layers": 28},
           biases=("attention_bias",)),
    Family("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False, sliding_window="always",
           defaults={"intermediate_size": 14336, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                     "sliding_window": 4096}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, sliding_window="use_sliding_window",
           defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                     "num_key_value_heads": 4, "max_position_embeddings": 32768, "moe_intermediate_size": 768,
                     "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                     "max_window_layers": 28},
           biases=("attention_bias",), experts=ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")),
    Family("mixtral", "MixtralForCausalLM", qkv_bias=False, qk_norm=False, sliding_window="always",
           defaults={"intermediate_size": 14336, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                     "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts": 8, "num_experts_per_tok": 2,
                     "router_jitter_noise": 0.0, "router_aux_loss_coef": 0.001},
           experts=ExpertNames("block_sparse_moe", "w1", "w3", "w2")),
)}

# Mixture-of-experts designs we do not build, refused by name with the feature that is missing.
_MOE_TYPES = {"qwen2_moe": "shared experts", "deepseek_v2": "multi-head latent attention and shared experts",
              "deepseek_v3": "multi-head latent attention and shared experts",
              "llama4": "shared experts and chunked attention", "gpt_oss": "attention sinks and expert biases"}


def family(model_type: Optional[str]) -> Family:
    """The family of a config's `model_type`; ValueError (one line) for any other."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in _MOE_TYPES:
        raise ValueError(f"architecture {model_type!r} is not supported: mixture-of-experts with "
                         f"{_MOE_TYPES[model_type]}")
    raise ValueError(f"architecture {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")


def hf_config_fields(raw: dict) -> dict:
    """A config.json's keys with transformers' defaults for its family filled in (the family must be known);
    transformers 5 writes `num_experts` as `num_local_experts`, read here as `num_experts`."""
    fam = family(raw.get("model_type"))
    raw = dict(raw)
    if "num_local_experts" in raw:
        raw.setdefault("num_experts", raw.pop("num_local_experts"))
    return {**_COMMON_DEFAULTS, **fam.defaults, **raw}


def _sliding_layers(fam: Family, cfg: dict) -> bool:
    """Whether any layer of this config attends through a sliding window (transformers' rule for the family)."""
    if fam.sliding_window == "never" or cfg.get("sliding_window") is None:
        return False
    if fam.sliding_window == "always":
        return True
    if not cfg.get("use_sliding_window"):
        return False
    types = cfg.get("layer_types")
    if types:
        return "sliding_attention" in types
    return cfg["num_hidden_layers"] > cfg.get("max_window_layers", 0)


def unsupported_feature(raw: dict) -> Optional[str]:
    """The first feature of a config.json that we cannot run, as a phrase naming it; None when there is none."""
    fam = family(raw.get("model_type"))
    cfg = hf_config_fields(raw)
    if fam.experts is None and any(cfg.get(k) for k in ("num_experts", "n_routed_experts")):
        return f"mixture-of-experts layers are not supported in the dense family {fam.model_type!r}"
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        return ("dense layers between expert layers are not supported (mlp_only_layers="
                f"{cfg.get('mlp_only_layers')}, decoder_sparse_step={cfg.get('decoder_sparse_step')})")
    if cfg.get("router_jitter_noise"):
        return f"router_jitter_noise={cfg['router_jitter_noise']} is not supported"
    for key in fam.biases:
        if cfg.get(key):
            return f"{key}=true is not supported (biases beyond the QKV projection)"
    if cfg["hidden_act"] != "silu":
        return f"hidden_act={cfg['hidden_act']!r} is not supported (silu only)"
    window, positions = cfg.get("sliding_window"), cfg["max_position_embeddings"]
    if _sliding_layers(fam, cfg) and window < positions:
        return (f"sliding-window attention is not supported (sliding_window={window} < "
                f"max_position_embeddings={positions}; with max_position_embeddings <= {window} full attention is "
                f"the same)")
    return None


def hf_config_dict(cfg, dtype: str) -> dict:
    """config.json of the transformers model of this ModelConfig's family and shape."""
    fam = family(cfg.family)
    rope = ({"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} if cfg.rope_scaling else None)
    out = {"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
           "rope_theta": cfg.rotary_base, "rope_scaling": rope, "attention_dropout": 0.0,
           "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": cfg.init_method_std,
           "torch_dtype": dtype, "use_cache": True}
    out.update({key: False for key in fam.biases})
    if fam.sliding_window != "never":
        out["sliding_window"] = None
    if fam.sliding_window == "use_sliding_window":
        out["use_sliding_window"] = False
    if fam.experts is not None:
        out.update(num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                   router_aux_loss_coef=0.001, output_router_logits=False)
        if fam.model_type == "qwen3_moe":
            out.update(moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=not cfg.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[])
        else:  # Mixtral's experts are as wide as its `intermediate_size`
            out.update(intermediate_size=cfg.moe_ffn_hidden_size, router_jitter_noise=0.0)
    return out
