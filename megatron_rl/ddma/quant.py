"""Int8 weight-only quantization on receive: the generator keeps int8 weights and per-output-channel scales.

A dedicated generator can hold its weights in int8 to free memory for larger batches and KV caches (the LlamaRL
paper's argument for asynchronous, quantized generators). DDMA then refreshes the int8 weights and their scales at
every sync, without the generator ever holding a full-precision copy of a whole weight:

- before the weights move, every sender computes the absolute maximum of each row of each slice it will send
  (after the cast to the wire dtype) and sends these row maxima (a few bytes per row); the receiver reduces them to
  the maximum of each row of its local shard, and sets `scale = rowmax / 127` (1 for all-zero rows);
- each received slice is then quantized as it is written: `q = clamp(round(w / scale), -127, 127)`.

So the result is exactly what quantizing the destination's local full-precision shard would give
(`quantize_int8`), and each dequantized element is within half a step of the true weight. In exact arithmetic
`|w - q * scale| <= scale / 2 = rowmax / 254`. In float32, `w / scale` (|.| <= 127) is off by at most
127 * 2**-24 before rounding, which can move the error by that many steps, and `q * scale` adds at most
127 * 2**-24 * scale: in all `|w - dequantize()| <= scale / 2 * (1 + 4 * 127 * 2**-24)`
(`INT8_ERROR_OVER_HALF_STEP`), which the verifier and the tests check.
Rows are the output channels of a local shard, dim 0 of Megatron's `[out, in]` weight: for row-parallel layers
(`linear_proj`, `linear_fc2`) the destination's rows are split by input columns over TP ranks, and the scale is
per output channel of the local shard, which is what a TP-sharded int8 matmul needs.

API:
    targets = int8_targets(model_cfg, generator_layout, pp_rank, tp_rank)  # local name -> Int8Weight
    sync = WeightSync(..., settings=TransportSettings(quantize="int8"))
    sync.sync(trainer_model, {**dict(generator_model.named_parameters()), **targets}, step)
    targets["decoder.layers.0.mlp.linear_fc1.weight"].qweight / .scale / .dequantize()

By default every 2-D weight except the vocabulary tensors (embedding, output layer) is quantized
(`TransportSettings.quantize_vocab=True` includes them); 1-D norm weights stay in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.ddma.descriptors import LogicalParam, stage_params
from megatron_rl.parallel.layout import ParallelLayout

QMAX = 127
# Bound on |w - dequantized w| in units of half a quantization step (see the module docstring).
INT8_ERROR_OVER_HALF_STEP = 1 + 4 * QMAX * 2.0**-24


@dataclass
class Int8Weight:
    """A weight held as int8 with one float32 scale per row (output channel): w ~= qweight * scale[:, None]."""

    qweight: torch.Tensor  # int8, the local shard's shape
    scale: torch.Tensor  # float32, (rows,)

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: Optional[torch.device] = None) -> "Int8Weight":
        if len(shape) != 2:
            raise ValueError(f"int8 weights must be 2-D, got shape {tuple(shape)}")
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.ones(shape[0], dtype=torch.float32, device=device))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def set_scale_from_rowmax(self, rowmax: torch.Tensor) -> None:
        self.scale.copy_(scale_from_rowmax(rowmax))

    def write(self, box, values: torch.Tensor) -> None:
        """Quantize `values` (full precision) into the slice `box` with the current scales."""
        (r0, r1), (c0, c1) = box
        q = torch.round(values.to(torch.float32) / self.scale[r0:r1, None]).clamp_(-QMAX, QMAX)
        self.qweight[r0:r1, c0:c1].copy_(q)

    def zero(self, box) -> None:
        (r0, r1), (c0, c1) = box
        self.qweight[r0:r1, c0:c1].zero_()


def scale_from_rowmax(rowmax: torch.Tensor) -> torch.Tensor:
    rowmax = rowmax.to(torch.float32)
    return torch.where(rowmax > 0, rowmax / QMAX, torch.ones_like(rowmax))


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Reference quantization of a full-precision local shard (what a sync with quantize="int8" produces)."""
    out = Int8Weight.empty(tuple(w.shape), w.device)
    out.set_scale_from_rowmax(w.detach().to(torch.float32).abs().amax(dim=1))
    out.write(((0, w.shape[0]), (0, w.shape[1])), w.detach())
    return out


def is_quantized(param: LogicalParam, quantize: Optional[str], quantize_vocab: bool = False) -> bool:
    """Whether a sync with these settings stores `param` as int8 on the destination."""
    if quantize is None:
        return False
    if quantize != "int8":
        raise ValueError(f"unknown quantization {quantize!r}; supported: 'int8'")
    return len(param.shape) == 2 and (quantize_vocab or not param.is_vocab)


def int8_targets(model_cfg, layout: ParallelLayout, pp_rank: int, tp_rank: int, *, quantize_vocab: bool = False,
                 device: Optional[torch.device] = None) -> dict[str, Int8Weight]:
    """Empty int8 weights for every quantized parameter of one generator stage, keyed by local name."""
    return {lp.local_name: Int8Weight.empty(lp.local_shape, device)
            for lp in stage_params(model_cfg, layout, pp_rank, tp_rank)
            if is_quantized(lp.param, "int8", quantize_vocab)}
