"""Checkpoint conversion: Hugging Face Llama (directory or GGUF) <-> Megatron-Core distributed checkpoint.

The Megatron side is a standard `dist_checkpointing` (torch_dist) checkpoint of a local-spec GPTModel, written
from a TP=1, PP=1 model, so it loads at any TP/PP/DP (`dist_checkpointing.load(model.sharded_state_dict(), dir)`);
`megatron_rl.json` beside it records the model shape. The HF side is `config.json` plus safetensors shards with
an index. Tensors are renamed and re-laid out exactly (QKV interleaved per KV group, fc1 = [gate; up]), so
HF -> Megatron -> HF reproduces every tensor bit for bit.

Limits of this first version: the whole model is held in memory once (plus the Megatron copy), not streamed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.models.hf_mapping import hf_to_megatron, megatron_to_hf, model_config_from_hf
from megatron_rl.models.presets import ModelConfig

META = "megatron_rl.json"


class ConversionError(ValueError):
    """A source that cannot be converted; the message is one line."""


def detect_format(src: Path) -> str:
    if src.is_file() and src.suffix == ".gguf":
        return "gguf"
    if src.is_dir() and (src / META).exists():
        return "megatron"
    if src.is_dir() and (src / "config.json").exists():
        return "hf"
    raise ConversionError(f"{src}: not a Hugging Face directory (config.json), a GGUF file or a megatron-rl "
                          f"checkpoint ({META})")


def load_hf(src: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Model shape and state dict of a HF Llama directory or GGUF file (GGUF weights are dequantized)."""
    import transformers

    if src.suffix == ".gguf":
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                                      torch_dtype=torch.float32)
        except Exception as e:
            raise ConversionError(f"{src}: cannot load this GGUF as a Llama model ({str(e).splitlines()[0]})") from None
        config = model.config
        sd = model.state_dict()
    else:
        config = transformers.AutoConfig.from_pretrained(src)
        from safetensors.torch import load_file

        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{src}: no *.safetensors shards")
        sd = {}
        for f in files:
            try:
                sd.update(load_file(f))
            except Exception as e:
                raise ConversionError(f"{f}: unreadable safetensors file ({str(e).splitlines()[0]})") from None
    if getattr(config, "model_type", "llama") not in ("llama",):
        raise ConversionError(f"{src}: architecture {config.model_type!r} is not llama")
    return model_config_from_hf(config, name=src.stem), sd


def _prepare_dst(dst: Path, overwrite: bool) -> Path:
    if dst.exists():
        if not overwrite:
            raise ConversionError(f"{dst} exists (pass --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=dst.name + ".tmp.", dir=dst.parent))


def _finish(tmp: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)


def _save_megatron_worker(rank, world_size, cfg: ModelConfig, logical: dict, out: str, dtype: str):
    from megatron.core import dist_checkpointing

    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("convert", ParallelLayout())])["convert"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=getattr(torch, dtype))
    load_full_state_dict(model, logical, cfg, g.pgs)
    dist_checkpointing.save(model.sharded_state_dict(metadata={"dp_cp_group": g.pgs.dp_cp}), out)
    return sum(p.numel() for p in model.parameters())


def _load_megatron_worker(rank, world_size, cfg: ModelConfig, src: str, dtype: str):
    from megatron.core import dist_checkpointing

    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import gather_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("convert", ParallelLayout())])["convert"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    model = model.to(getattr(torch, dtype))
    state = dist_checkpointing.load(model.sharded_state_dict(metadata={"dp_cp_group": g.pgs.dp_cp}), src)
    model.load_state_dict(state)
    return gather_full_state_dict(model, cfg, g.pgs)


def read_meta(src: Path) -> tuple[ModelConfig, dict]:
    meta = json.loads((src / META).read_text())
    return ModelConfig(**meta["model"]), meta


def hf_to_megatron_checkpoint(src: Path, dst: Path, dtype: str = "float32", overwrite: bool = False) -> dict:
    from megatron_rl.parallel.spawn import run_local

    cfg, sd = load_hf(src)
    logical = hf_to_megatron(sd, cfg)
    tmp = _prepare_dst(dst, overwrite)
    try:
        ckpt = tmp / "model"
        ckpt.mkdir()
        run_local(_save_megatron_worker, 1, cfg, logical, str(ckpt), dtype)
        (tmp / META).write_text(json.dumps({"format": "megatron-rl/dist_checkpointing", "dtype": dtype,
                                            "source": str(src), "model": dataclasses.asdict(cfg)}, indent=2))
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"to": "megatron", "dst": str(dst), "parameters": cfg.num_parameters()}


def megatron_to_hf_checkpoint(src: Path, dst: Path, overwrite: bool = False, shard_bytes: int = 2 * 2**30) -> dict:
    import transformers
    from safetensors.torch import save_file

    from megatron_rl.parallel.spawn import run_local

    cfg, meta = read_meta(src)
    logical = run_local(_load_megatron_worker, 1, cfg, str(src / "model"), meta.get("dtype", "float32"))[0]
    hf_sd = megatron_to_hf(logical, cfg)
    if cfg.tie_word_embeddings:
        hf_sd.pop("lm_head.weight")
    tmp = _prepare_dst(dst, overwrite)
    try:
        rope = ({"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} if cfg.rope_scaling else None)
        config = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, rope_scaling=rope,
            tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.init_method_std,
            torch_dtype=meta.get("dtype", "float32"))
        config.save_pretrained(tmp)
        shards, current, size = [], {}, 0
        for name in sorted(hf_sd):
            t = hf_sd[name].contiguous()
            if current and size + t.numel() * t.element_size() > shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = t
            size += t.numel() * t.element_size()
        shards.append(current)
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf_sd.values())},
                 "weight_map": {}}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            index["weight_map"].update({k: fname for k in shard})
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"to": "hf", "dst": str(dst), "shards": len(shards)}


def convert(src: Path, dst: Path, to: str, dtype: str = "float32", overwrite: bool = False) -> dict:
    fmt = detect_format(src)
    if to == "megatron":
        if fmt == "megatron":
            raise ConversionError(f"{src} is already a megatron-rl checkpoint")
        return hf_to_megatron_checkpoint(src, dst, dtype=dtype, overwrite=overwrite)
    if to == "hf":
        if fmt == "megatron":
            return megatron_to_hf_checkpoint(src, dst, overwrite=overwrite)
        raise ConversionError(f"{src} is a {fmt} source; --to hf converts megatron-rl checkpoints")
    raise ConversionError(f"--to must be megatron or hf, got {to!r}")
