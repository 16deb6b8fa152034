"""CUDA's rules on a CPU: the test mode in which code written for GPUs runs on CPU tensors and obeys them.

The CPU layer (`megatron_rl.compat.cpu`) makes Megatron-Core run without CUDA by turning CUDA's refusals into
no-ops, and branches on `is_cuda` keep whole GPU paths from running on a CPU at all. Code that only runs on a GPU
then ships untested: a pinned copy of an expanded view, compiled kernels that recompile past torch's limit, a host
sync inside a captured decode step. With ``MEGATRON_RL_CUDA_RULES=1`` (tests: ``pytest --cuda-rules``; see
tests/README.md) the GPU paths run on the CPU and CUDA's rules are enforced:

1. `gpu_path(t, rules)` is true for CPU tensors too: the compiled fusions, the compiled log-prob chunks, the decode
   step's static shapes and CUDA-graph path, the generator's pinned copies and lookahead all run. The mode is read
   from the environment once, where a model or generator is built (`enabled()`), and kept by what it built (the
   norms, the incremental forward, the generator): the per-layer, per-token paths never read the environment. The
   trainer's log-prob kernels (`training/logprobs.py`) read it once per chunk of logits (up to 512 MiB each), which
   costs nothing measurable. A test that switches the mode sets the variable before it builds.
2. `pin_memory(t)` copies into new memory with `t`'s sizes and strides, as CUDA's does (`at::_pin_memory`), and so
   refuses a tensor whose elements share memory (an expanded view), with CUDA's message.
3. `CaptureChecker` (a dispatch mode) refuses, inside what would be captured into a CUDA graph, what capture
   forbids: host syncs (`.item()`, `int(t)`, `bool(t)`, `.tolist()`), data-dependent shapes (`nonzero`,
   `masked_select`, `unique`, boolean-mask indexing) and boolean-mask writes.
4. `install_nccl_rules()` makes gloo keep NCCL's rules: collectives and point-to-point transfers take contiguous
   tensors, the tensors of one collective share a dtype, and a group's first `batch_isend_irecv` comes after a
   collective over the whole group (NCCL's communicator is created lazily; a batched point-to-point that is the
   first use of a group hangs unless every rank of the group takes part).

Compiled kernels use dynamo's "eager" backend on CPU tensors (`megatron_rl.compat.compiled`): the same tracing,
guards and recompilations as Inductor on a GPU, without code generation.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "MEGATRON_RL_CUDA_RULES"


def enabled() -> bool:
    """Whether this process runs GPU code paths on the CPU under CUDA's rules (inherited by spawned ranks)."""
    return os.environ.get(ENV, "") == "1"


def gpu_path(t: torch.Tensor, rules: bool) -> bool:
    """Take the GPU code path for `t`: a CUDA tensor, or any tensor when `rules` (the CUDA-rules mode, `enabled()`
    as read when the caller was built)."""
    return t.is_cuda or rules


# ------------------------------------------------------------------------------------------------- pinned copies


def pin_memory(t: torch.Tensor) -> torch.Tensor:
    """`t.pin_memory()` on a CUDA machine; elsewhere the same copy into fresh memory of `t`'s sizes and strides
    (what `at::_pin_memory` allocates), which refuses an overlapping tensor exactly as CUDA's does."""
    if torch.cuda.is_available():
        return t.pin_memory()
    with torch._C.DisableTorchFunction():  # below the CPU layer's mode, which would answer pin_memory itself
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
        return out.copy_(t)  # "more than one element of the written-to tensor refers to a single memory location"


# --------------------------------------------------------------------------------------------- CUDA-graph capture


class CaptureError(RuntimeError):
    pass


_aten = torch.ops.aten
_SYNCS = {_aten._local_scalar_dense.default: "a host sync (.item(), int(t), bool(t) or float(t))"}
_DATA_DEPENDENT = {
    _aten.nonzero.default: "nonzero (a data-dependent shape)",
    _aten.masked_select.default: "masked_select (a data-dependent shape)",
    _aten._unique2.default: "unique (a data-dependent shape)",
    _aten.unique_dim.default: "unique (a data-dependent shape)",
    _aten.unique_consecutive.default: "unique_consecutive (a data-dependent shape)",
}
_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


class CaptureChecker(TorchDispatchMode):
    """Raises `CaptureError` on an operation a CUDA graph capture forbids (see the module docstring, 3.).

    `where` names the captured code in the message. Host reads the dispatcher cannot see (`Tensor.tolist`) are
    refused by `__enter__`'s function hook."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def _refuse(self, what: str):
        raise CaptureError(f"{self.where}: {what} inside a CUDA graph capture")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS:
            self._refuse(_SYNCS[func])
        if func in _DATA_DEPENDENT:
            self._refuse(_DATA_DEPENDENT[func])
        if func in _INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                write = func is not _aten.index.Tensor
                self._refuse("a boolean-mask write" if write else "boolean-mask indexing (a data-dependent shape)")
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        checker = self

        def tolist(t):
            checker._refuse("a host read (.tolist())")

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


# ------------------------------------------------------------------------------------------------- NCCL's rules


class NcclRuleError(RuntimeError):
    pass


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "reduce", "all_to_all_single", "reduce_scatter", "all_to_all", "barrier")
# isend and irecv stay as they are: `P2POp` accepts only torch's own functions; their tensors are checked when a
# batch of them is (the project sends point-to-point only in batches or with send/recv).
_P2P = ("send", "recv")
_state: dict = {"installed": False, "saved": {}, "used": weakref.WeakSet(), "world_used": False}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _check_tensors(op: str, tensors: list) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise NcclRuleError(f"NCCL rule: {op} got a non-contiguous tensor of shape {tuple(t.shape)} "
                                f"(strides {t.stride()})")
    if len({t.dtype for t in tensors}) > 1:
        raise NcclRuleError(f"NCCL rule: {op} got tensors of dtypes {sorted(str(t.dtype) for t in tensors)}")


def _mark_used(group) -> None:
    if group is None or group is dist.group.WORLD:
        _state["world_used"] = True
    else:
        _state["used"].add(group)


def _was_used(group) -> bool:
    if group is None or group is dist.group.WORLD:
        return _state["world_used"]
    return group in _state["used"]


def _wrap_collective(name: str, fn):
    def checked(*args, **kwargs):
        tensors = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        _check_tensors(name, tensors)
        out = fn(*args, **kwargs)
        groups = [a for a in (*args, *kwargs.values()) if isinstance(a, dist.ProcessGroup)]
        for group in groups or [kwargs.get("group")]:
            _mark_used(group)
        return out

    checked.__name__ = name
    return checked


def _wrap_p2p(name: str, fn):
    def checked(tensor, *args, **kwargs):
        _check_tensors(name, [tensor])
        return fn(tensor, *args, **kwargs)

    checked.__name__ = name
    return checked


def _wrap_batch(fn):
    def batch_isend_irecv(p2p_op_list):
        if p2p_op_list:
            group = p2p_op_list[0].group
            if not _was_used(group):
                raise NcclRuleError("NCCL rule: the first batch_isend_irecv on a process group must come after a "
                                    "collective over the whole group (NCCL creates the communicator lazily)")
            _check_tensors("batch_isend_irecv", [op.tensor for op in p2p_op_list])
        return fn(p2p_op_list)

    return batch_isend_irecv


def install_nccl_rules() -> None:
    """Make this process's gloo collectives and point-to-point transfers keep NCCL's rules (module docstring, 4.).
    Idempotent; `uninstall_nccl_rules` undoes it."""
    if _state["installed"]:
        return
    for name in _COLLECTIVES:
        fn = getattr(dist, name)
        _state["saved"][name] = fn
        setattr(dist, name, _wrap_collective(name, fn))
    for name in _P2P:
        fn = getattr(dist, name)
        _state["saved"][name] = fn
        setattr(dist, name, _wrap_p2p(name, fn))
    _state["saved"]["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _wrap_batch(dist.batch_isend_irecv)
    _state["installed"] = True


def uninstall_nccl_rules() -> None:
    if not _state["installed"]:
        return
    for name, fn in _state["saved"].items():
        setattr(dist, name, fn)
    _state["saved"].clear()
    _state["used"] = weakref.WeakSet()
    _state["world_used"] = False
    _state["installed"] = False
