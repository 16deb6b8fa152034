"""What a checkpoint looks like on disk: file and directory names, formats, the errors that name a bad one.

The one module every other `checkpointing` module reads these from; it imports nothing from the project.

    DIR/megatron_rl.json      META: format (CONVERT_FORMAT or TRAIN_FORMAT), model shape, tokenizer, ... and, in a
                              training checkpoint, its manifest under MANIFEST (every file with its size) and
                              each file's CRC-32 under CHECKSUMS (absent in checkpoints written before checksums)
    DIR/model/                MODEL_DIR: Megatron-Core dist_checkpointing (torch_dist), DCP_METADATA inside
    DIR/optimizer/            OPTIMIZER_DIR (training checkpoints)
    DIR/rng/rank_00000.pt     RNG_DIR (training checkpoints)
    DIR/rl_state.pt           RL_STATE (training checkpoints)
    DIR/tokenizer/            TOKENIZER_DIR (when the checkpoint carries its tokenizer's files)
    ROOT/step_00000042/       a run's checkpoint, named by `step_dir_name`; `*.tmp` names are writes in progress
    ROOT/latest               LATEST: the name of the newest complete checkpoint
"""

from __future__ import annotations

import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

META = "megatron_rl.json"
CONVERT_FORMAT = "megatron-rl/dist_checkpointing"
TRAIN_FORMAT = "megatron-rl/train"
FORMATS = (CONVERT_FORMAT, TRAIN_FORMAT)
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
RNG_DIR = "rng"
RL_STATE = "rl_state.pt"
TOKENIZER_DIR = "tokenizer"
MANIFEST = "files"  # the key of META that holds the manifest
CHECKSUMS = "checksums"  # the key of META that holds each file's checksum, "crc32:<8 hex digits>"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a dist_checkpointing directory
LATEST = "latest"

STEP_DIR = re.compile(r"^step_(\d{8})$")  # a complete-looking checkpoint directory
STEP_PREFIX = re.compile(r"^step_(\d+)")  # any checkpoint directory, including unfinished `.tmp` writes


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong, in one line."""


class InspectError(ValueError):
    """A path that is not a usable checkpoint; the message is one line naming the path and what is missing."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def read_latest(root: Path) -> Optional[Path]:
    """The checkpoint `ROOT/latest` names, or None when there is no pointer (it may name a directory that does not
    exist; that is for the caller to judge)."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: does not name a checkpoint directory (content {name!r})")
    return Path(root) / name


def manifest(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path) with its size: what a checkpoint records under MANIFEST."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(Path(root).rglob("*")) if p.is_file()}


def manifest_problems(ckpt: Path, meta: dict) -> list[str]:
    """How the files of checkpoint `ckpt` differ from the manifest in its metadata, one phrase per file (empty when
    they match, or when there is no manifest)."""
    problems = []
    for rel, size in (meta.get(MANIFEST) or {}).items():
        f = Path(ckpt) / rel
        if not f.is_file():
            problems.append(f"{rel} missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {size} were written")
    return problems


_CHUNK = 8 << 20


def file_checksum(path: Path) -> str:
    """The CRC-32 of a file, read in large chunks into one buffer. CRC-32 rather than a cryptographic hash: it
    catches flipped bits and partial copies (not tampering) at several GB/s, several times blake2b's speed here,
    so hashing stays small next to writing the file (benchmarks/checkpoint_checksum.py)."""
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"crc32:{crc:08x}"


def file_checksums(root: Path, files: list[str]) -> dict[str, str]:
    """`file_checksum` of each of `files` (relative to `root`), several files at a time: reading and zlib's CRC
    release the GIL, so a node's cores share the work (one file per thread)."""
    files = list(files)
    if len(files) <= 1:
        return {rel: file_checksum(Path(root) / rel) for rel in files}
    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1, 8), thread_name_prefix="checksum") as pool:
        return dict(zip(files, pool.map(lambda rel: file_checksum(Path(root) / rel), files)))


CHECKSUM_MISMATCH = "checksum mismatch (flipped bits or a partial copy)"


def checksum_mismatches(ckpt: Path, meta: dict, files: Optional[list[str]] = None) -> list[str]:
    """The files of checkpoint `ckpt` (all, or those of `files`) whose content differs from the checksum in its
    metadata, by relative path. Missing files are `manifest_problems`'s to report; a checkpoint written without
    checksums has none to differ."""
    sums = meta.get(CHECKSUMS) or {}
    present = [rel for rel in (sorted(sums) if files is None else files) if rel in sums and (Path(ckpt) / rel).is_file()]
    found = file_checksums(Path(ckpt), present)
    return [rel for rel in present if found[rel] != sums[rel]]
