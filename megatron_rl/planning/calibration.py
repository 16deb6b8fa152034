"""Per-device rates for the planner, read from a YAML file in which every number names its source.

    calibration = load_calibration()               # the H100 file shipped next to this module
    calibration = load_calibration("mine.yaml")    # your own measurements, same keys

A file holds `device` (a name) and, for every key of `Calibration`, a mapping `{value: ..., source: "..."}`.
A missing key, a missing or empty source, or a value of the wrong kind is a `CalibrationError` naming the key:
a number nobody can trace is not accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import yaml

DEFAULT_FILE = Path(__file__).with_name("h100.yaml")


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message is one line naming the file and the key."""


@dataclass(frozen=True)
class Calibration:
    """Rates of one device. Rates are per GPU; bandwidths in GB/s (1e9 bytes), compute in TFLOP/s."""

    device: str
    fused_kernels: bool  # the builder's GPU fusions are on (selects the activation model)
    gpu_memory_gib: float
    reserve_gib: float  # kept free per GPU for the CUDA context, communicators and allocator slack
    hbm_bandwidth_gbps: float
    decode_efficiency: float  # share of hbm_bandwidth a decode step reaches reading weights and KV cache
    baseline_decode_efficiency: float  # the same for the synchronous baseline's generation engine
    peak_tflops: float
    train_mfu: float
    prefill_mfu: float
    nvlink_gbps: float  # per GPU, each way
    infiniband_gbps: float  # per GPU, each way
    gpus_per_node: int
    host_copy_gbps: float  # per GPU, device to pinned host memory (a checkpoint's copy out of the training tensors)
    filesystem_write_gbps: float  # per node, durable writes to the checkpoint filesystem
    filesystem_read_gbps: float  # per node, reads from it
    sources: dict  # key -> source text

    def source(self, key: str) -> str:
        return self.sources[key]


_KINDS = {f.name: f.type for f in dataclasses.fields(Calibration) if f.name not in ("device", "sources")}


def load_calibration(path: Optional[Union[str, Path]] = None) -> Calibration:
    """Read and check a calibration file (default: the shipped H100 file)."""
    p = Path(path) if path is not None else DEFAULT_FILE
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise CalibrationError(f"calibration file {str(p)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise CalibrationError(f"calibration file {str(p)!r}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("device"), str):
        raise CalibrationError(f"calibration file {str(p)!r}: expected a mapping with a 'device' name")
    values, sources = {}, {}
    for key, kind in _KINDS.items():
        entry = data.get(key)
        if not isinstance(entry, dict) or "value" not in entry:
            raise CalibrationError(f"calibration file {str(p)!r}: {key} is missing (expected {{value: ..., "
                                   f"source: ...}})")
        source = entry.get("source")
        if not isinstance(source, str) or not source.strip():
            raise CalibrationError(f"calibration file {str(p)!r}: {key} has no source; every number must say "
                                   f"where it comes from")
        value = entry["value"]
        ok = isinstance(value, bool) if kind == "bool" else (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
        if not ok:
            raise CalibrationError(f"calibration file {str(p)!r}: {key}={value!r} must be "
                                   f"{'true or false' if kind == 'bool' else 'a positive number'}")
        values[key] = int(value) if kind == "int" else value
        sources[key] = " ".join(source.split())
    unknown = sorted(set(data) - set(_KINDS) - {"device"})
    if unknown:
        raise CalibrationError(f"calibration file {str(p)!r}: unknown key {unknown[0]!r}")
    for key in ("decode_efficiency", "baseline_decode_efficiency", "train_mfu", "prefill_mfu"):
        if values[key] > 1:
            raise CalibrationError(f"calibration file {str(p)!r}: {key}={values[key]} must be at most 1")
    return Calibration(device=data["device"], sources=sources, **values)
