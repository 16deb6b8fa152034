"""The frozen reference policy of the KL penalty (`algorithm.kl_coef`): the policy as RL starts.

`make_reference` builds a second module of the policy's architecture on the same ranks and process groups (so it
has the same pipeline stage and tensor shards), copies the policy's weights into it and freezes it. It is rebuilt
rather than deep-copied because a Megatron-Core module holds process groups, which cannot be copied, and, once
wrapped in DistributedDataParallel, parameters whose storage lies in the DDP's contiguous parameter buffer and whose
`main_grad` is a view of its gradient buffer, which a deep copy would duplicate. The reference has no DDP wrapper,
no gradient buffer and no optimizer; `RLTrainer` runs it forward only.

A run that resumes keeps its reference through the training checkpoint (`TrainCheckpointer.save` / `load` with
`reference=`).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.distributed import DistributedDataParallel


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside Megatron-Core's DistributedDataParallel, or the model itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def _rng_preserved():
    """Builders seed the global generators (torch's, CUDA's and Megatron-Core's tracker); put them back, so that
    making a reference changes no random draw of the run."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tracker = get_cuda_rng_tracker().get_states()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        get_cuda_rng_tracker().set_states(tracker)


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy every parameter and buffer of `src` into the same-named one of `dst` (same names, shapes and dtypes
    required: the two must come from the same builder at the same layout)."""
    src, dst = unwrap(src), unwrap(dst)
    for kind, theirs, ours in (("parameter", src.named_parameters(), dst.named_parameters()),
                               ("buffer", src.named_buffers(), dst.named_buffers())):
        theirs, ours = dict(theirs), dict(ours)
        if theirs.keys() != ours.keys():
            diff = sorted(theirs.keys() ^ ours.keys())
            raise ValueError(f"the reference and the policy differ in {kind}s {diff[:4]}: not the same builder?")
        for name, t in theirs.items():
            if t.shape != ours[name].shape or t.dtype != ours[name].dtype:
                raise ValueError(f"{kind} {name!r}: policy {tuple(t.shape)} {t.dtype}, reference "
                                 f"{tuple(ours[name].shape)} {ours[name].dtype}: not the same builder or layout?")
            ours[name].copy_(t)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """No gradients, evaluation mode; returns `model`."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def make_reference(policy: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A frozen copy of `policy` for the KL penalty.

    `policy`: the trainer's model, bare or wrapped in DistributedDataParallel (`RLTrainer.model`). `build`: makes a
    fresh module of the same architecture on this rank, the call that built the policy, e.g.
    `lambda: build_gpt_model(cfg, layout, pgs, attention=..., params_dtype=...)`; its random initialization is
    overwritten and its seeding undone. Every rank of the trainer executor calls this at the same point.
    """
    with _rng_preserved():
        reference = build()
    copy_weights(policy, reference)
    return freeze(reference)


__all__ = ["make_reference", "copy_weights", "freeze", "unwrap"]
