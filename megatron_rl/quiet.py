"""Silence the warnings of our dependencies that say nothing to a megatron-rl user, in every process we start.

Without these filters a CPU run of `megatron-rl train` shows them around its progress bar:
- Megatron-Core's "Transformer Engine and Apex are not installed" fallbacks and its CUDA_DEVICE_MAX_CONNECTIONS hint,
  which cannot apply on a machine without CUDA (with CUDA they stay visible: there a missing transformer-engine
  is worth knowing);
- torch's RMSNorm noting that bf16 activations with Megatron-Core's fp32 norm weights take its unfused path (on
  GPUs `build_gpt_model` replaces those norms with a fused one; on a CPU there is no faster path to take);
- torch's deprecation of `all_gather_into_tensor` / `reduce_scatter_tensor`, which Megatron-Core's distributed
  optimizer calls (nothing a user can change);
- multiprocessing's resource tracker counting the semaphores of ranks that were killed (a stop past its grace
  time, a failed job), which it then removes itself (its message has a colon: the filter is its first word).
Filters match the start of each message, so every other warning still shows. They are set in this process and,
through PYTHONWARNINGS, in every interpreter it starts (spawned ranks, fork servers, reward workers).
"""

from __future__ import annotations

import os
import re
import warnings

_ALWAYS = (
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
    ("resource_tracker", UserWarning),
    # Megatron-Core's checkpoint loads call torch's deprecated ShardedTensor and load_state_dict (on resume).
    ("`load_state_dict` is deprecated", FutureWarning),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)
_WITHOUT_CUDA = (
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("Mismatch dtype between input and weight", UserWarning),
    ("When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     UserWarning),
)


def filters(cuda: bool) -> tuple:
    return _ALWAYS + (() if cuda else _WITHOUT_CUDA)


def cuda_devices_present() -> bool:
    """Does this machine show NVIDIA devices? Read from /dev and the environment, not from torch: importing torch
    would cost the CLI seconds before it can print a config error."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or any(n.startswith("nvidia") and n[6:].isdigit()
                                                    for n in os.listdir("/dev"))


def install() -> None:
    """Add the filters to this process and to the environment its children inherit (idempotent). Call it before
    Megatron-Core is imported: most of these warnings are raised at import time."""
    entries = []
    for message, category in filters(cuda_devices_present()):
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        entries.append(f"ignore:{message}:{category.__name__}")
    present = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(present + [e for e in entries if e not in present])
