"""Megatron -> HF (`convert.py` describes both directions): no model is built; each layer's tensors are read from
the torch_dist files as slices, converted, and appended to safetensors shards whose headers were written up front."""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path

import torch

from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.destination import MemoryMeter, finish_destination, mb, prepare_destination
from megatron_rl.checkpointing.inspect import dist_tensors, reading
from megatron_rl.checkpointing.layout import (MODEL_DIR, CheckpointError, ConversionError, InspectError, read_meta,
                                              removed_line, verify_weights)
from megatron_rl.checkpointing.safetensors_io import write_sharded
from megatron_rl.checkpointing.tokenizer import MODEL_TYPE_FILE, TOKENIZER_FILES, tokenizer_dir
from megatron_rl.models.families import hf_config_dict
from megatron_rl.models.hf_mapping import megatron_names, to_hf_tensors
from megatron_rl.models.param_spec import local_expert
from megatron_rl.models.presets import ModelConfig

SHARD_BYTES = 2 * 2**30


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
_EXPERTS_KEY = "decoder.layers.mlp.experts.experts."


def _stored_layer_box(reader: DistSliceReader, layer: int, suffix: str, cfg: ModelConfig):
    """`_stored_box` of a layer tensor: one layer of a `decoder.layers.*` tensor; an expert's, all of the layer's
    experts (one box per key and layer, so that a layer's experts are read at once), and which to take."""
    e = local_expert(suffix)
    keys = [_EXPERTS_KEY + e[1]] if e else ["decoder.layers." + c for c in _STORED_ALIASES.get(suffix, (suffix,))]
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
    return key, (layer,) + (0,) * (len(size) - 1), (1,) + size[1:], size[2:], e[0]


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

    tmp = prepare_destination(dst, overwrite)
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
        finish_destination(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mem = meter.report()
    return {"to": "hf", "dst": str(dst), "source": str(ckpt), "shards": shards,
            "model_bytes": index["metadata"]["total_size"], "tokenizer_files": copied,
            "seconds": round(time.perf_counter() - start, 2),
            "memory": {"peak_rss_mb": mb(mem["peak_rss_bytes"]), "base_rss_mb": mb(mem["base_rss_bytes"])}}
