"""Copies as wide elements (`ddma.wide_copy`) move exactly the bytes a copy in the tensors' own dtype moves."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.ddma.wide_copy import copy_slice, wide_views

DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float64]


@st.composite
def slice_pairs(draw):
    """A random box of a random 2-D or 3-D tensor and an equally shaped box of another."""
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim - 1)] + [draw(st.sampled_from([1, 3, 8, 16, 24, 40]))]
    box_shape = [draw(st.integers(1, n)) for n in shape]

    def box(full):
        return tuple(slice(o, o + b) for o, b in zip((draw(st.integers(0, n - b)) for n, b in zip(full, box_shape)),
                                                    box_shape))

    # The other tensor is wider in its last dimension by a random amount: other row strides, other offsets.
    other = shape[:-1] + [shape[-1] + draw(st.sampled_from([0, 1, 8, 16]))]
    return dtype, shape, box(shape), other, box(other)


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 127, shape, generator=g).to(dtype)


@settings(max_examples=300, deadline=None)
@given(slice_pairs())
def test_wide_copy_equals_a_plain_copy(case):
    dtype, dst_shape, dst_box, src_shape, src_box = case
    src = _random(src_shape, dtype, 1)
    a, b = _random(dst_shape, dtype, 2), _random(dst_shape, dtype, 2)
    copy_slice(a[dst_box], src[src_box])
    b[dst_box].copy_(src[src_box])
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes, so NaN payloads count too


@pytest.mark.parametrize("cols, offset, want", [
    (1024, 0, torch.complex128),  # a TP column slice of a bf16 row-parallel weight: 16-byte elements
    (1024, 1024, torch.complex128),
    (1020, 4, torch.int64),  # 2,040-byte rows: 8 bytes divide them, 16 do not
    (1022, 2, torch.int32),
    (1023, 1, torch.bfloat16),  # odd rows stay as they are
])
def test_widest_element_the_views_allow(cols, offset, want):
    full = torch.zeros(8, 2048, dtype=torch.bfloat16)
    d, s = wide_views(full[:, offset:offset + cols], torch.zeros(8, cols, dtype=torch.bfloat16))
    assert d.dtype == s.dtype == want
    assert d.numel() * d.element_size() == 8 * cols * 2


def test_different_dtypes_are_cast_not_reinterpreted():
    a, b = torch.zeros(4, 16, dtype=torch.bfloat16), torch.randn(4, 16)
    assert wide_views(a, b)[0].dtype == torch.bfloat16
    copy_slice(a, b)
    assert torch.equal(a, b.to(torch.bfloat16))
