"""HF -> Megatron (`convert.py` describes both directions): each local process builds only its shard of the GPTModel
and fills every parameter straight from the safetensors slices it is made of, then writes torch_dist files."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from megatron_rl.checkpointing.destination import MemoryMeter, finish_destination, mb, prepare_destination
from megatron_rl.checkpointing.hf_sources import (detect_format, gguf_model_config, gguf_to_safetensors,
                                                  hf_model_config, hf_tensor_files, read_gguf)
from megatron_rl.checkpointing.layout import (MODEL_DIR, TOKENIZER_DIR, ConversionError, conversion_meta,
                                              layout_entry, record_files, write_meta)
from megatron_rl.checkpointing.tokenizer import save_tokenizer
from megatron_rl.models.hf_mapping import hf_row_blocks
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout, layout_problems

READ_BYTES = 32 * 2**20  # HF -> Megatron reads at most this much of a tensor at a time


def fill_param(param: torch.Tensor, d, cfg: ModelConfig, files: dict[str, str]) -> None:
    """Copy this rank's shard of one parameter straight from the rows (and columns) of the HF tensors it is made
    of: only those bytes are read (`get_slice`), in pieces of at most READ_BYTES, and no full tensor is built."""
    from safetensors import safe_open

    cols = d.col_range(param.shape[1]) if param.dim() > 1 else None
    row_bytes = (param[0].numel() if param.dim() > 1 else 1) * param.element_size()
    step = max(1, READ_BYTES // row_bytes)
    if d.is_vocab:
        param.zero_()  # padding rows past the vocabulary
    covered = 0
    for local, first, rows in d.row_segments(param.shape[0]):
        for start, name, n, hf_first in hf_row_blocks(d.global_name, cfg):
            lo, hi = max(first, start), min(first + rows, start + n)
            if lo >= hi:
                continue
            if name not in files and name == "lm_head.weight":
                name = "model.embed_tokens.weight"  # untied config without lm_head (see hf_mapping)
            for r in range(lo, hi, step):
                r2 = min(hi, r + step)
                a, b = hf_first + r - start, hf_first + r2 - start
                # A handle per piece: an open handle keeps the file pages it has read mapped (counted as resident).
                with safe_open(files[name], framework="pt") as f:
                    sl = f.get_slice(name)
                    src = sl[a:b] if cols is None else sl[a:b, cols[0]:cols[1]]
                param[local + r - first: local + r2 - first].copy_(src)
                del src
            covered += hi - lo
    if covered != param.shape[0] and not d.is_vocab:
        raise RuntimeError(f"{d.global_name}: filled {covered} of {param.shape[0]} rows of {d.local_name}")


def _copy_views_releasing_params(sharded: dict, model: torch.nn.Module) -> None:
    """Megatron-Core's writer copies every tensor that is a view into a larger storage (the gate and up halves
    of each SwiGLU `linear_fc1`) before it writes anything: about a third of a Llama's weights held twice. Make
    those copies here instead, one parameter at a time, releasing each parameter's own storage once its views
    are copied (the model is not used after the save)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    views: dict[int, list] = {}
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor) and isinstance(v.data, torch.Tensor) and v.data.device.type == "cpu":
            storage = v.data.untyped_storage()
            if storage.nbytes() != v.data.numel() * v.data.element_size():
                views.setdefault(storage.data_ptr(), []).append(v)
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    for ptr, group in views.items():
        for v in group:
            v.data = v.data.clone()
        if ptr in params:
            params[ptr].data = torch.empty(0, dtype=params[ptr].dtype)


def _save_megatron_worker(rank, world_size, cfg: ModelConfig, layout: ParallelLayout, files: dict, out: str,
                          dtype: str):
    """One rank: build this rank's shard of the model, fill it from the safetensors files, save it. With EP > 1
    (EP over DP ranks) only DP rank 0 fills the weights other than experts: the others hold replicas of them, which
    Megatron-Core's save leaves to DP rank 0 (replica id), so they are never written."""
    meter = MemoryMeter()
    from megatron_rl.checkpointing.background import write_now
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import describe_params, model_sharded_state_dict
    from megatron_rl.parallel import ExecutorPlacement, build_topology

    g = build_topology([ExecutorPlacement("convert", layout)])["convert"]
    # Every parameter is filled from the files next: no initialization, no full-size master weight.
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=getattr(torch, dtype),
                            initialize=False)
    params = dict(model.named_parameters())
    replica = g.pgs.dp_cp.rank() > 0
    with torch.no_grad():
        for d in describe_params(model, cfg, g.pgs.tp.rank(), g.pgs.tp.size()):
            if replica and not d.is_expert:
                params[d.local_name].zero_()  # not written (see above); zeros, not whatever memory held
                continue
            fill_param(params[d.local_name], d, cfg, files)
    local_bytes = sum(p.numel() * p.element_size() for p in params.values())
    sharded = model_sharded_state_dict(model, g.pgs.dp_cp)
    _copy_views_releasing_params(sharded, model)
    write_now(sharded, Path(out))
    return dict(meter.report(), rank=rank, local_bytes=local_bytes)


def _check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """The first reason --tp / --pp / --ep cannot hold the model (`parallel.layout.layout_problems`), as a
    ConversionError."""
    problems = layout_problems(cfg, layout)
    if any(p.field is None for p in problems):
        raise ConversionError(f"--tp, --pp and --ep must be >= 1, got tp={layout.tp} pp={layout.pp} ep={layout.ep}")
    if problems:
        p = problems[0]
        if p.field == "dense":
            raise ConversionError(f"--ep {p.size} needs a mixture-of-experts model ({cfg.family} is dense)")
        raise ConversionError(f"--{p.dim} {p.size} does not divide {p.field}={p.count}")


def hf_to_megatron_checkpoint(src: Path, dst: Path, dtype: str = "float32", overwrite: bool = False,
                              tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """Convert a HF directory or GGUF file `src` into a Megatron checkpoint `dst`, written by `tp * pp * ep` local
    processes (EP over `ep` DP ranks); returns the summary (`convert`'s)."""
    from megatron_rl.launch.spawn import run_local

    start = time.perf_counter()
    meter = MemoryMeter()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    gguf = read_gguf(src) if detect_format(src) == "gguf" else None  # its header, read once
    cfg = gguf_model_config(src, gguf) if gguf else hf_model_config(src)
    layout = ParallelLayout(tp=tp, pp=pp, dp=ep, ep=ep)
    _check_layout(cfg, layout)
    if not gguf:
        files = hf_tensor_files(src, cfg)
    tmp = prepare_destination(dst, overwrite)
    try:
        if gguf:
            gguf_to_safetensors(src, tmp / "dequantized", gguf)
            files = hf_tensor_files(tmp / "dequantized", cfg)
        source_bytes = sum(os.path.getsize(f) for f in set(files.values()))
        (tmp / MODEL_DIR).mkdir()
        ranks = run_local(_save_megatron_worker, layout.size, cfg, layout, files, str(tmp / MODEL_DIR), dtype)
        if gguf:
            shutil.rmtree(tmp / "dequantized")
        tokenizer = save_tokenizer(src, tmp / TOKENIZER_DIR)
        meta = conversion_meta(dtype=dtype, source=str(src), layout=layout, model=cfg, tokenizer=tokenizer)
        write_meta(tmp, record_files(tmp, meta))  # each file's CRC-32, checked by `inspect` and by every reader
        model_bytes = sum(f.stat().st_size for f in (tmp / MODEL_DIR).iterdir())
        finish_destination(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    parent = meter.report()
    return {"to": "megatron", "dst": str(dst), "parameters": cfg.num_parameters(tp),
            "layout": layout_entry(layout), "tokenizer": tokenizer is not None, "seconds": round(seconds, 2),
            "source_bytes": source_bytes, "model_bytes": model_bytes,
            "memory": {"rank_peak_rss_mb": [mb(r["peak_rss_bytes"]) for r in ranks],
                       "rank_base_rss_mb": [mb(r["base_rss_bytes"]) for r in ranks],
                       "rank_shard_mb": [mb(r["local_bytes"]) for r in ranks],
                       "parent_peak_rss_mb": mb(parent["peak_rss_bytes"]),
                       "parent_base_rss_mb": mb(parent["base_rss_bytes"])}}
