"""Where a conversion writes (`convert.py`): what --overwrite may replace, the temporary directory renamed into
place at the end, and the memory a conversion used."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from megatron_rl.checkpointing.inspect import is_run_root
from megatron_rl.checkpointing.layout import (CONVERT_FORMAT, META, TRAIN_FORMAT, CheckpointError, ConversionError,
                                              read_meta)


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


def overwrite_problem(dst: Path) -> Optional[str]:
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


def check_destination(dst: Path, overwrite: bool) -> None:
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise ConversionError(f"{dst} exists (pass --overwrite to replace it)")
    problem = overwrite_problem(dst)
    if problem:
        raise ConversionError(f"{dst} {problem}: --overwrite only replaces an empty directory, a converted "
                              f"checkpoint or a Hugging Face model directory; not deleting it")


def prepare_destination(dst: Path, overwrite: bool) -> Path:
    check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=dst.name + ".tmp.", dir=dst.parent))


def finish_destination(tmp: Path, dst: Path) -> None:
    if dst.is_dir():
        shutil.rmtree(dst)
    elif dst.exists():
        dst.unlink()
    tmp.rename(dst)


def mb(n: Optional[int]) -> Optional[float]:
    return None if n is None else round(n / 2**20, 1)
