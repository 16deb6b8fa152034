"""What a conversion reads from a Hugging Face source before any weight, and the GGUF step: which kind of source a
path is (`detect_format`: a megatron-rl checkpoint, a HF directory or a GGUF file), a GGUF header's architecture
(read up to that key only), a HF directory's model shape (config.json, without transformers) and which
safetensors file holds each tensor it needs (headers only, every shape checked), and a GGUF Llama dequantized
into one safetensors file (`gguf_to_safetensors`, the one step of a conversion that holds the whole model).

`convert.py` builds on these; `initial.py` (a job's starting weights) and the reward model's loader use them too.
"""

from __future__ import annotations

import json
import struct
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


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path) -> Optional[str]:
    """`general.architecture` from a GGUF header, reading only the key-value section up to that key."""

    def u32(f):
        return struct.unpack("<I", f.read(4))[0]

    def u64(f):
        return struct.unpack("<Q", f.read(8))[0]

    def skip(f, vtype):
        if vtype in _GGUF_SCALAR:
            f.seek(_GGUF_SCALAR[vtype], 1)
        elif vtype == 8:
            f.seek(u64(f), 1)
        elif vtype == 9:
            item, count = u32(f), u64(f)
            if item in _GGUF_SCALAR:
                f.seek(_GGUF_SCALAR[item] * count, 1)
            else:
                for _ in range(count):
                    skip(f, item)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConversionError(f"{path}: not a GGUF file (bad magic)")
            if u32(f) < 2:
                raise ConversionError(f"{path}: GGUF version 1 is not supported")
            u64(f)  # tensor count
            for _ in range(u64(f)):
                key = f.read(u64(f)).decode("utf-8", "replace")
                vtype = u32(f)
                if key == "general.architecture" and vtype == 8:
                    return f.read(u64(f)).decode("utf-8", "replace")
                skip(f, vtype)
    except (struct.error, ValueError, OSError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"{path}: unreadable GGUF header ({first_line(e)})") from None
    return None


def hf_model_config(src: Path) -> ModelConfig:
    """ModelConfig of a HF Llama / Qwen2 / Qwen3 / Mistral directory (its config.json, read without importing
    transformers), refusing other architectures and unsupported features in one line that names them."""
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
    shape (from the file headers only). `extra`: more tensors the checkpoint holds (name -> shape), e.g. a sequence
    classifier's `score.weight`; `lm_head=False`: a model without the LM head (default: untied models have one)."""
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


def gguf_to_safetensors(src: Path, out: Path) -> ModelConfig:
    """Dequantize a GGUF Llama with transformers and write it as one safetensors file in `out`, tensor by
    tensor, dropping each one after it is written."""
    arch = gguf_architecture(src)
    if arch != "llama":
        raise ConversionError(f"{src}: architecture {arch!r} is not supported (GGUF files: only llama)")
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                                  torch_dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"{src}: cannot load this GGUF as a Llama model ({first_line(e)})") from None
    if getattr(model.config, "model_type", None) != "llama":
        raise ConversionError(f"{src}: architecture {model.config.model_type!r} is not supported (GGUF files: only "
                              f"llama)")
    try:
        cfg = model_config_from_hf(model.config, name=src.stem)
    except ValueError as e:
        raise ConversionError(f"{src}: unsupported config ({first_line(e)})") from None
    sd = model.state_dict()
    del model
    shapes = hf_shapes(cfg)
    for name, shape in shapes.items():
        if tuple(sd[name].shape) != shape:
            raise ConversionError(f"{src}: tensor {name} has shape {list(sd[name].shape)}, expected {list(shape)}")
    entries = [(n, sd[n].dtype, s) for n, s in shapes.items()]

    def produce():
        for n in shapes:
            yield n, sd.pop(n)

    out.mkdir(parents=True)
    write_sharded(out, entries, produce(), shard_bytes=2**62)
    sd.clear()
    return cfg
