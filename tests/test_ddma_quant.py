"""Int8 and fp8 weight-only quantization used by DDMA's quantize-on-receive."""

import pytest
import torch

from megatron_rl.ddma.descriptors import LogicalParam
from megatron_rl.ddma.quant import (INT8_ERROR_OVER_HALF_STEP, FORMATS, Fp8Weight, int8_targets, is_quantized,
                                    quantize, quantize_fp8, quantize_int8, quantized_targets)
from megatron_rl.models import get_preset
from megatron_rl.parallel import ParallelLayout


def test_quantize_int8_is_per_row_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0  # an all-zero row keeps scale 1 and quantizes to 0
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (64,)
    assert torch.equal(q.qweight.abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), 127, dtype=torch.int8))
    assert q.scale[5] == 1 and torch.all(q.qweight[5] == 0)
    err = (q.dequantize() - w).abs() / (q.scale[:, None] / 2)
    assert err.max() <= INT8_ERROR_OVER_HALF_STEP


def test_quantize_fp8_is_per_row_e4m3_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0  # an all-zero row keeps scale 1 and quantizes to 0
    w[9, :8] *= 1e-5  # far below the row maximum: e4m3 subnormals
    q = quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scale.shape == (64,)
    codes = q.qweight.float()
    assert torch.equal(codes.abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), 448.0))
    assert q.scale[5] == 1 and torch.all(codes[5] == 0)
    # the reference, written out: scale = row max / 448, codes = w / scale rounded to e4m3 (ties to even)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    assert torch.equal(q.dequantize(), (w / scale).to(torch.float8_e4m3fn).float() * scale)
    err = (q.dequantize() - w).abs() / q.half_step(w)
    assert 0.9 < err.max() <= Fp8Weight.ERROR_OVER_HALF_STEP
    # relative to the element, the error is at most 1/32 (half of e4m3's 1/16 step) above 2**-6 of the scale
    normal = w.abs() >= q.scale[:, None] * 2.0**-6
    assert ((q.dequantize() - w).abs() / w.abs())[normal].max() <= 2.0**-4 * Fp8Weight.ERROR_OVER_HALF_STEP


def test_fp8_half_steps_are_e4m3_spacing():
    q = Fp8Weight.empty((1, 6))
    x = torch.tensor([[448.0, 256.0, 255.0, 1.0, 2.0**-6, 2.0**-8]])
    # step 2**(e-3) in [2**e, 2**(e+1)), 2**-9 below 2**-6
    assert q.half_step(x).tolist() == [[16.0, 16.0, 8.0, 2.0**-4, 2.0**-10, 2.0**-10]]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_writes_in_pieces_equal_one_write(fmt):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 12, generator=g)
    whole = quantize(w, fmt)
    pieces = FORMATS[fmt].empty((8, 12))
    pieces.set_scale_from_rowmax(torch.maximum(w[:, :5].abs().amax(1), w[:, 5:].abs().amax(1)))
    pieces.write(((0, 8), (5, 12)), w[:, 5:])
    pieces.write(((0, 3), (0, 5)), w[:3, :5])
    pieces.write(((3, 8), (0, 5)), w[3:, :5])
    assert torch.equal(pieces.qweight.view(torch.uint8), whole.qweight.view(torch.uint8))
    assert torch.equal(pieces.scale, whole.scale)


def test_which_parameters_are_quantized():
    mat = LogicalParam("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), 0, 2)
    vocab = LogicalParam("embedding.word_embeddings.weight", (10, 4), 0, 1, True)
    norm = LogicalParam("decoder.final_layernorm.weight", (4,), None)
    assert [is_quantized(p, "int8") for p in (mat, vocab, norm)] == [True, False, False]
    assert [is_quantized(p, "fp8") for p in (mat, vocab, norm)] == [True, False, False]
    assert is_quantized(vocab, "int8", quantize_vocab=True)
    assert not is_quantized(mat, None)
    with pytest.raises(ValueError, match="unknown quantization 'fp4'; supported: 'int8', 'fp8'"):
        is_quantized(mat, "fp4")
    targets = int8_targets(get_preset("tiny"), ParallelLayout(tp=2, pp=2), 1, 0)
    assert sorted({n.split(".", 3)[-1] for n in targets}) == [
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight"]
    assert targets["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 88)
    fp8 = quantized_targets("fp8", get_preset("tiny"), ParallelLayout(tp=2, pp=2), 1, 0)
    assert sorted(fp8) == sorted(targets) and all(type(w) is Fp8Weight for w in fp8.values())
    assert all(fp8[n].nbytes == targets[n].nbytes for n in fp8)  # one byte per weight + a float32 scale per row
