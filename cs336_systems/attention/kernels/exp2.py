"""exp2 of a float32 tile with part of its elements computed on the FMA pipes instead of the exponential unit.

    exp2_mixed(x, EMULATED, PACK)   (Triton)       x: float32 tile, any shape; x <= 0 in the softmax
    exp2_mixed_gluon(x, EMULATED, PACK)   (Gluon)
    emulated_exp2_reference(x)      (torch)        the emulated arithmetic, for tests on any device

Why: an SM's exponential unit (MUFU) does 16 exp2 a clock, 8 cycles for a warp's 32, while its FP32 pipes do a
warp's FMA in one.  At head dim 64 a softmax tile's exponentials take as many cycles as its two tile products
(docs/flash-attention-experiments.md, Section 19), so the softmax runs at the exponential unit's pace.  Moving a
fraction of the elements to a polynomial on the FMA pipes (FlashAttention-4's trick on Blackwell) trades 8 MUFU
cycles for 9 issued instructions on the other pipes; the balance point is about a quarter of the elements.

The emulation, per element (Cody-Waite with a rounding constant instead of a conversion, which would go to the
same slow unit):

    x  = max(x, -126)                      the result stays a float32 (subnormal at -126; exp2 there is ~1e-38)
    t  = x + 1.5 * 2^23                    rounds x to the nearest integer n, kept in t's low mantissa bits
    f  = x - (t - 1.5 * 2^23)              f = x - n in [-0.5, 0.5]
    p  = c0 + f (c1 + f (c2 + f c3))       2^f, relative error 7.5e-5 (a least-squares fit of the relative
                                           error, flattened to minimax by reweighting)
    y  = bits(p) + (bits(t) << 23)         adds n to p's exponent: bits(t) << 23 == n << 23 (mod 2^32)

In the softmax the result is rounded to bfloat16 (relative step 3.9e-3) before the P V product, and the row sums
take the float32 values, whose 7.5e-5 error is below the sums' own rounding over a tile.  Masked scores
(-1e6 after scaling) come out as ~1e-38 instead of 0: they add nothing a float32 sum can see.

PACK consecutive elements of a thread go through one inline-assembly block: the first EMULATED of them are
emulated, the others take `ex2.approx.ftz.f32`.  EMULATED 0 is plain exp2 (and the only form the Triton
interpreter can run: callers pass 0 there).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# 2^f on [-0.5, 0.5]: c0 + c1 f + c2 f^2 + c3 f^3, float32
COEFFS = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
CLAMP = -126.0
ROUND = 12582912.0  # 1.5 * 2^23
MAX_RELATIVE_ERROR = 7.5e-5  # of the emulated elements, against exact 2^x (tests)


def _f32(value: float) -> str:
    """A PTX float32 immediate (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _emulated(out: str, inp: str) -> str:
    c0, c1, c2, c3 = (_f32(c) for c in COEFFS)
    return "\n".join((
        f"max.f32 a, {inp}, {_f32(CLAMP)};",
        f"add.rn.f32 t, a, {_f32(ROUND)};",
        f"sub.rn.f32 r, t, {_f32(ROUND)};",
        "sub.rn.f32 f, a, r;",
        f"fma.rn.f32 p, f, {c3}, {c2};",
        f"fma.rn.f32 p, p, f, {c1};",
        f"fma.rn.f32 p, p, f, {c0};",
        "shl.b32 t, t, 23;",
        f"add.s32 {out}, p, t;",
    ))


def asm(emulated: int, pack: int) -> str:
    """The inline PTX for one PACK of elements ($0..$PACK-1 out, $PACK.. in), the first `emulated` emulated."""
    if not 0 < emulated <= pack:
        raise ValueError(f"emulated must be in 1..pack={pack}; got emulated={emulated}")
    lines = ["{", ".reg .b32 a, t, r, f, p;"]
    for i in range(pack):
        if i < emulated:
            lines.append(_emulated(f"${i}", f"${pack + i}"))
        else:
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${pack + i};")
    lines.append("}")
    return "\n".join(lines)


def constraints(pack: int) -> str:
    return ",".join(["=r"] * pack + ["r"] * pack)


# The forms the kernels use: (emulated, pack) -> the assembly, as constexprs the JIT functions select by value.
ASM_1_OF_8 = tl.constexpr(asm(1, 8))
ASM_2_OF_8 = tl.constexpr(asm(2, 8))
ASM_3_OF_8 = tl.constexpr(asm(3, 8))
ASM_4_OF_8 = tl.constexpr(asm(4, 8))
CONSTRAINTS_8 = tl.constexpr(constraints(8))
FRACTIONS = (0, 1, 2, 3, 4)  # EMULATED values of 8 the kernels accept


@triton.jit
def exp2_mixed(x, EMULATED: tl.constexpr):
    """2^x elementwise (float32), EMULATED of every 8 consecutive elements of a thread on the FMA pipes."""
    if EMULATED == 0:
        return tl.math.exp2(x)
    elif EMULATED == 1:
        return tl.inline_asm_elementwise(ASM_1_OF_8, CONSTRAINTS_8, [x], dtype=tl.float32, is_pure=True, pack=8)
    elif EMULATED == 2:
        return tl.inline_asm_elementwise(ASM_2_OF_8, CONSTRAINTS_8, [x], dtype=tl.float32, is_pure=True, pack=8)
    elif EMULATED == 3:
        return tl.inline_asm_elementwise(ASM_3_OF_8, CONSTRAINTS_8, [x], dtype=tl.float32, is_pure=True, pack=8)
    else:
        tl.static_assert(EMULATED == 4, "EMULATED must be one of exp2.FRACTIONS")
        return tl.inline_asm_elementwise(ASM_4_OF_8, CONSTRAINTS_8, [x], dtype=tl.float32, is_pure=True, pack=8)


@gluon.jit
def exp2_mixed_gluon(x, EMULATED: gl.constexpr):
    """`exp2_mixed` for Gluon kernels (the result keeps x's layout)."""
    if EMULATED == 0:
        return gl.exp2(x)
    elif EMULATED == 1:
        return gl.inline_asm_elementwise(ASM_1_OF_8, CONSTRAINTS_8, [x], dtype=gl.float32, is_pure=True, pack=8)
    elif EMULATED == 2:
        return gl.inline_asm_elementwise(ASM_2_OF_8, CONSTRAINTS_8, [x], dtype=gl.float32, is_pure=True, pack=8)
    elif EMULATED == 3:
        return gl.inline_asm_elementwise(ASM_3_OF_8, CONSTRAINTS_8, [x], dtype=gl.float32, is_pure=True, pack=8)
    else:
        gl.static_assert(EMULATED == 4, "EMULATED must be one of exp2.FRACTIONS")
        return gl.inline_asm_elementwise(ASM_4_OF_8, CONSTRAINTS_8, [x], dtype=gl.float32, is_pure=True, pack=8)


def emulated_exp2_reference(x: torch.Tensor) -> torch.Tensor:
    """The emulated path's arithmetic in torch float32, step for step (rounding constant, polynomial, exponent
    add; the polynomial's multiply-adds may round twice where the PTX fuses them), for checking the algorithm
    where the inline assembly cannot run."""
    x = torch.clamp(x.float(), min=CLAMP)
    t = x + ROUND
    f = x - (t - ROUND)
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in COEFFS)
    p = torch.addcmul(c2, f, c3)
    p = torch.addcmul(c1, p, f)
    p = torch.addcmul(c0, p, f)
    # the exponent add in 64-bit integers, wrapped to 32 bits as the PTX add and shift wrap
    bits = (p.view(torch.int32).to(torch.int64) + (t.view(torch.int32).to(torch.int64) << 23)) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32)
