"""Checkpoint conversion: Hugging Face Llama, Qwen2/2.5, Qwen3, Mistral, Qwen3-MoE or Mixtral (a directory; Llama
also GGUF) <-> Megatron-Core distributed checkpoint (the families and what is refused: `megatron_rl.models.families`).

The Megatron side is a standard `dist_checkpointing` (torch_dist) checkpoint of a local-spec GPTModel in `DST/model/`,
so it loads at any TP/PP/DP (and EP) (`dist_checkpointing.load(model.sharded_state_dict(), DST/model)`);
`DST/megatron_rl.json` records the model shape, the layout it was written with and the tokenizer, whose files go to
`DST/tokenizer/`. The HF side is `config.json` plus safetensors shards with an index (and the tokenizer files, when
the checkpoint has them). Tensors are renamed and re-laid out exactly (QKV and its bias interleaved per KV group,
fc1 = [gate; up]), so HF -> Megatron -> HF reproduces every tensor bit for bit.

Mixture-of-experts layers (Qwen3-MoE, Mixtral): the router is `decoder.layers.mlp.router.weight` [layers, experts,
hidden], stacked over layers like every layer tensor; the experts are stored as Megatron-Core's SequentialMLP
writes them, under `decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, 2 x moe_ffn, hidden]
(each expert's [gate; up], HF's gate_proj / up_proj or w1 / w3) and `...linear_fc2.weight` [layers, experts,
hidden, moe_ffn] (down_proj or w2), along a global expert axis: EP rank r writes its experts at their global
indices, so a checkpoint written at any EP (and expert-TP) loads at any other. `--ep N` writes with N times the
processes, each holding 1/N of the experts (EP over N DP ranks, as a trainer lays them out); the non-expert weights
those extra ranks replicate are filled and written by DP rank 0 only. In the HF files each expert is its own tensor
(`param_spec`'s names: `model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, `...block_sparse_moe.experts.{j}.w1...`).

Both directions stream; neither holds two copies of the model (measured in docs/benchmarks.md):
- HF -> Megatron: `tp * pp * ep` local processes each build only their shard of the GPTModel (initializers
  skipped) and fill every parameter straight from the rows and columns of the safetensors tensors it is made of
  (an expert's: only this rank's experts), read lazily (`safetensors.safe_open(...).get_slice`) in pieces of at
  most READ_BYTES; then torch_dist files written by threads of each rank (`background.write_now`).
  The HF state dict is never built. A GGUF file is first dequantized tensor by tensor into a temporary
  safetensors file in Hugging Face names (`hf_sources.gguf_to_safetensors`, without transformers), read the same way.
- Megatron -> HF: no model is built. Each layer's tensors are read from the torch_dist files as slices of the
  stacked `decoder.layers.*` tensors (torch.distributed.checkpoint with a slice planner, no process group; a
  layer's experts in one box of the expert-stacked tensors), converted, and appended to safetensors shards whose
  headers were written up front (every name, dtype and shape follows from the model shape). One layer is in
  memory at a time.
A training checkpoint (format "megatron-rl/train", or a run root: its `latest`) converts to HF the same way, since
its `model/` is the same kind of directory.

Here: both directions, the destination's checks (what --overwrite may replace) and the memory accounting; what a
source holds before any weight is read (its kind, a HF directory's shape and tensor files, a GGUF header, the GGUF
dequantization) is `hf_sources.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.checkpointing.hf_sources import (detect_format, gguf_model_config, gguf_to_safetensors,
                                                  hf_model_config, hf_tensor_files, read_gguf)
from megatron_rl.checkpointing.inspect import dist_tensors, is_run_root, reading
from megatron_rl.checkpointing.layout import (CONVERT_FORMAT, META, MODEL_DIR, TOKENIZER_DIR, TRAIN_FORMAT,
                                              CheckpointError, ConversionError, InspectError, read_meta, record_files,
                                              removed_line, verify_weights, write_meta)
from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.safetensors_io import write_sharded
from megatron_rl.checkpointing.tokenizer import MODEL_TYPE_FILE, TOKENIZER_FILES, save_tokenizer, tokenizer_dir
from megatron_rl.models.families import hf_config_dict
from megatron_rl.models.hf_mapping import hf_row_blocks, megatron_names, to_hf_tensors
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout, layout_problems

SHARD_BYTES = 2 * 2**30
READ_BYTES = 32 * 2**20  # HF -> Megatron reads at most this much of a tensor at a time


# ---- memory accounting ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


class MemoryMeter:
    """Resident memory of this process around a piece of work: RSS at the start and the peak (VmHWM) since,
    after resetting the peak where Linux allows it (`/proc/self/clear_refs`). Values in bytes (None if unknown)."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base = self._kib("VmRSS")

    @staticmethod
    def _kib(field):
        v = _status_kib(field)
        if v is None and field == "VmHWM":
            import resource

            v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return None if v is None else v * 1024

    def report(self) -> dict:
        return {"base_rss_bytes": self.base, "peak_rss_bytes": self._kib("VmHWM")}


# ---- HF -> Megatron ----------------------------------------------------------------------------------------------
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


def _layout_entry(layout: ParallelLayout) -> dict:
    """The writing layout as `megatron_rl.json` and the summary record it ("ep" only when experts were split)."""
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, **({"ep": layout.ep} if layout.ep > 1 else {})}


def _overwrite_problem(dst: Path) -> Optional[str]:
    """Why --overwrite must not delete `dst` (None when it may): only an empty directory, a checkpoint written by
    `convert --to megatron` or a Hugging Face model directory (config.json and weights) is replaced."""
    if dst.is_symlink() or not dst.is_dir():
        return "is not a directory"
    names = {p.name for p in dst.iterdir()}
    if not names:
        return None
    if META in names:
        try:
            fmt = read_meta(dst, formats=None).format
        except CheckpointError:
            fmt = None
        if fmt == CONVERT_FORMAT:
            return None
        if fmt == TRAIN_FORMAT:
            return "is a training checkpoint of a run"
        return f"has a {META} that is not a conversion's"
    if is_run_root(dst):
        return "is a training run's checkpoint directory"
    if "config.json" in names and any(n.endswith((".safetensors", ".safetensors.index.json", ".bin")) for n in names):
        return None
    return f"is neither empty nor a checkpoint (no {META}, no config.json with weights)"


def _check_dst(dst: Path, overwrite: bool) -> None:
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise ConversionError(f"{dst} exists (pass --overwrite to replace it)")
    problem = _overwrite_problem(dst)
    if problem:
        raise ConversionError(f"{dst} {problem}: --overwrite only replaces an empty directory, a converted "
                              f"checkpoint or a Hugging Face model directory; not deleting it")


def _prepare_dst(dst: Path, overwrite: bool) -> Path:
    _check_dst(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=dst.name + ".tmp.", dir=dst.parent))


def _finish(tmp: Path, dst: Path) -> None:
    if dst.is_dir():
        shutil.rmtree(dst)
    elif dst.exists():
        dst.unlink()
    tmp.rename(dst)


def _mb(n: Optional[int]) -> Optional[float]:
    return None if n is None else round(n / 2**20, 1)


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
    tmp = _prepare_dst(dst, overwrite)
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
        meta = {"format": CONVERT_FORMAT, "dtype": dtype, "source": str(src), "layout": _layout_entry(layout),
                "model": dataclasses.asdict(cfg), "tokenizer": tokenizer,
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_meta(tmp, record_files(tmp, meta))  # each file's CRC-32, checked by `inspect` and by every reader
        model_bytes = sum(f.stat().st_size for f in (tmp / MODEL_DIR).iterdir())
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    parent = meter.report()
    return {"to": "megatron", "dst": str(dst), "parameters": cfg.num_parameters(tp),
            "layout": _layout_entry(layout), "tokenizer": tokenizer is not None, "seconds": round(seconds, 2),
            "source_bytes": source_bytes, "model_bytes": model_bytes,
            "memory": {"rank_peak_rss_mb": [_mb(r["peak_rss_bytes"]) for r in ranks],
                       "rank_base_rss_mb": [_mb(r["base_rss_bytes"]) for r in ranks],
                       "rank_shard_mb": [_mb(r["local_bytes"]) for r in ranks],
                       "parent_peak_rss_mb": _mb(parent["peak_rss_bytes"]),
                       "parent_base_rss_mb": _mb(parent["base_rss_bytes"])}}


# ---- Megatron -> HF ----------------------------------------------------------------------------------------------
# The local spec saves the two norms under the fused names that transformer-engine's spec uses.
_STORED_ALIASES = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                   "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class DistSliceReader:
    """Reads boxes (offsets, sizes) of the global tensors of a torch_dist checkpoint without torch.distributed
    and without building a model: only the file ranges that overlap a box are read."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        self.reader = FileSystemReader(str(path))
        self.metadata = self.reader.read_metadata()
        self.tensors = self.metadata.state_dict_metadata

    def read(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """{key: (offsets, sizes)} -> {key: tensor of `sizes`} (one read per call)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        class SlicePlanner(DefaultLoadPlanner):
            def create_local_plan(self):
                items = []
                for key, (offsets, sizes) in boxes.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
                return LoadPlan(items)

            def lookup_tensor(self, index):
                return self.state_dict[index.fqn]

        out = {k: torch.empty(sizes, dtype=self.tensors[k].properties.dtype) for k, (_, sizes) in boxes.items()}
        self.reader = type(self.reader)(str(self.path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended
            dcp.load(out, storage_reader=self.reader,
                     planner=SlicePlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
        return out


# Megatron-Core's SequentialMLP stores expert j of layer i at [i, j] of these stacked tensors (its global index).
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_EXPERTS_KEY = "decoder.layers.mlp.experts.experts."


def _stored_layer_box(reader: DistSliceReader, layer: int, suffix: str, cfg: ModelConfig):
    """`_stored_box` of a layer tensor: one layer of a `decoder.layers.*` tensor; an expert's, all of the layer's
    experts (one box per key and layer, so that a layer's experts are read at once), and which to take."""
    e = _EXPERT.match(suffix)
    keys = [_EXPERTS_KEY + e.group(2)] if e else ["decoder.layers." + c for c in _STORED_ALIASES.get(suffix, (suffix,))]
    key = next((k for k in keys if k in reader.tensors), None)
    if key is None:
        raise ConversionError(f"{reader.path}: no tensor for decoder.layers.{layer}.{suffix} (looked for {keys[0]})")
    size = tuple(reader.tensors[key].size)
    if size[0] != cfg.num_layers:
        raise ConversionError(f"{reader.path}: {key} stacks {size[0]} layers, the config has {cfg.num_layers}")
    if not e:
        return key, (layer,) + (0,) * (len(size) - 1), (1,) + size[1:], size[1:], None
    if len(size) < 2 or size[1] != cfg.num_moe_experts:
        raise ConversionError(f"{reader.path}: {key} stacks {size[1] if len(size) > 1 else 0} experts, the config "
                              f"has {cfg.num_moe_experts}")
    return key, (layer,) + (0,) * (len(size) - 1), (1,) + size[1:], size[2:], int(e.group(1))


def _stored_box(reader: DistSliceReader, name: str, cfg: ModelConfig):
    """Where logical tensor `name` lives in a dist checkpoint: (key, offsets, sizes, shape, expert) where
    (offsets, sizes) is the box read and, for an expert's tensor (`expert` not None), the box holds the layer's
    experts and the tensor is `box[0, expert]`; otherwise the box itself, reshaped to `shape`."""
    m = _LAYER.match(name)
    if m:
        return _stored_layer_box(reader, int(m.group(1)), m.group(2), cfg)
    if name not in reader.tensors:
        raise ConversionError(f"{reader.path}: tensor {name} missing")
    size = tuple(reader.tensors[name].size)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if size[0] < cfg.vocab_size:
            raise ConversionError(f"{reader.path}: {name} has {size[0]} rows, fewer than vocab_size={cfg.vocab_size}")
        size = (cfg.vocab_size,) + size[1:]  # drop the vocabulary padding of the layout it was written with
    return name, (0,) * len(size), size, size, None


def megatron_to_hf_checkpoint(src: Path, dst: Path, overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> dict:
    """Convert checkpoint `src` (or the latest of a run root, held against the run's retention while it is read)."""
    try:
        held = reading(src)
    except InspectError as e:
        raise ConversionError(str(e)) from None
    with held as ckpt:
        try:
            return _to_hf(ckpt, dst, overwrite, shard_bytes)
        except Exception:
            removed = removed_line(ckpt)  # gone anyway: read without a lease (a run directory it cannot write)
            if removed is None:
                raise
            raise ConversionError(removed) from None


def _to_hf(ckpt: Path, dst: Path, overwrite: bool, shard_bytes: int) -> dict:
    start = time.perf_counter()
    meter = MemoryMeter()
    try:
        meta = read_meta(ckpt)
        dist_tensors(ckpt / MODEL_DIR)  # one-line error for a missing or half-written model/
        verify_weights(ckpt, meta)  # the files read match their checksums
        safe_load.check_checkpoint(ckpt)  # its pickles hold only data, before torch reads them
    except (InspectError, CheckpointError) as e:
        raise ConversionError(str(e)) from None
    try:
        cfg = meta.model_config()
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    reader = DistSliceReader(ckpt / MODEL_DIR)
    names = megatron_names(cfg)
    boxes = {n: _stored_box(reader, n, cfg) for n in names}
    entries = []
    for n in names:
        key, _, _, shape, _ = boxes[n]
        for hf_name, t in to_hf_tensors(n, torch.empty(shape, device="meta"), cfg):
            entries.append((hf_name, reader.tensors[key].properties.dtype, tuple(t.shape)))
    # Read in groups: the embedding, each layer, the final norm, the output layer.
    groups: list[list[str]] = []
    for n in names:
        m = _LAYER.match(n)
        if groups and m and _LAYER.match(groups[-1][0]) and _LAYER.match(groups[-1][0]).group(1) == m.group(1):
            groups[-1].append(n)
        else:
            groups.append([n])

    def produce():
        for group in groups:
            got = reader.read({boxes[n][0]: boxes[n][1:3] for n in group})  # a layer's experts: one box per key
            for n in group:
                key, _, _, shape, expert = boxes[n]
                t = got[key].reshape(shape) if expert is None else got[key][0, expert]
                yield from to_hf_tensors(n, t, cfg)
                del t
            del got

    tmp = _prepare_dst(dst, overwrite)
    try:
        index = write_sharded(tmp, entries, produce(), shard_bytes)
        dtype = str(entries[0][1]).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2))
        tok = tokenizer_dir(ckpt, meta)
        copied = 0
        if tok is not None and tok.is_dir():
            for f in tok.iterdir():
                if f.name == MODEL_TYPE_FILE:  # the model's own config.json is written above
                    continue
                if f.is_file() and (f.name in TOKENIZER_FILES or f.suffix in (".json", ".model", ".txt", ".jinja")):
                    shutil.copy2(f, tmp / f.name)
                    copied += 1
        shards = len(set(index["weight_map"].values()))
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mem = meter.report()
    return {"to": "hf", "dst": str(dst), "source": str(ckpt), "shards": shards,
            "model_bytes": index["metadata"]["total_size"], "tokenizer_files": copied,
            "seconds": round(time.perf_counter() - start, 2),
            "memory": {"peak_rss_mb": _mb(mem["peak_rss_bytes"]), "base_rss_mb": _mb(mem["base_rss_bytes"])}}


def convert(src: Path, dst: Path, to: str, dtype: str = "float32", overwrite: bool = False, tp: int = 1,
            pp: int = 1, shard_bytes: int = SHARD_BYTES, ep: int = 1) -> dict:
    """`megatron-rl convert`: `src` (HF directory, GGUF file, or megatron-rl checkpoint) into `dst` in the format
    `to` ("megatron" or "hf"); tp / pp / ep: the layout that writes a Megatron checkpoint (any loads it)."""
    src, dst = Path(src), Path(dst)
    if to not in ("megatron", "hf"):
        raise ConversionError(f"--to must be megatron or hf, got {to!r}")
    if not src.exists():
        raise ConversionError(f"{src}: does not exist")
    fmt = detect_format(src)
    if dst.resolve() == src.resolve():
        raise ConversionError(f"{dst}: the destination is the source")
    _check_dst(dst, overwrite)  # before any work: what --overwrite may delete
    if to == "megatron":
        if fmt == "megatron":
            raise ConversionError(f"{src} is already a megatron-rl checkpoint")
        return hf_to_megatron_checkpoint(src, dst, dtype=dtype, overwrite=overwrite, tp=tp, pp=pp, ep=ep)
    if fmt != "megatron":
        raise ConversionError(f"{src} is a {fmt} source; --to hf converts megatron-rl checkpoints "
                              f"({CONVERT_FORMAT} or {TRAIN_FORMAT})")
    if (tp, pp, ep) != (1, 1, 1):
        raise ConversionError("--tp/--pp/--ep apply to --to megatron (reading a Megatron checkpoint needs no layout)")
    return megatron_to_hf_checkpoint(src, dst, overwrite=overwrite, shard_bytes=shard_bytes)

