"""What a checkpoint looks like on disk, and the one place that reads and writes it: names, formats, the metadata
file, the step directories of a run, the `latest` pointer, the manifest check, and the errors that name a bad one.

The one module every other module reads these from (nobody else parses `megatron_rl.json` or reads its keys: they
take `CheckpointMeta`'s fields; nobody else lists step directories or touches `latest`); it imports nothing from the
project but `ModelConfig`, when `CheckpointMeta.model_config` parses the model's entry.

    DIR/megatron_rl.json      META: format (CONVERT_FORMAT or TRAIN_FORMAT), model shape, tokenizer, ... and its
                              manifest under MANIFEST (every file with its size) and each file's CRC-32 under
                              CHECKSUMS (`record_files`; absent in checkpoints written before checksums):
                              `read_meta`, `write_meta`; `verify` checks a training checkpoint against it,
                              `verify_weights` the files a reader of the weights reads, in either format
    DIR/model/                MODEL_DIR: Megatron-Core dist_checkpointing (torch_dist), DCP_METADATA inside
    DIR/optimizer/            OPTIMIZER_DIR (training checkpoints)
    DIR/rng/rank_00000.pt     RNG_DIR (training checkpoints)
    DIR/rl_state.pt           RL_STATE (training checkpoints)
    DIR/tokenizer/            TOKENIZER_DIR (when the checkpoint carries its tokenizer's files)
    ROOT/step_00000042/       a run's checkpoint, named by `step_dir_name` (`list_checkpoints`); `*.tmp` names are
                              writes in progress or killed (`unfinished_writes`, `remove_unfinished`)
    ROOT/latest               LATEST: the name of the newest complete checkpoint (`read_latest`; `publish` renames
                              a finished write and points `latest` at it)
    ROOT/.step_00000042.removed/  a checkpoint that retention is deleting (`retire`, `retired`): hidden from readers
    ROOT/.readers/, .readers.lock the leases of processes reading the run's checkpoints (`leases.py`)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

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


class ConversionError(ValueError):
    """A conversion that cannot run (its source, destination or options); the message is one line."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line error quotes."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---- the metadata file ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's META, read once by `read_meta`: every field the project reads, each checked for its type
    there (one line naming the field and the file), so no other module parses the file or its keys.

    format: CONVERT_FORMAT or TRAIN_FORMAT. step, weight_version, world_size, optimizer_state, optimizer_format:
    a training save's (None in a conversion's). layout: the trainer layout it was written with, as written ({"tp",
    "pp", "dp", ...}). dtype: the weights' dtype, torch's name ("float32"). model: the model's shape, as written
    (`model_config` parses it). tokenizer: the entry of the tokenizer it carries or names (`tokenizer.py`).
    source: what a conversion read. files / checksums: the manifest, each file's size and CRC-32. extra: every other
    key (a save's `extra`)."""

    path: Path
    format: Optional[str]
    step: Optional[int] = None
    weight_version: Optional[int] = None
    layout: Optional[dict] = None
    world_size: Optional[int] = None
    dtype: Optional[str] = None
    model: Optional[dict] = None
    tokenizer: Optional[dict] = None
    optimizer_state: Optional[bool] = None
    optimizer_format: Optional[str] = None
    source: Optional[str] = None
    files: dict = dataclasses.field(default_factory=dict)
    checksums: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def is_training(self) -> bool:
        return self.format == TRAIN_FORMAT

    @property
    def torch_dtype_name(self) -> str:
        """The weights' dtype as torch names it ("float32" when the metadata does not say)."""
        return (self.dtype or "float32").replace("torch.", "")

    def trainer_layout(self):
        """The trainer layout the checkpoint was written with, as a `ParallelLayout` (None when it records none)."""
        from megatron_rl.parallel.layout import ParallelLayout

        if not self.layout:
            return None
        try:
            return ParallelLayout(**self.layout)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{Path(self.path) / META}: bad layout entry ({first_line(e)})") from None

    def model_config(self):
        """The model's shape as a `ModelConfig`: the one parser of the entry. Fields it lacks take their defaults
        (a checkpoint written before they existed); a field this version does not know is a CheckpointError naming
        it (a newer version's model may not be the one this code would build)."""
        from megatron_rl.models.presets import ModelConfig

        if self.model is None:
            raise CheckpointError(f"{self.path}: {META} records no model shape")
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            fields = f"field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
            raise CheckpointError(f"{Path(self.path) / META}: the model entry has {fields}, which this version does "
                                  f"not know (written by a newer megatron-rl?)")
        try:
            return ModelConfig(**self.model)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{Path(self.path) / META}: bad model entry ({first_line(e)})") from None


# The fields of META with their types (None is always allowed: absent, or written before the field existed).
_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "step": (int,), "weight_version": (int,), "layout": (dict,), "world_size": (int,),
    "dtype": (str,), "model": (dict,), "tokenizer": (dict,), "optimizer_state": (bool,), "optimizer_format": (str,),
    "source": (str,), MANIFEST: (dict,), CHECKSUMS: (dict,)}


def layout_entry(layout) -> dict:
    """A `ParallelLayout` as META records it, the one way every writer does: tp, pp and dp, and ep and etp where
    they are not the default (`CheckpointMeta.trainer_layout` reads it back)."""
    entry = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    if layout.ep != 1:
        entry["ep"] = layout.ep
    if layout.etp != layout.tp:
        entry["etp"] = layout.etp
    return entry


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def training_meta(*, step: int, weight_version: int, layout, world_size: int, dtype: Optional[str], model,
                  tokenizer: Optional[dict], optimizer_state: Optional[bool], optimizer_format: str,
                  extra: Optional[dict] = None) -> dict:
    """The META of a training save (`training.TrainCheckpointer`), before its manifest: every key it holds is
    spelled here, as `CheckpointMeta` reads them (`extra`: the save's own keys, kept as they are)."""
    return {"format": TRAIN_FORMAT, "step": step, "weight_version": weight_version,
            "layout": layout_entry(layout) if layout is not None else None, "world_size": world_size,
            "dtype": dtype, "model": dataclasses.asdict(model) if model is not None else None,
            "tokenizer": tokenizer, "saved_at": _now(), "optimizer_state": optimizer_state,
            "optimizer_format": optimizer_format, **(extra or {})}


def conversion_meta(*, dtype: str, source: str, layout, model, tokenizer: Optional[dict]) -> dict:
    """The META of a conversion (`hf_to_megatron.py`), before its manifest."""
    return {"format": CONVERT_FORMAT, "dtype": dtype, "source": source, "layout": layout_entry(layout),
            "model": dataclasses.asdict(model), "tokenizer": tokenizer, "converted_at": _now()}


def _parse_meta(ckpt: Path, raw: Any) -> CheckpointMeta:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{ckpt}: {META} does not hold a JSON object")
    for key, types in _TYPES.items():
        value = raw.get(key)
        if value is not None and (not isinstance(value, types) or (types == (int,) and isinstance(value, bool))):
            raise CheckpointError(f"{Path(ckpt) / META}: {key} is {value!r}, not a {types[0].__name__}")
    known = {k: raw.get(k) for k in _TYPES if k not in (MANIFEST, CHECKSUMS)}
    return CheckpointMeta(path=Path(ckpt), files=raw.get(MANIFEST) or {}, checksums=raw.get(CHECKSUMS) or {},
                          extra={k: v for k, v in raw.items() if k not in _TYPES}, **known)


def read_meta(ckpt: Path, formats: Optional[tuple[str, ...]] = FORMATS) -> CheckpointMeta:
    """The metadata of checkpoint directory `ckpt` (its META), parsed (`CheckpointMeta`). CheckpointError in one
    line when the file is missing, unreadable, not a JSON object, holds an ill-typed field, or (unless `formats` is
    None) records a format not among `formats`."""
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: incomplete checkpoint ({META} missing)") from None
    except OSError as e:
        raise CheckpointError(f"{ckpt}: cannot read {META} ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{ckpt}: {META} is not valid JSON ({e})") from None
    if formats is not None and (not isinstance(meta, dict) or meta.get("format") not in formats):
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{ckpt}: unknown checkpoint format {fmt!r} in {META} (expected one of "
                              f"{list(formats)})")
    return _parse_meta(Path(ckpt), meta)


def write_meta(ckpt: Path, meta: dict) -> None:
    """Write checkpoint `ckpt`'s META, flushed to the disk before it returns (it is written last: a checkpoint
    whose META is complete is complete)."""
    _fsync_write(Path(ckpt) / META, json.dumps(meta, indent=2))


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- a run's step directories and its `latest` pointer -----------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every directory under `root` named after a step (complete, unfinished `.tmp` writes, anything else that
    starts with `step_<number>`), as (step, path), by step then name."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_PREFIX.match(p.name)) and p.is_dir()]
    return sorted(found, key=lambda sp: (sp[0], sp[1].name))


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories under `root` (`step_<8 digits>`), as (step, path), oldest first."""
    return [(step, p) for step, p in step_dirs(root) if STEP_DIR.match(p.name)]


def unfinished_writes(root: Path) -> list[Path]:
    """The `step_*.tmp` directories under `root`: saves in progress, or that failed or were killed midway."""
    return [p for _, p in step_dirs(root) if p.name.endswith(".tmp")]


def remove_unfinished(root: Path) -> tuple[list[str], int]:
    """Delete the `step_*.tmp` directories under `root` (saves that failed or were killed midway: never read; they
    would hold the space the next save needs); (their names, the bytes they held)."""
    names, freed = [], 0
    for p in unfinished_writes(root):
        freed += dir_bytes(p)
        shutil.rmtree(p, ignore_errors=True)
        names.append(p.name)
    return names, freed


def read_latest(root: Path, must_exist: bool = False) -> Optional[Path]:
    """The checkpoint `ROOT/latest` names, or None when there is no pointer. CheckpointError when the pointer does
    not name a step directory or, with `must_exist`, names one that does not exist (without, that is for the
    caller to judge: `verify` says it)."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: does not name a checkpoint directory (content {name!r})")
    if must_exist and not (Path(root) / name).is_dir():
        raise CheckpointError(f"{pointer}: names {name}, which does not exist")
    return Path(root) / name


def publish(tmp: Path, final: Path) -> None:
    """Complete a save whose files and META are written into `tmp` (`ROOT/step_N.tmp`): rename it to `final`
    (replacing an earlier checkpoint of the same step, e.g. a resume that repeats it), then point `latest` at it
    through an atomic replace. Both are flushed to the disk, so `latest` never names a partial write."""
    final = Path(final)
    root = final.parent
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / f"{LATEST}.tmp"
    _fsync_write(pointer_tmp, final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)


RETIRED = ".removed"  # the suffix of a checkpoint being deleted by retention, under a hidden name


def retire(ckpt: Path) -> Path:
    """Rename checkpoint `ckpt` to a hidden name that no reader resolves (atomic), to be deleted after; returns
    the new path."""
    ckpt = Path(ckpt)
    hidden = ckpt.with_name(f".{ckpt.name}{RETIRED}")
    os.rename(ckpt, hidden)
    return hidden


def retired(root: Path) -> list[Path]:
    """The checkpoints under `root` that `retire` renamed and that are not deleted yet (also those of a job killed
    between the two)."""
    root = Path(root)
    return sorted(p for p in root.glob(f".step_*{RETIRED}") if p.is_dir()) if root.is_dir() else []


def removed_line(path: Path) -> Optional[str]:
    """The line for a checkpoint `ROOT/step_N` that does not exist while `root` has newer ones: retention removed
    it (None when `path` is not a step directory of a run with a newer checkpoint)."""
    path = Path(path)
    m = STEP_DIR.match(path.name)
    if not m or path.exists():
        return None
    newer = [p for step, p in list_checkpoints(path.parent) if step > int(m.group(1))]
    if not newer:
        return None
    try:
        newest = read_latest(path.parent, must_exist=True) or newer[-1]
    except CheckpointError:
        newest = newer[-1]
    return f"{path}: removed by the run's checkpoint retention (checkpoint.keep_last); the newest is {newest}"


def rng_file(ckpt: Path, rank: int) -> Path:
    """Where checkpoint `ckpt` keeps the RNG states of `rank` (`rng.py`)."""
    return Path(ckpt) / RNG_DIR / f"rank_{rank:05d}.pt"


def dir_bytes(path: Path) -> int:
    """The bytes of the files under `path` (a file: its size; nothing there: 0); a file that vanishes meanwhile
    counts 0."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


# ---- the manifest: sizes and checksums ---------------------------------------------------------------------------
def manifest(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path) with its size: what a checkpoint records under MANIFEST."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(Path(root).rglob("*")) if p.is_file()}


def manifest_problems(ckpt: Path, files: dict[str, int]) -> list[str]:
    """How the files of checkpoint `ckpt` differ from `files` (its manifest, or part of it: relative path -> size),
    one phrase per file (empty when they match, or when there is no manifest)."""
    problems = []
    for rel, size in files.items():
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


def checksum_mismatches(ckpt: Path, meta: CheckpointMeta, files: Optional[list[str]] = None) -> list[str]:
    """The files of checkpoint `ckpt` (all, or those of `files`) whose content differs from the checksum in its
    metadata, by relative path. Missing files are `manifest_problems`'s to report; a checkpoint written without
    checksums has none to differ."""
    sums = meta.checksums
    present = [rel for rel in (sorted(sums) if files is None else files) if rel in sums and (Path(ckpt) / rel).is_file()]
    found = file_checksums(Path(ckpt), present)
    return [rel for rel in present if found[rel] != sums[rel]]


def mismatch_line(ckpt: Path, mismatches: list[str]) -> str:
    """The one line naming the files of `checksum_mismatches` (the first by path, and how many more)."""
    more = f" (and {len(mismatches) - 1} more files)" if len(mismatches) > 1 else ""
    return f"{Path(ckpt) / mismatches[0]}: {CHECKSUM_MISMATCH}{more}"


def record_files(ckpt: Path, meta: dict) -> dict:
    """`meta` with the manifest and the checksums of every file written into `ckpt` so far (all but META, which is
    written last): what a conversion records, as a training save does."""
    files = manifest(ckpt)
    return {**meta, MANIFEST: files, CHECKSUMS: file_checksums(Path(ckpt), list(files))}


def files_problem(ckpt: Path, meta: CheckpointMeta, files: list[str], checksums: bool = False) -> Optional[str]:
    """What is wrong with `files` (relative paths) of checkpoint `ckpt` as a reader will read them, in one line, or
    None: the first that is missing, or whose size differs from the manifest in `meta` (a stat each), and with
    `checksums` the first whose content differs from its checksum (this reads them). A file the manifest does not
    list must exist."""
    ckpt, sizes = Path(ckpt), meta.files
    missing = [rel for rel in files if rel not in sizes and not (ckpt / rel).is_file()]
    if missing:
        return f"{ckpt / missing[0]}: missing"
    problems = manifest_problems(ckpt, {rel: sizes[rel] for rel in files if rel in sizes})
    if problems:
        return f"{ckpt}: corrupt checkpoint ({problems[0]})"
    if checksums:
        mismatches = checksum_mismatches(ckpt, meta, sorted(files))
        if mismatches:
            return mismatch_line(ckpt, mismatches)
    return None


def verify_weights(ckpt: Path, meta: CheckpointMeta, part: slice = slice(None)) -> None:
    """Check the files a reader of the weights reads (MODEL_DIR and TOKENIZER_DIR; `part` of them, by path: rank r
    of w checks `slice(r, None, w)`) against the manifest and the checksums in `meta` (a converted or a training
    checkpoint; one written without them has nothing to check): CheckpointError in one line naming the first file
    that is missing, truncated or changed (`mismatch_line`)."""
    read = (MODEL_DIR + "/", TOKENIZER_DIR + "/")
    files = sorted(rel for rel in {*meta.files, *meta.checksums} if rel.startswith(read))[part]
    problem = files_problem(Path(ckpt), meta, files, checksums=True)
    if problem:
        raise CheckpointError(problem)


def verify(path: Path, checksums: bool = False) -> CheckpointMeta:
    """Check a training checkpoint is complete (every file of the manifest present with its size) and, with
    `checksums`, unmodified (every file's content matches its checksum; this reads every file); returns its
    metadata, else raises CheckpointError naming what is wrong in one line."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if ".tmp" in path.name:
        raise CheckpointError(f"{path}: incomplete checkpoint (a write that never finished)")
    meta = read_meta(path, formats=None)
    if not meta.is_training:
        raise CheckpointError(f"{path}: not a training checkpoint (format {meta.format!r})")
    problems = manifest_problems(path, meta.files)
    if problems:
        raise CheckpointError(f"{path}: corrupt checkpoint ({problems[0]})")
    if checksums:
        mismatches = checksum_mismatches(path, meta)
        if mismatches:
            raise CheckpointError(mismatch_line(path, mismatches))
    return meta
