"""Checkpoint conversion: Hugging Face Llama, Qwen2/2.5, Qwen3 or Mistral (a directory; Llama also GGUF) <->
Megatron-Core distributed checkpoint (the families and what is refused: `megatron_rl.models.families`).

The Megatron side is a standard `dist_checkpointing` (torch_dist) checkpoint of a local-spec GPTModel in `DST/model/`,
so it loads at any TP/PP/DP (`dist_checkpointing.load(model.sharded_state_dict(), DST/model)`); `DST/megatron_rl.json`
records the model shape, the layout it was written with and the tokenizer, whose files go to `DST/tokenizer/`.
The HF side is `config.json` plus safetensors shards with an index (and the tokenizer files, when the checkpoint
has them). Tensors are renamed and re-laid out exactly (QKV and its bias interleaved per KV group, fc1 = [gate; up]), so
HF -> Megatron -> HF reproduces every tensor bit for bit.

Both directions stream; neither holds two copies of the model (measured in docs/benchmarks.md):
- HF -> Megatron: `tp * pp` local processes each build only their shard of the GPTModel (initializers skipped)
  and fill every parameter straight from the rows and columns of the safetensors tensors it is made of, read
  lazily (`safetensors.safe_open(...).get_slice`) in pieces of at most READ_BYTES; then `dist_checkpointing.save`.
  The HF state dict is never built. A GGUF file is dequantized by transformers first (the one step that holds the
  whole model, in the parent process), written to a temporary safetensors file and dropped before the model is
  built.
- Megatron -> HF: no model is built. Each layer's tensors are read from the torch_dist files as slices of the
  stacked `decoder.layers.*` tensors (torch.distributed.checkpoint with a slice planner, no process group),
  converted, and appended to safetensors shards whose headers were written up front (every name, dtype and shape
  follows from the model shape). One layer is in memory at a time.
A training checkpoint (format "megatron-rl/train", or a run root: its `latest`) converts to HF the same way, since
its `model/` is the same kind of directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.checkpointing.inspect import dist_tensors, is_run_root, model_config, resolve_checkpoint
from megatron_rl.checkpointing.inspect import read_meta as read_checkpoint_meta
from megatron_rl.checkpointing.layout import CONVERT_FORMAT, META, MODEL_DIR, TOKENIZER_DIR, TRAIN_FORMAT, InspectError
from megatron_rl.checkpointing.layout import CheckpointError
from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.safetensors_io import CODE_DTYPES, read_header, write_sharded
from megatron_rl.checkpointing.tokenizer import MODEL_TYPE_FILE, TOKENIZER_FILES, save_tokenizer, tokenizer_dir
from megatron_rl.models.families import hf_config_dict, hf_config_fields, unsupported_feature
from megatron_rl.models.hf_mapping import (hf_row_blocks, hf_shapes, megatron_names, model_config_from_hf,
                                           to_hf_tensors)
from megatron_rl.models.presets import ModelConfig

SHARD_BYTES = 2 * 2**30
READ_BYTES = 32 * 2**20  # HF -> Megatron reads at most this much of a tensor at a time


class ConversionError(ValueError):
    """A source that cannot be converted; the message is one line."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


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


# ---- sources -----------------------------------------------------------------------------------------------------
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
        raise ConversionError(f"{path}: unreadable GGUF header ({_first_line(e)})") from None
    return None


def hf_model_config(src: Path) -> ModelConfig:
    """ModelConfig of a HF Llama / Qwen2 / Qwen3 / Mistral directory (its config.json, read without importing
    transformers), refusing other architectures and unsupported features in one line that names them."""
    from types import SimpleNamespace

    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{src / 'config.json'}: unreadable ({_first_line(e)})") from None
    try:
        problem = unsupported_feature(raw)
    except ValueError as e:  # an architecture that is not one of the families
        raise ConversionError(f"{src}: {_first_line(e)}") from None
    if problem:
        raise ConversionError(f"{src}: {problem}")
    try:
        return model_config_from_hf(SimpleNamespace(**hf_config_fields(raw)), name=src.name)
    except (ValueError, TypeError, AttributeError) as e:
        raise ConversionError(f"{src}: unsupported config ({_first_line(e)})") from None


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
            raise ConversionError(f"{f}: unreadable safetensors file ({_first_line(e)})") from None
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


def _gguf_to_safetensors(src: Path, out: Path) -> ModelConfig:
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
        raise ConversionError(f"{src}: cannot load this GGUF as a Llama model ({_first_line(e)})") from None
    if getattr(model.config, "model_type", None) != "llama":
        raise ConversionError(f"{src}: architecture {model.config.model_type!r} is not supported (GGUF files: only "
                              f"llama)")
    try:
        cfg = model_config_from_hf(model.config, name=src.stem)
    except ValueError as e:
        raise ConversionError(f"{src}: unsupported config ({_first_line(e)})") from None
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


# ---- HF -> Megatron ----------------------------------------------------------------------------------------------
def skip_init(tensor: torch.Tensor) -> torch.Tensor:
    """An init method that leaves the tensor as it is (every parameter is filled from a checkpoint next)."""
    return tensor


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


def _save_megatron_worker(rank, world_size, cfg: ModelConfig, tp: int, pp: int, files: dict, out: str, dtype: str):
    """One rank: build this rank's shard of the model, fill it from the safetensors files, save it."""
    meter = MemoryMeter()
    from megatron.core import dist_checkpointing

    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import describe_params, model_sharded_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("convert", ParallelLayout(tp=tp, pp=pp))])["convert"]
    # No initialization: Megatron-Core sets a weight's tensor-parallel attributes in its initializer, so that runs,
    # as a no-op, and in place (its device path: no full-size master weight as in its CPU path).
    overrides = {k: skip_init for k in ("init_method", "output_layer_init_method", "embedding_init_method")}
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=getattr(torch, dtype),
                            config_overrides=dict(overrides, use_cpu_initialization=False))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for d in describe_params(model, cfg, g.pgs.tp.rank(), g.pgs.tp.size()):
            fill_param(params[d.local_name], d, cfg, files)
    local_bytes = sum(p.numel() * p.element_size() for p in params.values())
    sharded = model_sharded_state_dict(model, g.pgs.dp_cp)
    _copy_views_releasing_params(sharded, model)
    dist_checkpointing.save(sharded, out)
    return dict(meter.report(), rank=rank, local_bytes=local_bytes)


def _check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConversionError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", cfg.num_query_groups),
                    ("ffn_hidden_size", cfg.ffn_hidden_size)):
        if n % tp:
            raise ConversionError(f"--tp {tp} does not divide {what}={n}")
    if cfg.num_layers % pp:
        raise ConversionError(f"--pp {pp} does not divide num_layers={cfg.num_layers}")


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
            fmt = json.loads((dst / META).read_text()).get("format")
        except (OSError, ValueError, AttributeError):
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
                              tp: int = 1, pp: int = 1) -> dict:
    from megatron_rl.launch.spawn import run_local

    start = time.perf_counter()
    meter = MemoryMeter()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    gguf = detect_format(src) == "gguf"
    if gguf:
        arch = gguf_architecture(src)
        if arch != "llama":
            raise ConversionError(f"{src}: architecture {arch!r} is not supported (GGUF files: only llama)")
    else:
        cfg = hf_model_config(src)
        _check_layout(cfg, tp, pp)
        files = hf_tensor_files(src, cfg)
    tmp = _prepare_dst(dst, overwrite)
    try:
        if gguf:
            cfg = _gguf_to_safetensors(src, tmp / "dequantized")
            _check_layout(cfg, tp, pp)
            files = hf_tensor_files(tmp / "dequantized", cfg)
        source_bytes = sum(os.path.getsize(f) for f in set(files.values()))
        (tmp / MODEL_DIR).mkdir()
        ranks = run_local(_save_megatron_worker, tp * pp, cfg, tp, pp, files, str(tmp / MODEL_DIR), dtype)
        if gguf:
            shutil.rmtree(tmp / "dequantized")
        tokenizer = save_tokenizer(src, tmp / TOKENIZER_DIR)
        meta = {"format": CONVERT_FORMAT, "dtype": dtype, "source": str(src), "layout": {"tp": tp, "pp": pp, "dp": 1},
                "model": dataclasses.asdict(cfg), "tokenizer": tokenizer,
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        model_bytes = sum(f.stat().st_size for f in (tmp / MODEL_DIR).iterdir())
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    parent = meter.report()
    return {"to": "megatron", "dst": str(dst), "parameters": cfg.num_parameters(tp), "layout": meta["layout"],
            "tokenizer": tokenizer is not None, "seconds": round(seconds, 2), "source_bytes": source_bytes,
            "model_bytes": model_bytes,
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


def _stored_box(reader: DistSliceReader, name: str, cfg: ModelConfig):
    """Where logical tensor `name` lives in a dist checkpoint: (key, offsets, sizes, shape)."""
    m = _LAYER.match(name)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        for cand in _STORED_ALIASES.get(suffix, (suffix,)):
            key = "decoder.layers." + cand
            if key in reader.tensors:
                size = tuple(reader.tensors[key].size)
                if size[0] != cfg.num_layers:
                    raise ConversionError(f"{reader.path}: {key} stacks {size[0]} layers, the config has "
                                          f"{cfg.num_layers}")
                return key, (layer,) + (0,) * (len(size) - 1), (1,) + size[1:], size[1:]
        raise ConversionError(f"{reader.path}: no tensor for {name} (looked for decoder.layers.{suffix})")
    if name not in reader.tensors:
        raise ConversionError(f"{reader.path}: tensor {name} missing")
    size = tuple(reader.tensors[name].size)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if size[0] < cfg.vocab_size:
            raise ConversionError(f"{reader.path}: {name} has {size[0]} rows, fewer than vocab_size={cfg.vocab_size}")
        size = (cfg.vocab_size,) + size[1:]  # drop the vocabulary padding of the layout it was written with
    return name, (0,) * len(size), size, size


def megatron_to_hf_checkpoint(src: Path, dst: Path, overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> dict:
    start = time.perf_counter()
    meter = MemoryMeter()
    try:
        ckpt = resolve_checkpoint(src)
        meta = read_checkpoint_meta(ckpt)
        dist_tensors(ckpt / MODEL_DIR)  # one-line error for a missing or half-written model/
        safe_load.check_checkpoint(ckpt)  # its pickles hold only data, before torch reads them
    except (InspectError, CheckpointError) as e:
        raise ConversionError(str(e)) from None
    if not meta.get("model"):
        raise ConversionError(f"{ckpt}: {META} records no model shape")
    cfg = model_config(meta)
    reader = DistSliceReader(ckpt / MODEL_DIR)
    names = megatron_names(cfg)
    boxes = {n: _stored_box(reader, n, cfg) for n in names}
    entries = []
    for n in names:
        key, _, _, shape = boxes[n]
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
            got = reader.read({boxes[n][0]: boxes[n][1:3] for n in group})
            for n in group:
                t = got.pop(boxes[n][0]).reshape(boxes[n][3])
                yield from to_hf_tensors(n, t, cfg)
                del t

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
            pp: int = 1, shard_bytes: int = SHARD_BYTES) -> dict:
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
        return hf_to_megatron_checkpoint(src, dst, dtype=dtype, overwrite=overwrite, tp=tp, pp=pp)
    if fmt != "megatron":
        raise ConversionError(f"{src} is a {fmt} source; --to hf converts megatron-rl checkpoints "
                              f"({CONVERT_FORMAT} or {TRAIN_FORMAT})")
    if (tp, pp) != (1, 1):
        raise ConversionError("--tp/--pp apply to --to megatron (reading a Megatron checkpoint needs no layout)")
    return megatron_to_hf_checkpoint(src, dst, overwrite=overwrite, shard_bytes=shard_bytes)


def read_meta(src: Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, metadata) of a conversion or training checkpoint."""
    meta = read_checkpoint_meta(Path(src))
    return model_config(meta), meta
