"""The RNG states a training checkpoint keeps per rank (`rng/rank_<rank>.pt`), restored when a run resumes with the
world size it was saved with: torch's, Python's, numpy's, CUDA's and Megatron-Core's model-parallel tracker's.

The states are stored as tensors, numbers and tuples, so that `torch.load(weights_only=True)` reads them
(`safe_load.load_data`); numpy's key array is stored as a tensor (older files hold numpy's own array, which
`set_rng_state` still takes).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

logger = logging.getLogger(__name__)


def rng_state() -> dict:
    """Every RNG's state as tensors, numbers and tuples: what `torch.load(weights_only=True)` reads back."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, *rest = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), *rest)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (the tracker's states only when they come from the same kind of device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, *rest = state["numpy"]  # keys: a tensor, or an array where the file holds numpy's own state
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved, current = state["tracker"], tracker.get_states()
    if any(name in current and saved[name].numel() != current[name].numel() for name in saved):
        # Saved on another kind of device: a CPU generator's state is 5,056 bytes, a CUDA one's 16. The tracker
        # keeps the states this run seeded (from the job's seed and TP rank); nothing else depends on them here
        # (no dropout), so the resumed run trains the same, with one line saying so.
        logger.warning("the checkpoint's model-parallel RNG states come from another kind of device "
                       "(%d bytes, here %d); continuing from this run's seeded states",
                       next(iter(saved.values())).numel(), next(iter(current.values())).numel())
        return
    tracker.set_states(saved)
