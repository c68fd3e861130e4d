"""The fused AdamW update of one tensor as a Triton kernel: every byte read once and written once.

Per element (fp32 arithmetic, the order of torch's fused AdamW):

    p  <- p * (1 - lr * weight_decay)
    m  <- m + (1 - beta1) * (g - m)                   (= beta1 m + (1 - beta1) g)
    v  <- beta2 * v + (1 - beta2) * g * g
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    w  <- p rounded to w's dtype                      (only when a compute copy is given)

p, m, v are float32; g is the gradient in any float dtype (bf16 from bf16 compute weights); w is the low-precision
weight the model computes with.  Bytes per element with bf16 g and w: 4+2+4+4 read, 4+4+4+2 written = 28, as
many as torch's fused AdamW on float32 parameters (16 read, 12 written), which also has no compute copy to write.

Split masters (``lo`` given, `split_float`): p is not stored; it is joined from the bf16 w and the int16 low
bits lo, and split back into them after the update (integer arithmetic in registers).  Bytes per element:
2+2+2+4+4 read, 2+2+4+4 written = 26.

Imports Triton: load it lazily (`cs336_systems.optim.adamw_master` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 2048 elements a program, 4 warps: 16 contiguous fp32 a thread, enough bytes in flight per SM at the
# element counts of a model's weights (tens of millions), and a single wave's tail is a few hundred programs.
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, lo_ptr, n,
    decay, beta2, one_minus_beta1, one_minus_beta2, step_size, sqrt_bias2, eps,
    HAS_COMPUTE_COPY: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SPLIT:
        # master bits = (hi << 16) + lo, modulo 2^32 (uint32 arithmetic wraps; lo is sign-extended)
        hi = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
        p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    # IEEE-rounded sqrt and divisions (not the approximate ones): the update matches torch's to fp32 rounding
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), sqrt_bias2) + eps)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if SPLIT:
        # hi = (bits + 0x8000) >> 16 (nearest, ties away from zero); lo = bits - (hi << 16), in [-2^15, 2^15);
        # a NaN as the quiet NaN 0x7FC00000, which the rounding cannot carry into a zero or an infinity
        bits = tl.where(p != p, 0x7FC00000, p.to(tl.uint32, bitcast=True)).to(tl.uint32)
        hi = (bits + 0x8000) >> 16
        lo = (bits - (hi << 16)).to(tl.int32, bitcast=True).to(tl.int16)
        tl.store(w_ptr + offs, hi.to(tl.uint16).to(w_ptr.dtype.element_ty, bitcast=True), mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
        if HAS_COMPUTE_COPY:
            tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)


def adamw_update(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    compute: torch.Tensor | None, *, decay: float, beta1: float, beta2: float, step_size: float,
    sqrt_bias2: float, eps: float, lo: torch.Tensor | None = None,
) -> None:
    """One AdamW step of one tensor, in place, in one kernel.

    master, exp_avg, exp_avg_sq: contiguous float32 of one shape; grad: contiguous, that shape, any float dtype;
    compute: None or a contiguous tensor of that shape that receives the updated weights rounded to its dtype.
    Split masters: master None, compute the contiguous bf16 weights and lo their contiguous int16 low bits
    (`split_float`); both are read as the master and receive its update.
    decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), sqrt_bias2 = sqrt(1 - beta2^t).
    """
    n = exp_avg.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    # 1 - beta in double on the host, as torch does: in float32 on the device, 1 - fp32(0.999) is off by 1e-5
    # an absent tensor is passed as exp_avg (an unused pointer): the constexprs remove its loads and stores
    _adamw_kernel[grid](
        exp_avg if master is None else master, grad, exp_avg, exp_avg_sq, exp_avg if compute is None else compute,
        exp_avg if lo is None else lo, n,
        decay, beta2, 1.0 - beta1, 1.0 - beta2, step_size, sqrt_bias2, eps,
        HAS_COMPUTE_COPY=compute is not None, SPLIT=lo is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
