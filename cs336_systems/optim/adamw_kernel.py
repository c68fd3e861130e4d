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
    p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n,
    decay, beta2, one_minus_beta1, one_minus_beta2, step_size, sqrt_bias2, eps,
    HAS_COMPUTE_COPY: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    # IEEE-rounded sqrt and divisions (not the approximate ones): the update matches torch's to fp32 rounding
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), sqrt_bias2) + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COMPUTE_COPY:
        tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)


def adamw_update(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    compute: torch.Tensor | None, *, decay: float, beta1: float, beta2: float, step_size: float,
    sqrt_bias2: float, eps: float,
) -> None:
    """One AdamW step of one tensor, in place, in one kernel.

    master, exp_avg, exp_avg_sq: contiguous float32 of one shape; grad: contiguous, that shape, any float dtype;
    compute: None or a contiguous tensor of that shape that receives the updated weights rounded to its dtype.
    decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), sqrt_bias2 = sqrt(1 - beta2^t).
    """
    n = master.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    # 1 - beta in double on the host, as torch does: in float32 on the device, 1 - fp32(0.999) is off by 1e-5
    # compute=None: pass master as the (unused) pointer, the constexpr removes the store
    _adamw_kernel[grid](
        master, grad, exp_avg, exp_avg_sq, master if compute is None else compute, n,
        decay, beta2, 1.0 - beta1, 1.0 - beta2, step_size, sqrt_bias2, eps,
        HAS_COMPUTE_COPY=compute is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
