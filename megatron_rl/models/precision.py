"""Parameter precision of an executor: `trainer.dtype` / `generator.dtype` ("auto", "fp32", "bf16").

"auto" is bf16 wherever the hardware multiplies bf16 natively and fp32 elsewhere:
- a CUDA GPU with bf16 support (Ampere and newer);
- a CPU with AVX-512 BF16 or AMX instructions, where torch's bf16 matmul (oneDNN) runs several times faster than
  its fp32 one and the weights are half the bytes to read (`docs/benchmarks.md`, "CPU precision");
- fp32 on any other CPU, where bf16 arithmetic is emulated and slower than fp32.

A bf16 trainer keeps fp32 main weights and optimizer state (Megatron-Core's mixed-precision optimizer), as on GPUs;
the generator samples from bf16 weights and AIPO's importance weights absorb the small mismatch.
"""

from __future__ import annotations

import functools

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Does this process's compute device multiply bf16 natively?"""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None and fn():
            return True
    return False


def resolve_dtype_name(name: str) -> str:
    """"auto" -> "bf16" or "fp32" for this machine; explicit names unchanged."""
    if name == "auto":
        return "bf16" if native_bf16() else "fp32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected 'auto', 'fp32' or 'bf16'")
    return name


def resolve_dtype(name: str) -> torch.dtype:
    return DTYPES[resolve_dtype_name(name)]
