"""Reading a checkpoint without running code, whatever its files hold.

A pickle names functions and classes, and unpickling calls them: a checkpoint whose pickles are read with plain
`pickle.load` or `torch.load(weights_only=False)` runs whatever its author chose. Three kinds of pickle sit in a
checkpoint (`layout.py` says where), and each is read here with a loader that builds only what we store:

1. torch.distributed.checkpoint's index, `.metadata` in each dist_checkpointing directory (`model/`,
   `optimizer/`). torch reads it with `pickle.load`. `read_dcp_metadata` reads it with `_MetadataUnpickler`, which
   admits only torch's checkpoint-metadata classes (`_METADATA_GLOBALS`) and the torch types they hold, and
   `check_dist_dir` does so before Megatron-Core or torch reads the directory.
2. Objects inside the shards: dist_checkpointing stores non-tensor state (the layers' `_extra_state`) as
   `torch.save` blobs inside `__<rank>_<i>.distcp`, and torch reads them with `torch.load(weights_only=False)`.
   The index says where each blob lies; `check_dist_dir` reads each with `weights_only=True` first.
3. `torch.save` files: each dist_checkpointing directory's `common.pt`, `rng/rank_*.pt`, `rl_state.pt`. They are
   read with `load_data`, torch's `weights_only=True` loader: tensors, numbers, strings, and lists, tuples and
   dicts of those.

A file that names anything else is a CheckpointError in one line naming the file and what it named, and nothing
from it has run. `check_checkpoint` checks every pickled file of a checkpoint directory (the entries: `inspect`,
`eval`, `convert`; training checks its share on each rank before it resumes, `TrainCheckpointer.verify`).
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Optional

from megatron_rl.checkpointing.layout import DCP_METADATA, RNG_DIR, CheckpointError, first_line

# What torch's distributed-checkpoint `.metadata` is built from (torch 2.x): the index and its entries, the save
# plans it keeps (`all_local_plans`), and the path it was saved to (`StorageMeta.checkpoint_id`, a `pathlib` path
# where the writer was given one). Besides these: torch's dtypes.
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}  # built from their parts: no side effect
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout (torch.strided) by name: a table lookup
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,  # where Python 3.13 defines them
}
COMMON = "common.pt"  # Megatron-Core's non-sharded state of a dist_checkpointing directory
_REFUSED = "which a checkpoint may not hold (unpickling would call it); nothing in it was run"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch's checkpoint metadata and nothing else: any other global stops the load before it is
    called (`find_class` is the one door through which a pickle reaches a function or class)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A global that a checkpoint's pickle may not name (its dotted name is the message)."""


def read_dcp_metadata(d: Path):
    """The torch.distributed.checkpoint `Metadata` of directory `d`, read by `_MetadataUnpickler`; CheckpointError
    (one line) when `.metadata` names anything else or is not torch's metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    f = Path(d) / DCP_METADATA
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except _Refused as e:
        raise CheckpointError(f"{f}: holds {e}, {_REFUSED}") from None
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle, reported the same way
        raise CheckpointError(f"{f}: unreadable ({first_line(e)})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{f}: holds a {type(md).__name__}, not torch's checkpoint metadata")
    return md


def _refusal(e: BaseException, source) -> str:
    """What torch's weights_only loader refused: the global its error names, else the first global a bare pickle
    names (torch reads a file that is not a zip archive as a bare pickle, and its error then names only an
    opcode), else the error's own words."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    if m:
        return m.group(1)
    try:
        if isinstance(source, io.BytesIO):
            data = source.getvalue()
        else:
            with open(source, "rb") as fh:
                data = fh.read(1 << 20)
        named = _pickle_globals(data)
    except (OSError, ValueError):
        named = []
    if named:
        return named[0]
    m = re.search(r"WeightsUnpickler error: \s*([^\n]+)", str(e))
    return f"a pickle torch's weights-only loader refuses ({m.group(1).strip() if m else first_line(e)})"


def _pickle_globals(data: bytes) -> list[str]:
    """The globals a bare pickle names, in order, read from its opcodes without running it (empty for a zip
    archive, torch's own format, whose errors name them)."""
    import pickletools

    if data[:2] == b"PK":
        return []
    out, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                out.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                out.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - a garbled tail: what was read so far
        pass
    return out


def _numpy_arrays() -> list:
    """The numpy globals an array pickles as, under the names numpy 1 and numpy 2 give them (building an array
    from its dtype and bytes runs no code of the file's choosing)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [np.ndarray, np.dtype, (rebuild, "numpy.core.multiarray._reconstruct"),
            (rebuild, "numpy._core.multiarray._reconstruct"), *(
                [type(np.dtype(np.uint32))] if hasattr(np, "dtypes") else [])]


def load_data(source, name: Optional[Path] = None, numpy_arrays: bool = False) -> Any:
    """`torch.load(source, weights_only=True)` onto the CPU, with numpy arrays admitted when `numpy_arrays`. A file
    that names anything else is a CheckpointError naming it (`name`, else `source`) and what it named."""
    import torch

    where = name if name is not None else source
    try:
        with torch.serialization.safe_globals(_numpy_arrays() if numpy_arrays else []), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on a bare pickle's protocol: the error says it all
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{where}: holds {_refusal(e, source)}, {_REFUSED}") from None
    except OSError as e:
        raise CheckpointError(f"{where}: unreadable ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a garbled file
        raise CheckpointError(f"{where}: unreadable ({first_line(e)})") from None


def _check_blobs(d: Path, md) -> None:
    """Each non-tensor entry of the index (a `torch.save` blob in a shard, which torch loads with
    weights_only=False) read first with `load_data`; where the index says it lies is checked too (a file of `d`,
    a range inside it)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    blobs = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    by_file: dict[str, list] = {}
    for index, info in (md.storage_data or {}).items():
        if getattr(index, "fqn", None) in blobs:
            by_file.setdefault(str(info.relative_path), []).append((index.fqn, info))
    for rel, items in sorted(by_file.items()):
        f = Path(d) / rel
        if Path(rel).name != rel or rel in (".", "..") or not f.is_file():
            raise CheckpointError(f"{d / DCP_METADATA}: places {items[0][0]} in {rel!r}, not a file of {d}")
        size = f.stat().st_size
        with open(f, "rb") as fh:
            for fqn, info in items:
                if info.transform_descriptors:
                    raise CheckpointError(f"{f}: {fqn} is stored transformed ({list(info.transform_descriptors)}), "
                                          f"which this check does not read")
                if not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= size):
                    raise CheckpointError(f"{d / DCP_METADATA}: places {fqn} outside {f.name}")
                fh.seek(info.offset)
                load_data(io.BytesIO(fh.read(info.length)), name=f"{f} ({fqn})")


def check_dist_dir(d: Path) -> None:
    """Every pickle of the dist_checkpointing directory `d` (its index, the blobs in its shards, `common.pt`)
    holds only what a checkpoint may hold, and its index holds every element of every tensor exactly once
    (`coverage.py`); else CheckpointError naming the file, in one line."""
    from megatron_rl.checkpointing.coverage import check_coverage

    d = Path(d)
    md = read_dcp_metadata(d)
    check_coverage(d, md)
    try:
        _check_blobs(d, md)
    except (AttributeError, TypeError) as e:  # built from the admitted classes, but not as torch builds them
        raise CheckpointError(f"{d / DCP_METADATA}: malformed ({first_line(e)})") from None
    if (d / COMMON).is_file():
        load_data(d / COMMON)


def pickled_files(ckpt: Path) -> list[str]:
    """The pickled files of checkpoint directory `ckpt`, relative, sorted: each dist_checkpointing directory's
    index (which stands for the directory: `check_file` checks its blobs and `common.pt` too) and every `*.pt`
    outside those directories (`rng/rank_*.pt`, `rl_state.pt`)."""
    ckpt = Path(ckpt)
    indexes = [p for p in ckpt.rglob(DCP_METADATA) if p.is_file()]
    dist_dirs = {p.parent for p in indexes}
    files = indexes + [p for p in ckpt.rglob("*.pt") if p.is_file() and p.parent not in dist_dirs]
    return sorted(str(p.relative_to(ckpt)) for p in files)


def check_file(ckpt: Path, rel: str) -> None:
    """Check one entry of `pickled_files` (an index checks its whole directory)."""
    f = Path(ckpt) / rel
    if f.name == DCP_METADATA:
        check_dist_dir(f.parent)
    else:  # RNG files written before the states were stored as tensors hold numpy's as an array
        load_data(f, numpy_arrays=Path(rel).parts[0] == RNG_DIR)


def problems(ckpt: Path, files: Optional[list[str]] = None) -> list[str]:
    """The one-line refusal of each of `files` (default: all `pickled_files`) that holds anything a checkpoint
    may not; empty when all are data."""
    out = []
    for rel in pickled_files(ckpt) if files is None else files:
        try:
            check_file(ckpt, rel)
        except CheckpointError as e:
            out.append(str(e))
    return out


def check_checkpoint(ckpt: Path) -> None:
    """Raise CheckpointError (the first file's line) unless every pickled file of `ckpt` holds only data."""
    found = problems(ckpt)
    if found:
        more = f" (and {len(found) - 1} more files)" if len(found) > 1 else ""
        raise CheckpointError(found[0] + more)
