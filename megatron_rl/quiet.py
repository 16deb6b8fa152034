"""Silence the warnings of our dependencies that say nothing a megatron-rl user can act on, in every process we
start; what one of them meant is said once, as a fact, in the job's banner (`kernels_text`).

Without these filters `megatron-rl train` shows them around its progress bar, several times per rank:
- Megatron-Core's "Transformer Engine and Apex are not installed" fallbacks and its CUDA_DEVICE_MAX_CONNECTIONS
  hint (the banner says which of them the job has, and which kernels it uses instead);
- torch's RMSNorm noting that bf16 activations with Megatron-Core's fp32 norm weights take its unfused path (on
  GPUs `build_gpt_model` replaces those norms with a fused one; on a CPU there is no faster path to take);
- torch's deprecation of `all_gather_into_tensor` / `reduce_scatter_tensor`, `load_state_dict` and ShardedTensor,
  which Megatron-Core calls (nothing a user can change);
- Megatron-Core asking for sequence parallelism with expert and tensor parallelism: our MoE layer splits its tokens
  over TP itself (`models/moe.py`), which is all that warning is about;
- torch's NCCL `barrier()` noting that it uses the device of the current context (each rank's own GPU, by design);
- multiprocessing's resource tracker counting the semaphores of ranks that were killed (a stop past its grace
  time, a failed job), which it then removes itself (its message has a colon: the filter is its first word);
- transformers' tokenizer logger (some versions, 5.17 among them) saying that it ignores
  `clean_up_tokenization_spaces` for a BPE tokenizer such as SmolLM2's GGUF one (what our decoding does anyway).
  A logger's record, not a warning: `LOG_FILTERS` drop it in each process that calls `install` (the launcher,
  every rank).
Filters match the start of each message, so every other warning still shows. They are set in this process and,
through PYTHONWARNINGS, in every interpreter it starts (spawned ranks, fork servers, reward workers).
`megatron-rl -v` or MEGATRON_RL_LIBRARY_WARNINGS=1 leaves them all visible.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

SHOW_ENV = "MEGATRON_RL_LIBRARY_WARNINGS"

FILTERS = (
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
    ("resource_tracker", UserWarning),
    # Megatron-Core's checkpoint loads call torch's deprecated ShardedTensor and load_state_dict (on resume).
    ("`load_state_dict` is deprecated", FutureWarning),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    ("barrier()", UserWarning),  # "barrier(): using the device under current context" (cut at its colon)
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("Mismatch dtype between input and weight", UserWarning),
    ("When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     UserWarning),
    # A mixture of experts at TP > 1 without sequence parallelism: our MoE layer splits its tokens over TP itself
    # (`models/moe.py`), which is what the warning asks sequence parallelism for. (Cut at its comma: PYTHONWARNINGS
    # separates its entries with commas.)
    ("When using expert parallelism and tensor parallelism for training", UserWarning),
)

# (logger name, start of the message) of library log records the filters above would hide were they warnings.
LOG_FILTERS = (
    ("transformers.tokenization_utils_tokenizers", "Ignoring clean_up_tokenization_spaces"),
)


class _DropStartingWith(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def cuda_devices_present() -> bool:
    """Does this machine show NVIDIA devices? Read from /dev and the environment, not from torch: importing torch
    would cost the CLI seconds before it can print a config error."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or any(n.startswith("nvidia") and n[6:].isdigit()
                                                    for n in os.listdir("/dev"))


def kernels_text() -> str:
    """What the libraries' warnings would have said, as the banner's one fact: the fused kernels a GPU job uses and
    the optional accelerators that are not installed."""
    import importlib.util

    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    text = "fused kernels: torch.compile"
    if missing:
        text += f"; {' and '.join(missing)} not installed"
    return text


def install() -> None:
    """Add the filters to this process and to the environment its children inherit, and the log filters to this
    process's loggers (idempotent; nothing when MEGATRON_RL_LIBRARY_WARNINGS=1). Call it before Megatron-Core is imported: most of these warnings are raised at
    import time."""
    if os.environ.get(SHOW_ENV, "") not in ("", "0"):
        return
    for name, start in LOG_FILTERS:  # a logger made now is the one the library takes when it imports
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStartingWith) and f.start == start for f in logger.filters):
            logger.addFilter(_DropStartingWith(start))
    entries = []
    for message, category in FILTERS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        entries.append(f"ignore:{message}:{category.__name__}")
    present = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(present + [e for e in entries if e not in present])
