"""Int8 weight-only quantization used by DDMA's quantize-on-receive."""

import pytest
import torch

from megatron_rl.ddma.descriptors import LogicalParam
from megatron_rl.ddma.quant import INT8_ERROR_OVER_HALF_STEP, Int8Weight, int8_targets, is_quantized, quantize_int8
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


def test_writes_in_pieces_equal_one_write():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 12, generator=g)
    whole = quantize_int8(w)
    pieces = Int8Weight.empty((8, 12))
    pieces.set_scale_from_rowmax(torch.maximum(w[:, :5].abs().amax(1), w[:, 5:].abs().amax(1)))
    pieces.write(((0, 8), (5, 12)), w[:, 5:])
    pieces.write(((0, 3), (0, 5)), w[:3, :5])
    pieces.write(((3, 8), (0, 5)), w[3:, :5])
    assert torch.equal(pieces.qweight, whole.qweight) and torch.equal(pieces.scale, whole.scale)


def test_which_parameters_are_quantized():
    mat = LogicalParam("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), 0, 2)
    vocab = LogicalParam("embedding.word_embeddings.weight", (10, 4), 0, 1, True)
    norm = LogicalParam("decoder.final_layernorm.weight", (4,), None)
    assert [is_quantized(p, "int8") for p in (mat, vocab, norm)] == [True, False, False]
    assert is_quantized(vocab, "int8", quantize_vocab=True)
    assert not is_quantized(mat, None)
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        is_quantized(mat, "fp4")
    targets = int8_targets(get_preset("tiny"), ParallelLayout(tp=2, pp=2), 1, 0)
    assert sorted({n.split(".", 3)[-1] for n in targets}) == [
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight"]
    assert targets["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 88)
