"""8-bit weight-only generation: the generator holds its 2-D weights as int8 or fp8 (e4m3) with per-row scales.

A dedicated generator that only samples need not keep full-precision weights. Holding them as int8 or fp8
(`megatron_rl.ddma.quant.Int8Weight` / `Fp8Weight`: one byte per weight plus one float32 scale per output row, so
both formats hold exactly the same bytes) halves the bytes of every projection matrix of a bf16 generator; the
vocabulary tensors and norms stay in bf16, so a whole Llama 3 8B generator holds 0.57 of its bf16 weight bytes
(benchmarks/int8_generator.py; 405B: about 0.51 by arithmetic). That is what lets a 405B generator fit one 8-GPU
node with room left for the KV cache (the LlamaRL paper quantizes its generators for the same reason). DDMA
refreshes these 8-bit weights in place at every sync (`TransportSettings(quantize="int8" or "fp8")`,
quantize-on-receive), so no rank ever holds a full-precision copy.
The formats differ in where they spend their 8 bits (`megatron_rl/ddma/quant.py`): int8 on a uniform grid up to
the row maximum, fp8 on a floating one (4 significant bits down to about 2**-15 of the row maximum).

Building such a generator never holds its full-precision matrices either: `build_quantized_generator` constructs the
model while a parameter-registration hook puts every tensor-parallel linear weight on the meta device (one
layer's shard exists for a moment, then is dropped), skips Megatron's initialization (DDMA writes every weight
before the first sample), and then allocates only the 8-bit weights and the full-precision rest. Without this, a
405B generator at TP8 would need its 101 GB of bf16 weights per GPU at start-up.

How the forward uses them: each quantized layer is one of Megatron-Core's own tensor-parallel linears
(`ColumnParallelLinear` / `RowParallelLinear`). `quantize_generator` removes its `weight` parameter and gives
the module a subclass whose `weight` is the dequantized 8-bit weight, computed when the forward reaches the layer
and freed after it, so at most one layer's weight exists in full precision at a time. Everything else (the
TP communication, the incremental forward, CUDA-graph decoding) is unchanged, and the same on every device
(fp8 included: `float8_e4m3fn` converts to float32 on CPUs as on GPUs). Megatron-Core itself has no 8-bit
weight-only inference path for these layers (its low-precision inference goes through transformer-engine fp8 or
ModelOpt), hence this small adapter. Transformer-engine layer specs keep their weights inside TE modules and are
refused with a clear error.

The cost is a dequantize (a read of one byte and a write of the compute dtype) per weight per forward: on a CPU
the tiny int8 model decodes at 0.96x its bf16 speed (0.84x in fp32); on GPUs it is unmeasured. A fused 8-bit matmul
would remove it (for fp8 on H100s `torch._scaled_mm`, at the price of quantizing the activations too).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_rl.ddma.quant import QuantizedWeight, quantize, quantized_targets
from megatron_rl.parallel.layout import ParallelLayout

def _dequantized(self) -> torch.Tensor:
    return self._quantized.dequantize(self._compute_dtype)


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    if cls not in _CLASSES:
        body = {"weight": property(_dequantized), "__module__": __name__,
                "__doc__": f"{cls.__name__} whose weight is held in 8 bits (megatron_rl.inference.quantized)."}
        if issubclass(cls, ColumnParallelLinear):
            def forward(self, input_, weight=None, runtime_gather_output=None):
                # ColumnParallelLinear.forward reads `self.weight` twice when no weight is passed: dequantize once.
                return cls.forward(self, input_, self.weight if weight is None else weight, runtime_gather_output)

            body["forward"] = forward
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (cls,), body)
    return _CLASSES[cls]


def quantize_generator(model: torch.nn.Module, model_cfg, layout: ParallelLayout, pp_rank: int, tp_rank: int,
                       device: Optional[torch.device] = None, fmt: str = "int8") -> dict[str, QuantizedWeight]:
    """Switch one generator stage to `fmt` ("int8" or "fp8") weights, in place; returns {local parameter name:
    QuantizedWeight}.

    The 8-bit weights start as the quantized current weights (zero for weights built on the meta device); pass
    them to `WeightSync.sync` together with the remaining parameters (`{**dict(model.named_parameters()),
    **targets}`) with `TransportSettings(quantize=fmt)`. The vocabulary tensors (embedding, output layer), the
    norms and a mixture of experts' routers stay in the model's dtype; its experts' linears (those of the experts
    this rank holds: a generator keeps them within its TP group) are 8-bit like the dense ones."""
    if device is None:
        device = next(p.device for p in model.parameters() if not p.is_meta)
    targets = quantized_targets(fmt, model_cfg, layout, pp_rank, tp_rank, device=device)
    modules = dict(model.named_modules())
    for name, w8 in targets.items():
        mod_name, _, attr = name.rpartition(".")
        mod = modules.get(mod_name)
        param = None if mod is None else mod._parameters.get(attr)
        if attr != "weight" or param is None:
            raise ValueError(f"{fmt} generation: the model has no parameter {name!r}")
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"{fmt} generation needs Megatron-Core's own linear layers; {mod_name} is a "
                             f"{type(mod).__name__} (use generator.attention='sdpa' or 'local', not 'te')")
        if tuple(param.shape) != tuple(w8.shape):
            raise ValueError(f"{fmt} generation: {name} has shape {tuple(param.shape)}, the layout expects "
                             f"{tuple(w8.shape)}")
        if not param.is_meta:
            start = quantize(param.detach(), fmt)
            w8.qweight.copy_(start.qweight)
            w8.scale.copy_(start.scale)
        del mod._parameters["weight"]
        mod.__class__ = _quantized_class(type(mod))
        mod._quantized, mod._compute_dtype = w8, param.dtype
    # Linear weights built on the meta device that stay in full precision (the output layer): allocate them now.
    for mod in model.modules():
        for pname, param in list(mod._parameters.items()):
            if param is not None and param.is_meta:
                real = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device),
                                          requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                mod._parameters[pname] = real
    return targets


@contextmanager
def _linear_weights_on_meta():
    """While active, every weight a Megatron-Core tensor-parallel linear registers is replaced by a meta tensor
    of the same shape and dtype (the allocated one is dropped at once)."""

    def hook(module, name, param):
        if name == "weight" and param is not None and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            meta = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                      requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # Megatron's attributes (tensor_model_parallel, partition_dim, ...)
            return meta
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def build_quantized_generator(fmt: str, model_cfg, layout: ParallelLayout, pgs, **build_kwargs):
    """Build one generator stage with `fmt` ("int8" or "fp8") weights without ever materializing its
    full-precision matrices; returns (model, {local name: QuantizedWeight}). Every weight starts at zero: sync from
    the trainer before use. `build_kwargs` go to `build_gpt_model` (attention, params_dtype, seed, ...)."""
    from megatron_rl.models import build_gpt_model

    overrides = dict(build_kwargs.pop("config_overrides", None) or {}, perform_initialization=False)
    with _linear_weights_on_meta():
        model = build_gpt_model(model_cfg, layout, pgs, config_overrides=overrides, **build_kwargs)
    # The non-quantized parameters were allocated without initialization: start them at zero too.
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_meta:
                p.zero_()
    targets = quantize_generator(model, model_cfg, layout, pgs.pp.rank(), pgs.tp.rank(), fmt=fmt)
    return model, targets


def build_int8_generator(model_cfg, layout: ParallelLayout, pgs, **build_kwargs):
    return build_quantized_generator("int8", model_cfg, layout, pgs, **build_kwargs)


def weight_bytes(model: torch.nn.Module, targets: Optional[dict[str, QuantizedWeight]] = None) -> int:
    """Bytes of the weights one rank holds: parameters plus 8-bit weights and their scales."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        w.nbytes for w in (targets or {}).values())
