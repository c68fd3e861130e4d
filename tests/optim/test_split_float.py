"""split_float: a float32 as a bf16 plus 16 low bits, exactly; the bf16 is round-to-nearest except on ties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems.optim.split_float import join, split

EDGES = [0, -2**31, 0x00000001, 0x80000001, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
         0x7FFF8000, 0x7FFFFFFF, 0xFFFFFFFF, 0x3F808000, 0x3F818000, 0xBF808000, 0x0000FFFF, 0x00008000]


def _floats(patterns: list[int]) -> torch.Tensor:
    """Unsigned 32-bit patterns -> the float32 tensor with those bits."""
    b = torch.tensor([p % 2**32 for p in patterns], dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_join_undoes_split_for_every_number_and_nan_stays_nan(patterns):
    x = _floats(patterns + EDGES)
    hi, lo = split(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16 and hi.shape == lo.shape == x.shape
    nan = torch.isnan(x)
    assert torch.equal(join(hi, lo).view(torch.int32)[~nan], x.view(torch.int32)[~nan])
    # every NaN (0x7FFFFFFF, a GPU's, included) becomes the quiet NaN: a NaN weight, not a zero or an infinity
    assert bool(torch.isnan(hi[nan]).all()) and bool((lo[nan] == 0).all())
    assert bool((join(hi, lo)[nan].view(torch.int32) == 0x7FC00000).all())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_hi_is_torchs_bf16_rounding_except_on_ties(patterns):
    x = _floats(patterns + EDGES)
    hi, _ = split(x)
    finite = torch.isfinite(x) & torch.isfinite(x.to(torch.bfloat16))
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    same = hi.view(torch.int16) == x.to(torch.bfloat16).view(torch.int16)
    assert bool((same | tie)[finite].all())
    # a tie rounds away from zero: |hi| is the larger neighbour
    t = finite & tie
    assert bool((hi.float().abs()[t] > x.abs()[t]).all())


def test_nearest_and_ties_by_hand():
    one_and_half_step = 1.0 + 2**-8  # halfway between bf16 1.0 and 1.0078125
    hi, lo = split(torch.tensor([one_and_half_step, -one_and_half_step, 1.0 + 2**-9]))
    assert hi.tolist() == [1.0078125, -1.0078125, 1.0]
    assert lo.tolist() == [-0x8000, -0x8000, 0x4000]


def test_shapes_and_strides_are_kept():
    x = torch.randn(6, 4).t()  # non-contiguous
    hi, lo = split(x)
    assert hi.shape == lo.shape == (4, 6) and hi.is_contiguous()
    assert torch.equal(join(hi, lo), x)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: split(torch.zeros(2, dtype=torch.bfloat16)), "split takes a float32 tensor, got dtype torch.bfloat16"),
    (lambda: join(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16)),
     r"join takes a bf16 hi and an int16 lo of one shape, got torch.bfloat16 \(2,\) and torch.int16 \(3,\)"),
    (lambda: join(torch.zeros(2), torch.zeros(2, dtype=torch.int16)), "join takes a bf16 hi"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
