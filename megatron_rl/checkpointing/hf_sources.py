"""What a conversion reads from a Hugging Face source before any weight, and the GGUF step: which kind of source a
path is (`detect_format`: a megatron-rl checkpoint, a HF directory or a GGUF file), a HF directory's model shape
(config.json, without transformers) and which safetensors file holds each tensor it needs (headers only, every
shape checked), a GGUF Llama's shape from its header (`gguf_model_config`), and a GGUF Llama dequantized into one
safetensors file in Hugging Face names and row order (`gguf_to_safetensors`, one tensor at a time; the file itself
is read by `formats/gguf.py`).

`convert.py` builds on these; `initial.py` (a job's starting weights) and the reward model's loader use them too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.checkpointing.inspect import is_run_root
from megatron_rl.checkpointing.layout import META, ConversionError, first_line
from megatron_rl.checkpointing.safetensors_io import CODE_DTYPES, read_header, write_sharded
from megatron_rl.models.families import hf_config_fields, unsupported_feature
from megatron_rl.models.hf_mapping import hf_shapes, model_config_from_hf
from megatron_rl.models.presets import ModelConfig


def detect_format(src: Path) -> str:
    if src.is_file() and src.suffix == ".gguf":
        return "gguf"
    if src.is_dir() and ((src / META).exists() or is_run_root(src)):
        return "megatron"
    if src.is_dir() and (src / "config.json").exists():
        return "hf"
    raise ConversionError(f"{src}: not a Hugging Face directory (config.json), a GGUF file or a megatron-rl "
                          f"checkpoint ({META})")


def read_gguf(path: Path):
    """A GGUF file's header (`formats.gguf.GGUFFile`); a file it cannot read is a ConversionError."""
    from megatron_rl.formats.gguf import GGUFError, GGUFFile

    try:
        return GGUFFile(path)
    except GGUFError as e:
        raise ConversionError(str(e)) from None


def hf_model_config(src: Path) -> ModelConfig:
    """ModelConfig of a HF Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral directory (its config.json, read
    without importing transformers), refusing other architectures and unsupported features (experts in a dense
    family, other mixture-of-experts designs) in one line that names them."""
    from types import SimpleNamespace

    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{src / 'config.json'}: unreadable ({first_line(e)})") from None
    try:
        problem = unsupported_feature(raw)
    except ValueError as e:  # an architecture that is not one of the families
        raise ConversionError(f"{src}: {first_line(e)}") from None
    if problem:
        raise ConversionError(f"{src}: {problem}")
    try:
        return model_config_from_hf(SimpleNamespace(**hf_config_fields(raw)), name=src.name)
    except (ValueError, TypeError, AttributeError) as e:
        raise ConversionError(f"{src}: unsupported config ({first_line(e)})") from None


def hf_tensor_files(src: Path, cfg: ModelConfig, extra: Optional[dict[str, tuple[int, ...]]] = None,
                    lm_head: Optional[bool] = None) -> dict[str, str]:
    """HF tensor name -> safetensors file, after checking every tensor this model needs is there with the right
    shape (from the file headers only; a mixture of experts: each expert's own tensors, as transformers saves
    them). `extra`: more tensors the checkpoint holds (name -> shape), e.g. a sequence classifier's
    `score.weight`; `lm_head=False`: a model without the LM head (default: untied models have one)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{src}: no *.safetensors shards")
    where: dict[str, tuple[Path, str, tuple]] = {}
    for f in files:
        try:
            header = read_header(f)
        except (ValueError, OSError) as e:
            raise ConversionError(f"{f}: unreadable safetensors file ({first_line(e)})") from None
        for name, (code, shape) in header.items():
            where[name] = (f, code, shape)
    expected = {**hf_shapes(cfg, lm_head=not cfg.tie_word_embeddings if lm_head is None else lm_head),
                **(extra or {})}
    if "lm_head.weight" in expected and "lm_head.weight" not in where:
        expected.pop("lm_head.weight")  # untied config without lm_head: the embedding is used (see hf_mapping)
    for name, shape in expected.items():
        if name not in where:
            raise ConversionError(f"{src}: tensor {name} missing from the safetensors files")
        f, code, got = where[name]
        if tuple(got) != tuple(shape):
            raise ConversionError(f"{f.name}: tensor {name} has shape {list(got)}, expected {list(shape)} "
                                  f"for this config")
        if code not in CODE_DTYPES or not CODE_DTYPES[code].is_floating_point:
            raise ConversionError(f"{f.name}: tensor {name} has dtype {code}, expected a floating-point dtype")
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    extra = sorted(n for n in where if n not in expected and n not in ignored and "rotary_emb.inv_freq" not in n)
    if extra:
        raise ConversionError(f"{src}: unexpected tensor {extra[0]} ({len(extra)} in all) for a {cfg.family} model "
                              f"of this config")
    return {name: str(where[name][0]) for name in expected}


# A GGUF Llama's tensors by Hugging Face name (llama.cpp's names; `{i}` is the layer).
_GGUF_LLAMA_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
_GGUF_LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                     "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                     "self_attn.o_proj.weight": "attn_output.weight",
                     "post_attention_layernorm.weight": "ffn_norm.weight",
                     "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                     "mlp.down_proj.weight": "ffn_down.weight"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_llama_name(hf_name: str) -> str:
    m = _HF_LAYER.match(hf_name)
    return f"blk.{m.group(1)}.{_GGUF_LLAMA_LAYER[m.group(2)]}" if m else _GGUF_LLAMA_NAMES[hf_name]


def gguf_model_config(src: Path, gguf=None) -> ModelConfig:
    """ModelConfig of a GGUF Llama from its header (the keys llama.cpp writes, read as transformers reads them),
    refusing what this Llama cannot hold in one line: another architecture, experts, or RoPE scaling (llama.cpp
    stores Llama 3.1's as a `rope_freqs` tensor, without the parameters Megatron-Core's scaling needs)."""
    from types import SimpleNamespace

    g = gguf or read_gguf(src)
    arch = g.fields.get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{src}: architecture {arch!r} is not supported (GGUF files: only llama)")
    f = g.fields
    if f.get("llama.expert_count"):
        raise ConversionError(f"{src}: mixture-of-experts layers are not supported")
    if "rope_freqs.weight" in g.tensors or f.get("llama.rope.scaling.type", "none") != "none":
        raise ConversionError(f"{src}: RoPE scaling in a GGUF file is not supported (convert the Hugging Face "
                              f"directory instead)")
    try:
        heads = f["llama.attention.head_count"]
        hidden = f["llama.embedding_length"]
        raw = {"model_type": "llama", "num_hidden_layers": f["llama.block_count"], "hidden_size": hidden,
               "intermediate_size": f["llama.feed_forward_length"], "num_attention_heads": heads,
               "num_key_value_heads": f.get("llama.attention.head_count_kv", heads),
               "head_dim": f.get("llama.attention.key_length", hidden // heads),
               "max_position_embeddings": f["llama.context_length"],
               "rms_norm_eps": f["llama.attention.layer_norm_rms_epsilon"],
               "rope_theta": f.get("llama.rope.freq_base", 10000.0),
               "vocab_size": f.get("llama.vocab_size") or len(f["tokenizer.ggml.tokens"]),
               "tie_word_embeddings": "output.weight" not in g.tensors}
    except KeyError as e:
        raise ConversionError(f"{src}: the GGUF header lacks {e.args[0]}") from None
    try:
        return model_config_from_hf(SimpleNamespace(**hf_config_fields(raw)), name=src.stem)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{src}: unsupported config ({first_line(e)})") from None


def _unpermute_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Q or K projection's rows: within each head it stores the rotary pairs'
    halves interleaved (row 2j and 2j+1 are one pair), where Hugging Face's Llama keeps the first halves, then the
    second halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_to_safetensors(src: Path, out: Path, gguf=None) -> ModelConfig:
    """Dequantize a GGUF Llama into one safetensors file in `out`, in Hugging Face names and row order, one tensor
    at a time; every tensor is checked against the header's shape first, and a tensor this Llama has no place for
    is refused."""
    g = gguf or read_gguf(src)
    cfg = gguf_model_config(src, g)
    shapes = hf_shapes(cfg)
    wanted = {gguf_llama_name(n): n for n in shapes}
    for gname, name in wanted.items():
        if gname not in g.tensors:
            raise ConversionError(f"{src}: tensor {gname} ({name}) is missing")
        if g.tensors[gname].shape != shapes[name]:
            raise ConversionError(f"{src}: tensor {gname} has shape {list(g.tensors[gname].shape)}, expected "
                                  f"{list(shapes[name])}")
    extra = sorted(set(g.tensors) - set(wanted) - ({"output.weight"} if cfg.tie_word_embeddings else set()))
    if extra:
        raise ConversionError(f"{src}: unexpected tensor {extra[0]} ({len(extra)} in all) for a llama model of this "
                              f"config")
    rotary_heads = {"self_attn.q_proj.weight": cfg.num_attention_heads, "self_attn.k_proj.weight": cfg.num_query_groups}

    def produce():
        for name in shapes:
            t = g.tensor(gguf_llama_name(name))
            m = _HF_LAYER.match(name)
            if m and m.group(2) in rotary_heads:
                t = _unpermute_rotary_rows(t, rotary_heads[m.group(2)])
            yield name, t

    out.mkdir(parents=True)
    write_sharded(out, [(n, torch.float32, s) for n, s in shapes.items()], produce(), shard_bytes=2**62)
    return cfg
