"""Compiled kernels with a bounded number of graphs, and an eager fallback that never fails a job.

`torch.compile` keeps its graphs per code object and compiles a new one whenever a guard of the existing ones
fails: another dtype, grad mode on or off, an optional argument present or absent, a Python constant (an eps, a
temperature), a size that is or stops being 1 (dynamo always specializes sizes 0 and 1, even with
``dynamic=True``), another stride pattern. One compiled function shared by every caller collects all of them;
past torch's recompile limit (8) a ``fullgraph=True`` function raises and fails the job, and a plain one warns and
runs eagerly from then on.

`CompiledKernel` makes the set of graphs a design decision instead:

* The specializations are named before the call: `signature` describes every argument by what a guard may depend
  on other than its sizes (a tensor's dtype, rank, which dimensions are 1, contiguity, 16-byte alignment,
  requires_grad, and the same of the tensor it is a view of; a float's value; whether an optional argument is given), plus the global grad
  mode, plus the caller's ``key(*args)`` for what the arguments alone do not show (relations between integers).
* Each key gets its own copy of the function's code object, compiled with ``fullgraph=True, dynamic=True``: sizes
  are symbolic, so one key is one graph (``graphs_per_key`` allows a few more for guards the key does not name),
  and torch's per-code-object recompile limit is never shared between keys.
* At most ``max_keys`` specializations are compiled; a further one runs the eager function, as does a key whose
  compilation fails or whose graphs exceed ``graphs_per_key``. Each such fallback warns once, naming the kernel
  and the reason, and is kept in `fallbacks` (tests assert it stays empty).

`graphs` counts the graphs compiled per kernel through a counting backend, so a test can hold every kernel to its
budget (`all_kernels`, `compiled_graph_counts`). The backend is Inductor on GPUs; on a CPU the kernels compile only
in the CUDA-rules test mode (`megatron_rl.compat.cuda_rules`), with dynamo's "eager" backend: the same tracing,
guards and recompilations as on a GPU, without generating code.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Callable, Hashable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

logger = logging.getLogger(__name__)

# Every kernel made in this process, for tests and reports (weak: a kernel lives as long as its module does).
_KERNELS: "weakref.WeakSet[CompiledKernel]" = weakref.WeakSet()


class _GraphBudgetExceeded(RuntimeError):
    pass


def _fresh_copy(fn: Callable, tag: str) -> Callable:
    """`fn` with a code object of its own: dynamo keeps graphs and counts recompilations per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def default_backend(device_type: str) -> str:
    """Inductor for CUDA tensors; dynamo's tracing-only "eager" backend for CPU tensors (the CUDA-rules mode)."""
    return "inductor" if device_type == "cuda" else "eager"


class CompiledKernel:
    """`fn` compiled once per specialization key, within a budget of graphs, falling back to `fn` eagerly.

    name: for warnings and budgets. key: ``key(*args) -> tuple``, the specializations `signature` does not see
    (see the module docstring); the first argument must be a tensor (its device picks the backend). max_keys: how many specializations may compile.
    graphs_per_key: the graphs one key may hold (1 when the key names every guard)."""

    def __init__(self, fn: Callable, name: str, key: Callable[..., tuple], max_keys: int,
                 graphs_per_key: int = 2, backend: Optional[str] = None):
        self.fn, self.name, self.key = fn, name, key
        self.max_keys, self.graphs_per_key = max_keys, graphs_per_key
        self.backend = backend
        self._compiled: dict = {}  # key -> compiled function, or None for a key that runs eagerly
        self.graphs_by_key: dict = {}
        self.fallbacks: dict = {}  # key -> why it runs eagerly
        _KERNELS.add(self)

    def reset(self) -> None:
        """Forget every specialization (tests)."""
        self._compiled.clear()
        self.graphs_by_key.clear()
        self.fallbacks.clear()

    @property
    def graphs(self) -> int:
        return sum(self.graphs_by_key.values())

    def _counting_backend(self, k, device_type: str):
        inner = torch._dynamo.lookup_backend(self.backend or default_backend(device_type))

        def backend(gm, example_inputs):
            n = self.graphs_by_key.get(k, 0) + 1
            if n > self.graphs_per_key:
                raise _GraphBudgetExceeded(f"more than {self.graphs_per_key} graphs for one specialization")
            self.graphs_by_key[k] = n
            return inner(gm, example_inputs)

        return backend

    def _fall_back(self, k, why: str) -> None:
        self._compiled[k] = None
        self.fallbacks[k] = why
        logger.warning("compiled %s runs eagerly for %s: %s", self.name, k, why)

    def __call__(self, *args):
        if _get_current_dispatch_mode() is not None:  # dynamo compiles nothing under one (`CaptureChecker`)
            return self.fn(*args)
        k = (tuple(signature(a) for a in args), *self.key(*args), torch.is_grad_enabled())
        compiled = self._compiled.get(k, False)
        if compiled is False:
            if len(self._compiled) >= self.max_keys:
                self._fall_back(k, f"its {self.max_keys} specializations are all compiled")
                return self.fn(*args)
            tag = f"k{len(self._compiled)}"
            compiled = torch.compile(_fresh_copy(self.fn, tag), fullgraph=True, dynamic=True,
                                     backend=self._counting_backend(k, args[0].device.type))
            self._compiled[k] = compiled
        if compiled is None:
            return self.fn(*args)
        try:
            # No duck shaping: sizes that happen to be equal (64 tokens, hidden size 64) must not share a symbol,
            # which would add a guard that the next call breaks.
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return compiled(*args)
        except Exception as e:  # a compiler's failure must never fail a job: the eager function is the same math
            self._fall_back(k, f"{type(e).__name__}: {e}")
            return self.fn(*args)


def all_kernels() -> list[CompiledKernel]:
    return sorted(_KERNELS, key=lambda k: k.name)


def compiled_graph_counts() -> dict[str, int]:
    """Graphs compiled so far per kernel of this package, plus Megatron-Core's torch.compile'd SwiGLU functions
    (counted from dynamo's cache entries: they are plain `torch.compile` functions)."""
    counts = {k.name: k.graphs for k in all_kernels()}
    counts.update(megatron_swiglu_graph_counts())
    return counts


def megatron_swiglu_graph_counts() -> dict[str, int]:
    """Cached graphs of Megatron-Core's compiled SwiGLU kernels (`bias_activation_fusion`), by function name: 0 for
    one that is not compiled (on CPUs Megatron-Core is imported with its jit fuser off, `compat/megatron_core.py`)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megatron.core.fusions import fused_bias_swiglu as swiglu

    counts = {}
    for name in ("swiglu", "swiglu_back", "bias_swiglu", "bias_swiglu_back"):
        fn = getattr(swiglu, name, None)
        if fn is None:
            continue
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
        counts[f"megatron.{name}"] = len(_debug_get_cache_entry_list(orig.__code__)) if orig is not None else 0
    return counts


def ones_pattern(t: torch.Tensor) -> tuple:
    """Which dimensions of `t` are 1 (dynamo specializes them)."""
    return tuple(d == 1 for d in t.shape)


def _layout(t: torch.Tensor) -> tuple:
    # Inductor guards on 16-byte alignment of an input's start (a chunk sliced from a larger tensor may not be).
    aligned = (t.storage_offset() * t.element_size()) % 16 == 0
    return (t.dtype, ones_pattern(t), t.is_contiguous(), t.stride()[-1] == 1 if t.dim() else True, aligned)


def signature(a) -> Hashable:
    """What dynamo's guards on one argument may depend on, sizes aside (see the module docstring). Integers are
    symbolic under ``dynamic=True`` and left out."""
    if isinstance(a, torch.Tensor):
        base = a._base
        return (_layout(a), a.requires_grad, None if base is None else _layout(base))
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, float):
        return a
    if isinstance(a, int):
        return int
    return type(a)
