"""dtype "auto": bf16 exactly where the hardware multiplies bf16 natively."""

from pathlib import Path

import pytest
import torch

from megatron_rl.models.precision import native_bf16, resolve_dtype, resolve_dtype_name


@pytest.mark.skipif(torch.cuda.is_available() or not Path("/proc/cpuinfo").is_file(), reason="a Linux CPU machine")
def test_auto_follows_the_cpu_flags():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    want = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert native_bf16() == want
    assert resolve_dtype("auto") == (torch.bfloat16 if want else torch.float32)


def test_explicit_names_pass_through_and_unknown_ones_are_refused():
    assert resolve_dtype_name("fp32") == "fp32" and resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype_name("fp8")
