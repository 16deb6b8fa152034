"""Megatron-Core, imported without two import-time costs that no megatron-rl process uses.

Importing this module imports `megatron.core` (as `import megatron.core` would) in every process that starts ranks
or runs them: the fork server preloads it, a spawned rank imports it first (`launch/spawn.py`), and so does the
test session. A plain `import megatron.core` takes seconds, most of them for two things Megatron-Core loads at
import and this project never reaches:

1. wandb: Megatron-Core's timers and its dynamic inference engine import it, where installed, for their own
   logging, which this project does not use (the job's W&B logging is `controller/metrics.py`, which imports wandb
   itself when a run asks for it). Hidden while Megatron-Core loads, so those modules see it as not installed;
   visible again afterwards.
2. Inductor, on machines without CUDA: Megatron-Core's `jit_fuser` is `torch.compile`, applied at import to its
   fused bias-activation functions, and applying it loads Inductor. Those functions run only with
   `bias_activation_fusion`, which `build_gpt_model` turns on only where CUDA is present; without CUDA the
   decorator is the identity while Megatron-Core loads. With CUDA it is left as it is.

A process that imported Megatron-Core before this module keeps it as it was loaded.
"""

from __future__ import annotations

import sys

import torch


def _identity_compile(model=None, **_):
    return model if model is not None else (lambda fn: fn)


def _import() -> None:
    if "megatron.core" in sys.modules:
        return
    hide_wandb = "wandb" not in sys.modules
    compile_ = torch.compile
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError, which Megatron-Core catches
    if not torch.cuda.is_available():
        torch.compile = _identity_compile
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


_import()
