"""Weight-only quantization on receive: the generator keeps int8 or fp8 weights and per-output-channel scales.

A dedicated generator can hold its weights in 8 bits to free memory for larger batches and KV caches (the LlamaRL
paper's argument for asynchronous, quantized generators). DDMA then refreshes the 8-bit weights and their scales
at every sync, without the generator ever holding a full-precision copy of a whole weight:

- before the weights move, every sender computes the absolute maximum of each row of each slice it will send
  (after the cast to the wire dtype) and sends these row maxima (a few bytes per row); the receiver reduces them to
  the maximum of each row of its local shard, and sets `scale = rowmax / QMAX` (1 for all-zero rows);
- each received slice is then quantized as it is written, `q = code(w / scale)`, and `w ~= q * scale`.

Two formats, the same scales and the same one byte per weight:

- int8 (`Int8Weight`): `code(x) = clamp(round(x), -127, 127)`, QMAX = 127, a uniform grid: the error is at most
  half a step, `scale / 2 = rowmax / 254`, for every element of a row.
- fp8 e4m3 (`Fp8Weight`, `torch.float8_e4m3fn`): `code(x) = clamp(x, -448, 448)` rounded to the nearest e4m3
  value (ties to even), QMAX = 448. Its grid is floating: 3 mantissa bits, so at |x| in [2**e, 2**(e+1)) the step
  is 2**(e-3) (relative error at most 2**-4 = 1/16), and below 2**-6 (subnormals) the step is 2**-9. The largest
  elements of a row are coarser than int8's (step 32 of 448, `rowmax / 28` half a step) and the small ones much
  finer (an element 100 times below the row maximum keeps 4 significant bits, where int8 keeps about 1).

Either way the result is exactly what quantizing the destination's local full-precision shard gives (`quantize`),
and each dequantized element is within half a step of the true weight (`QuantizedWeight.half_step`). In exact
arithmetic the error is at most one half step. In float32, `w / scale` is off by at most `|x| * 2**-24` before
rounding and `q * scale` adds at most `|q| * scale * 2**-24`: for int8 (|x| <= 127, half a step 1/2 in units of
scale) that is `1 + 4 * 127 * 2**-24` half steps (`Int8Weight.ERROR_OVER_HALF_STEP`); for fp8 |x| and |q| are at
most 2**5 half steps of their binade, so `1 + 2 * 2**5 * 2**-24` (`Fp8Weight.ERROR_OVER_HALF_STEP`). The verifier
and the tests check these bounds.
Rows are the output channels of a local shard, dim 0 of Megatron's `[out, in]` weight: for row-parallel layers
(`linear_proj`, `linear_fc2`) the destination's rows are split by input columns over TP ranks, and the scale is
per output channel of the local shard, which is what a TP-sharded 8-bit matmul needs.

API:
    targets = quantized_targets("fp8", model_cfg, generator_layout, pp_rank, tp_rank)  # local name -> Fp8Weight
    sync = WeightSync(..., settings=TransportSettings(quantize="fp8"))
    sync.sync(trainer_model, {**dict(generator_model.named_parameters()), **targets}, step)
    targets["decoder.layers.0.mlp.linear_fc1.weight"].qweight / .scale / .dequantize()

By default every 2-D weight except the vocabulary tensors (embedding, output layer) and a mixture of experts'
routers is quantized (`TransportSettings.quantize_vocab=True` includes the vocabulary); 1-D norm weights stay in
full precision. A router stays in full precision because it picks each token's experts: a rounding that moves a
score past another's sends the token elsewhere, the flips routing replay exists to remove (experts x hidden:
0.04% of a Qwen3-30B-A3B layer's weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from megatron_rl.ddma.descriptors import LogicalParam, stage_params
from megatron_rl.models.param_spec import ROUTER
from megatron_rl.parallel.layout import ParallelLayout

QMAX = 127  # int8's largest code (kept for callers that use the int8 constants directly)
# Bound on |w - dequantized w| in units of half a quantization step (see the module docstring).
INT8_ERROR_OVER_HALF_STEP = 1 + 4 * QMAX * 2.0**-24
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_ERROR_OVER_HALF_STEP = 1 + 2 * 2**5 * 2.0**-24


@dataclass
class QuantizedWeight:
    """A weight held as 8-bit codes with one float32 scale per row (output channel): w ~= qweight * scale[:, None].

    Subclasses fix the code dtype, the largest code and the rounding (`_codes`)."""

    qweight: torch.Tensor  # the code dtype, the local shard's shape
    scale: torch.Tensor  # float32, (rows,)

    FORMAT: ClassVar[str]
    QMAX: ClassVar[float]
    ERROR_OVER_HALF_STEP: ClassVar[float]

    @classmethod
    def code_dtype(cls) -> torch.dtype:
        raise NotImplementedError

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: Optional[torch.device] = None) -> "QuantizedWeight":
        if len(shape) != 2:
            raise ValueError(f"{cls.FORMAT} weights must be 2-D, got shape {tuple(shape)}")
        return cls(torch.zeros(shape, dtype=cls.code_dtype(), device=device),
                   torch.ones(shape[0], dtype=torch.float32, device=device))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def set_scale_from_rowmax(self, rowmax: torch.Tensor) -> None:
        rowmax = rowmax.to(torch.float32)
        self.scale.copy_(torch.where(rowmax > 0, rowmax / self.QMAX, torch.ones_like(rowmax)))

    def write(self, box, values: torch.Tensor) -> None:
        """Quantize `values` (full precision) into the slice `box` with the current scales."""
        (r0, r1), (c0, c1) = box
        self.qweight[r0:r1, c0:c1].copy_(self._codes(values.to(torch.float32) / self.scale[r0:r1, None]))

    def zero(self, box) -> None:
        (r0, r1), (c0, c1) = box
        self.qweight[r0:r1, c0:c1].zero_()

    def half_step(self, w: torch.Tensor) -> torch.Tensor:
        """Half the quantization step at each element of the full-precision weight `w` (this weight's shape), in
        w's units: the bound on |w - dequantize()| in exact arithmetic."""
        raise NotImplementedError

    @staticmethod
    def _codes(x: torch.Tensor) -> torch.Tensor:
        """float32 values in units of the scale -> codes (a tensor `copy_` stores exactly in the code dtype)."""
        raise NotImplementedError


class Int8Weight(QuantizedWeight):
    """int8 codes on a uniform grid of 255 steps per row."""

    FORMAT, QMAX, ERROR_OVER_HALF_STEP = "int8", QMAX, INT8_ERROR_OVER_HALF_STEP

    @classmethod
    def code_dtype(cls) -> torch.dtype:
        return torch.int8

    def half_step(self, w: torch.Tensor) -> torch.Tensor:
        return (self.scale[:, None] / 2).expand(w.shape)

    @staticmethod
    def _codes(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x).clamp_(-QMAX, QMAX)


class Fp8Weight(QuantizedWeight):
    """float8 e4m3 (`torch.float8_e4m3fn`) codes: 3 mantissa bits, finite range +-448, no infinities."""

    FORMAT, QMAX, ERROR_OVER_HALF_STEP = "fp8", FP8_MAX, FP8_ERROR_OVER_HALF_STEP

    @classmethod
    def code_dtype(cls) -> torch.dtype:
        dtype = getattr(torch, "float8_e4m3fn", None)
        if dtype is None:
            raise ValueError(f"fp8 generator weights need torch.float8_e4m3fn, which torch {torch.__version__} "
                             f"does not have (torch >= 2.1)")
        return dtype

    def half_step(self, w: torch.Tensor) -> torch.Tensor:
        scale = self.scale[:, None]
        # Step 2**(e - 3) in the binade [2**e, 2**(e + 1)) of |w| / scale, and 2**-9 among the subnormals (e < -6);
        # frexp's exponent is e + 1, exactly.
        _, exp = torch.frexp((w.to(torch.float32).abs() / scale).clamp(min=2.0**-6))
        return torch.ldexp(scale, (exp - 5).to(torch.float32))

    @staticmethod
    def _codes(x: torch.Tensor) -> torch.Tensor:
        # Clamp first: the conversion's own handling of values beyond 448 differs between torch versions/devices.
        return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


FORMATS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "fp8": Fp8Weight}


def weight_format(quantize: str) -> type[QuantizedWeight]:
    if quantize not in FORMATS:
        raise ValueError(f"unknown quantization {quantize!r}; supported: {', '.join(map(repr, FORMATS))}")
    return FORMATS[quantize]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Reference quantization of a full-precision local shard (what a sync with quantize=fmt produces)."""
    out = weight_format(fmt).empty(tuple(w.shape), w.device)
    out.set_scale_from_rowmax(w.detach().to(torch.float32).abs().amax(dim=1))
    out.write(((0, w.shape[0]), (0, w.shape[1])), w.detach())
    return out


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    return quantize(w, "int8")


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    return quantize(w, "fp8")


def is_quantized(param: LogicalParam, quantize: Optional[str], quantize_vocab: bool = False) -> bool:
    """Whether a sync with these settings stores `param` as a QuantizedWeight on the destination."""
    if quantize is None:
        return False
    weight_format(quantize)
    return len(param.shape) == 2 and (quantize_vocab or not param.is_vocab) and not param.name.endswith(ROUTER)


def quantized_targets(fmt: str, model_cfg, layout: ParallelLayout, pp_rank: int, tp_rank: int, *,
                      quantize_vocab: bool = False, device: Optional[torch.device] = None,
                      dp_rank: int = 0) -> dict[str, QuantizedWeight]:
    """Empty `fmt` weights for every quantized parameter of one generator stage, keyed by local name (a mixture of
    experts' experts too: which ones a rank holds depends on its `dp_rank` where EP runs over DP ranks)."""
    cls = weight_format(fmt)
    return {lp.local_name: cls.empty(lp.local_shape, device)
            for lp in stage_params(model_cfg, layout, pp_rank, tp_rank, dp_rank)
            if is_quantized(lp.param, fmt, quantize_vocab)}


def int8_targets(model_cfg, layout: ParallelLayout, pp_rank: int, tp_rank: int, *, quantize_vocab: bool = False,
                 device: Optional[torch.device] = None) -> dict[str, Int8Weight]:
    return quantized_targets("int8", model_cfg, layout, pp_rank, tp_rank, quantize_vocab=quantize_vocab,
                             device=device)
