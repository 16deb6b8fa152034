"""The CPU redirections for Megatron-Core, in one place.

What is patched and why (all of it only when CUDA is absent; see `activate`):

1. Device placement. Megatron-Core allocates with `device=torch.cuda.current_device()` (an int),
   `device="cuda"`, calls `Tensor.cuda()`, `.to("cuda")`, `pin_memory()`, `non_blocking` copies. A
   `TorchFunctionMode` (`_CudaToCpu`) rewrites every CUDA or integer device argument to `cpu`, turns
   `.cuda()` into a no-op and `pin_memory` into a no-op (in the CUDA-rules mode, `megatron_rl.compat.cuda_rules`,
   into CUDA's copy, which refuses overlapping tensors). A mode intercepts every torch call, so we need
   no list of the call sites, and new Megatron-Core versions are covered as long as they go through torch.
   The mode is entered for the main thread and for every thread started afterwards (torch's function-mode
   stack is thread-local; dist_checkpointing writes from worker threads).
2. `torch.cuda` module functions: `current_device` -> 0 (an int device, redirected by 1.), `synchronize`,
   `empty_cache`, `set_device` -> no-ops, `device_count` -> 1. `Stream`, `Event`, `current_stream`,
   `stream` get inert stand-ins (Megatron-Core's DDP and schedules create and record them unconditionally).
   `nvtx` range push/pop become no-ops.
3. The CUDA RNG. `tensor_parallel.random` (its RNG tracker, `model_parallel_cuda_manual_seed`, activation
   checkpointing) saves, seeds and restores the CUDA generator. On the CPU the generator that dropout and
   initialisation actually use is the CPU default generator, so the CUDA RNG functions act on it. This keeps the
   tracker's meaning: inside `fork()` dropout draws from the tracked state, outside from the default one.
4. Tensor type strings. `clip_grads` and the optimizers assert `param.grad.type() == 'torch.cuda.FloatTensor'`.
   `Tensor.type()` with no argument reports the CUDA type name for CPU tensors.

Anything not listed here runs unmodified. `tests/test_compat.py` tests this module by itself, including that
`activate()` changes nothing when CUDA is (faked as) available.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.compat import cuda_rules

_state: dict[str, Any] = {"active": False, "mode": None, "saved": {}}
_lock = threading.Lock()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CPU = torch.device("cpu")


# The tensor methods `_CudaToCpu` answers itself; every other call only has its arguments looked at.
_CUDA_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.is_pinned, torch.Tensor.type,
                           torch.Tensor.to})


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made under it.

    Every torch call of the process passes through here, attribute reads of tensors included, so the common case
    (no keyword arguments, none of `_CUDA_METHODS`) is one set lookup and one truth test before the call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _CUDA_METHODS:
            return _cuda_method(func, args, kwargs or {})
        if func is torch.autograd.backward:
            return _backward_redirected(*args, **(kwargs or {}))
        if not kwargs:
            return func(*args)
        return func(*args, **_cpu_kwargs(kwargs))


def _backward_redirected(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """`torch.autograd.backward` with the redirection on inside it. A mode is off while its own handler runs, and
    the backward pass runs inside this call, so autograd functions whose backward allocates on "the current CUDA
    device" (Megatron-Core's sequence-parallel gathers and reduce-scatters: the MoE layer's token split and its
    all-gather dispatcher) would otherwise fail. The engine is called as `torch.autograd.backward` calls it, under a
    fresh mode (calling `backward` itself would dispatch to that mode again)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    with _CudaToCpu():
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             tuple(inputs) if inputs is not None else (), allow_unreachable=True, accumulate_grad=True)


def _cpu_kwargs(kwargs: dict) -> dict:
    """`kwargs` with a CUDA (or integer) `device` replaced by the CPU and `pin_memory` turned off."""
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs = dict(kwargs, device=_CPU)
    if kwargs.get("pin_memory"):
        kwargs = dict(kwargs, pin_memory=False)
    return kwargs


def _cuda_method(func, args: tuple, kwargs: dict):
    """`Tensor.cuda()` and `pin_memory()` return the tensor, `is_pinned()` False, `type()` the CUDA type name, and
    `to` a CUDA device (positional or keyword) goes to the CPU."""
    if func is torch.Tensor.cuda:  # in the CUDA-rules mode, refusing what a real copy to the GPU cannot do
        if cuda_rules.enabled() and args[0].is_meta:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")
        return args[0]
    if func is torch.Tensor.pin_memory:  # CUDA's copy and its refusal of overlapping tensors in the CUDA-rules mode
        return cuda_rules.pin_memory(args[0]) if cuda_rules.enabled() else args[0]
    if func is torch.Tensor.is_pinned:
        return False
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        name = func(*args)
        return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
    if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
    return func(*args, **_cpu_kwargs(kwargs))


class _InertStream:
    """Stand-in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _InertStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _noop_named(name: str):
    def noop(*args, **kwargs):
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_{name}"
    return noop


def _cpu_get_rng_state(device: Any = "cuda", *args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch(obj: Any, name: str, value: Any) -> None:
    key = (id(obj), name)
    if key not in _state["saved"]:
        _state["saved"][key] = (obj, name, getattr(obj, name, None))
    setattr(obj, name, value)


def _enter_mode_in_new_threads() -> None:
    """torch's function-mode stack is per thread: make threads started later inherit the redirect."""
    original_bootstrap = threading.Thread._bootstrap_inner

    def bootstrap_inner(self):
        mode = _state["mode"]
        if mode is not None and _state["active"]:
            with _CudaToCpu():
                return original_bootstrap(self)
        return original_bootstrap(self)

    _patch(threading.Thread, "_bootstrap_inner", bootstrap_inner)


@contextlib.contextmanager
def suspended():
    """Run a hot loop without the device redirect: every torch call under the mode pays a Python round trip.

    Only for code that places tensors on the devices of existing tensors (the generator's decode loop), never
    for Megatron-Core code that names CUDA devices."""
    if not _state["active"]:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def redirected():
    """The device redirect again inside `suspended()`, for Megatron-Core code the hot loop calls (an MoE layer's
    router moves its weight to `torch.cuda.current_device()` at every call while it sits on a CPU)."""
    if not _state["active"]:
        yield
        return
    with torch._C._EnableTorchFunction():
        yield


def is_active() -> bool:
    """True when the CPU redirections are installed in this process."""
    return _state["active"]


def activate() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent. Returns whether the layer is active."""
    with _lock:
        if _state["active"]:
            return True
        if torch.cuda.is_available():
            return False
        # Import torch._dynamo and Megatron-Core before patching: dynamo builds a table of torch.cuda's functions
        # on import and rejects two names bound to one function object. Megatron-Core through our compat module:
        # without the wandb and Inductor it would load (2-3 s of each cold-started rank: torchrun's, srun's).
        import torch._dynamo as _dynamo  # noqa: F401
        import megatron_rl.compat.megatron_core  # noqa: F401

        cuda = torch.cuda
        _patch(cuda, "current_device", lambda: 0)
        _patch(cuda, "device_count", lambda: 1)
        for name in ("synchronize", "empty_cache", "set_device", "reset_peak_memory_stats"):
            _patch(cuda, name, _noop_named(name))
        for name in ("Stream", "Event", "ExternalStream"):
            _patch(cuda, name, _InertStream)
        _patch(cuda, "current_stream", lambda *a, **k: _InertStream())
        _patch(cuda, "default_stream", lambda *a, **k: _InertStream())
        _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        _patch(cuda, "get_rng_state", _cpu_get_rng_state)
        _patch(cuda, "set_rng_state", _cpu_set_rng_state)
        _patch(cuda, "manual_seed", _cpu_manual_seed)
        _patch(cuda, "manual_seed_all", _cpu_manual_seed)
        _patch(cuda.random, "get_rng_state", _cpu_get_rng_state)
        _patch(cuda.random, "set_rng_state", _cpu_set_rng_state)
        _patch(cuda.nvtx, "range_push", _noop_named("range_push"))
        _patch(cuda.nvtx, "range_pop", _noop_named("range_pop"))
        _patch(cuda, "memory_allocated", lambda *a, **k: 0)
        _patch(cuda, "max_memory_allocated", lambda *a, **k: 0)

        from megatron.core.tensor_parallel import random as mcore_random

        _patch(mcore_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        _patch(mcore_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))

        mode = _CudaToCpu()
        mode.__enter__()
        _state["mode"] = mode
        _enter_mode_in_new_threads()
        _state["active"] = True
        return True


def deactivate() -> None:
    """Undo `activate` (for tests of this module)."""
    with _lock:
        if not _state["active"]:
            return
        _state["mode"].__exit__(None, None, None)
        for obj, name, value in _state["saved"].values():
            setattr(obj, name, value)
        _state["saved"].clear()
        _state["mode"] = None
        _state["active"] = False
