"""A float32 tensor stored as a bf16 tensor plus the 16 low bits it lost: exactly, in 4 bytes an element.

A float32's bit pattern is 32 bits; bf16 is its upper 16 (same sign and exponent, 7 of the 23 mantissa
bits).  So a float32 master weight and the bf16 weight a model computes with need not take 4 + 2 bytes:
the bf16 weight already holds the upper half, and a 16-bit integer holds what rounding removed.  The split
(`split`):

    b   = the float32's bit pattern, as an unsigned 32-bit integer
    hi  = (b + 0x8000) >> 16             the bf16 rounded to nearest, ties away from zero
    lo  = b - (hi << 16)                 in [-0x8000, 0x7FFF]: a signed 16-bit integer

and the join (`join`) is b = (hi << 16) + lo, modulo 2^32: the round trip is exact for every number
(infinities, zeros of both signs and subnormals included).  A NaN is split as the canonical quiet NaN
0x7FC00000 (hi NaN, lo 0): its payload is not kept, but it stays a NaN in the bf16 weight, where the
bit arithmetic would otherwise carry some NaNs (0x7FFFFFFF, the one a GPU produces) into a zero or an
infinity.  ``hi`` is what `torch.Tensor.to(torch.bfloat16)` gives except on exact ties (the low 16 bits
exactly 0x8000, one value in 65536), where torch rounds to even and this rounds away from zero:
round-half-even would need lo = +0x8000 for half the ties, one value more than 16 bits hold.

`cs336_systems.optim.AdamWMaster` keeps its masters this way by default: 2 bytes an element fewer than a
float32 copy beside the bf16 weight (6.3 GiB at 2.7B), and 2 bytes fewer read and written per update.
Its Triton kernel does the same integer arithmetic in 32-bit registers (`adamw_kernel`); these are the
PyTorch-ops reference (in 64-bit integers, so nothing overflows).
"""

from __future__ import annotations

import torch

_LOW = 1 << 16
_HALF = 1 << 15
_WORD = 1 << 32
QUIET_NAN = 0x7FC00000  # what a NaN is split as


def _to_int16(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^16) taken as 16-bit patterns -> the int16 with those bits."""
    return torch.where(x >= _HALF, x - _LOW, x).to(torch.int16)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (any shape) -> (hi: bf16, lo: int16), both of ``x``'s shape and contiguous."""
    if x.dtype != torch.float32:
        raise ValueError(f"split takes a float32 tensor, got dtype {x.dtype}")
    x = x.contiguous()
    b = torch.where(torch.isnan(x), QUIET_NAN, x.view(torch.int32).to(torch.int64) % _WORD)  # unsigned bits
    r = b + _HALF
    hi = (r // _LOW) % _LOW
    lo = r % _LOW - _HALF
    return _to_int16(hi).view(torch.bfloat16), lo.to(torch.int16)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(hi: bf16, lo: int16) of one shape -> the float32 they split from (a new contiguous tensor)."""
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16 or hi.shape != lo.shape:
        raise ValueError(f"join takes a bf16 hi and an int16 lo of one shape, got {hi.dtype} {tuple(hi.shape)} "
                         f"and {lo.dtype} {tuple(lo.shape)}")
    h = hi.contiguous().view(torch.int16).to(torch.int64) % _LOW
    b = (h * _LOW + lo.to(torch.int64)) % _WORD
    return torch.where(b >= _WORD // 2, b - _WORD, b).to(torch.int32).view(torch.float32)
