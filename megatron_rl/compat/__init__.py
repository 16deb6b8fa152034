"""Run Megatron-Core on machines without CUDA.

Megatron-Core has no CPU code path; it assumes a CUDA device in a handful of places. This package redirects
those assumptions to the CPU so that the *same* Megatron-Core code (GPTModel, DDP, the distributed optimizer,
the pipeline schedules, vocab-parallel cross entropy, dist_checkpointing) runs under gloo on a laptop or a CI box.

`activate()` is a no-op when `torch.cuda.is_available()` is true: on a GPU machine nothing is patched.
"""

from megatron_rl.compat.cpu import activate, is_active, suspended

__all__ = ["activate", "is_active", "suspended"]
