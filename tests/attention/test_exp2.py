"""kernels/exp2: the partly emulated exp2 of the softmax tiles.  On CPU the emulation's arithmetic (through its
torch mirror) against exact 2^x and the generated assembly's shape; on a GPU the inline assembly itself, every
fraction, against torch.exp2."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems.attention.kernels import exp2

ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inline PTX)")


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-125.0, max_value=0.0, allow_nan=False, width=32))
def test_emulated_exp2_is_within_its_stated_relative_error(x):
    got = exp2.emulated_exp2_reference(torch.tensor([x], dtype=torch.float32)).item()
    assert abs(got / 2.0**x - 1.0) <= exp2.MAX_RELATIVE_ERROR


def test_emulated_exp2_over_a_dense_grid_and_below_the_clamp():
    """Every float32 step of the polynomial's interval and the integer boundaries (where f flips between
    -0.5 and 0.5); below -126 (masked scores, -1e6) a non-negative value under 2^-125, never a wrapped
    exponent (negative or huge)."""
    x = torch.cat([torch.linspace(-125.0, 0.0, 1_000_001), torch.arange(-125, 1).float() + 0.5,
                   torch.arange(-125, 1).float()])
    rel = (exp2.emulated_exp2_reference(x).double() / torch.exp2(x.double()) - 1).abs().max().item()
    assert rel <= exp2.MAX_RELATIVE_ERROR
    low = exp2.emulated_exp2_reference(torch.tensor([-126.0, -127.5, -1e6, -math.inf]))
    assert (low >= 0).all() and (low < 2.0**-125).all()


def test_assembly_emulates_the_first_elements_of_each_pack_and_rejects_bad_counts():
    for emulated in range(1, 9):
        text = exp2.asm(emulated, 8)
        assert text.count("ex2.approx.ftz.f32") == 8 - emulated
        assert len(re.findall(r"add\.s32 \$\d+, p, t;", text)) == emulated
        assert re.findall(r"ex2\.approx\.ftz\.f32 \$(\d+), \$(\d+);", text) == [
            (str(i), str(8 + i)) for i in range(emulated, 8)]
    assert exp2.constraints(2) == "=r,=r,r,r"
    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match=f"emulated={bad}"):
            exp2.asm(bad, 8)


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("emulated", exp2.FRACTIONS)
def test_gpu_mixed_exp2_matches_torch(emulated):
    """The kernels' form on a GPU: every element within the emulation's error (plus ex2.approx's own, a few
    units in the last place) of 2^x over the softmax's range, the masked scores' -1e6 a tiny non-negative."""
    import triton
    import triton.language as tl

    @triton.jit
    def apply(x_ptr, y_ptr, n, EMULATED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(y_ptr + offs, exp2.exp2_mixed(x, EMULATED), mask=offs < n)

    x = torch.cat([torch.linspace(-125.0, 0.0, 1 << 20, device="cuda"), torch.full((64,), -1e6, device="cuda")])
    y = torch.empty_like(x)
    apply[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), EMULATED=emulated, BLOCK=1024)
    visible = x > -125.0
    rel = (y[visible].double() / torch.exp2(x[visible].double()) - 1).abs().max().item()
    assert rel <= exp2.MAX_RELATIVE_ERROR + 1e-6
    assert (y[~visible] >= 0).all() and (y[~visible] < 2.0**-125).all()
