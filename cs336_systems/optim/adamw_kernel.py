"""The fused AdamW update of many tensors in one Triton kernel launch: every byte read once and written once.

Per element (fp32 arithmetic, the order of torch's fused AdamW):

    p  <- p * (1 - lr * weight_decay)
    m  <- m + (1 - beta1) * (g - m)                   (= beta1 m + (1 - beta1) g)
    v  <- beta2 * v + (1 - beta2) * g * g
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    w  <- p rounded to w's dtype                      (only when a compute copy is given)

p, m, v are float32; g is the gradient in any float dtype (bf16 from bf16 compute weights); w is the low-precision
weight the model computes with.  Bytes per element with bf16 g and w: 4+2+4+4 read, 4+4+4+2 written = 28, as
many as torch's fused AdamW on float32 parameters (16 read, 12 written), which also has no compute copy to write.

One launch covers a list of tensors (a model's parameters: ~200 at 2.7B).  Launching a kernel per tensor
from Python costs ~45 µs of host time each, ~10 ms a step, which a step whose host side is slow or noisy
cannot hide.  The launch here reads, per program, which tensor its block belongs to from a block table, and
the tensor's addresses from int64 address tables: the static ones (master, moments, compute weights, sizes)
built once and cached by the caller, the gradients' (new tensors every step) copied from pinned host memory
each step.  All tensors of a launch share the gradient dtype, the compute dtype and the hyperparameters.

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
def _adamw_tensors_kernel(
    block_tensor_ptr, block_first_ptr, numel_ptr, p_tab, g_tab, m_tab, v_tab, w_tab, g_like, w_like,
    decay, beta2, one_minus_beta1, one_minus_beta2, step_size, sqrt_bias2, eps,
    HAS_COMPUTE_COPY: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)  # which tensor this block is in
    n = tl.load(numel_ptr + t)
    offs = (pid - tl.load(block_first_ptr + t)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p_ptr = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(g_like.dtype.element_ty))
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
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
        w_ptr = tl.load(w_tab + t).to(tl.pointer_type(w_like.dtype.element_ty))
        tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


class TensorTables:
    """The static part of a launch over fixed tensors: the block table and the address tables of the masters,
    moments and compute weights.  Build once per set of tensors; valid while none of them is reallocated.

    masters, exp_avgs, exp_avg_sqs: contiguous float32, pairwise of one shape; computes: None, or contiguous
    tensors of those shapes (one dtype) that receive the updated weights.
    """

    def __init__(self, masters, exp_avgs, exp_avg_sqs, computes=None) -> None:
        device = masters[0].device
        numels = [t.numel() for t in masters]
        blocks = [triton.cdiv(n, BLOCK) for n in numels]
        firsts = [0]
        for b in blocks[:-1]:
            firsts.append(firsts[-1] + b)
        self.total_blocks = sum(blocks)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(masters), dtype=torch.int32), torch.tensor(blocks)).to(device)
        self.block_first = torch.tensor(firsts, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.p_tab = _addresses(masters, device)
        self.m_tab = _addresses(exp_avgs, device)
        self.v_tab = _addresses(exp_avg_sqs, device)
        self.w_tab = _addresses(computes, device) if computes else self.p_tab
        self.keep = (masters, exp_avgs, exp_avg_sqs, computes)  # the addresses stay valid while these live
        self.w_like = computes[0] if computes else masters[0]


def adamw_update_many(
    tables: TensorTables, grads: list[torch.Tensor], *, decay: float, beta1: float, beta2: float,
    step_size: float, sqrt_bias2: float, eps: float,
) -> None:
    """One AdamW step of every tensor of ``tables``, in place, in one launch.

    grads: contiguous, one per tensor, of its shape, all of one float dtype.
    decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), sqrt_bias2 = sqrt(1 - beta2^t).
    """
    if tables.total_blocks == 0:
        return
    device = grads[0].device
    ptrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    if device.type == "cuda":
        # pinned and non-blocking: a copy from pageable memory would first wait for the stream's queued work
        g_tab = ptrs.pin_memory().to(device, non_blocking=True)
    else:
        g_tab = ptrs
    # 1 - beta in double on the host, as torch does: in float32 on the device, 1 - fp32(0.999) is off by 1e-5
    _adamw_tensors_kernel[(tables.total_blocks,)](
        tables.block_tensor, tables.block_first, tables.numels, tables.p_tab, g_tab, tables.m_tab, tables.v_tab,
        tables.w_tab, grads[0], tables.w_like,
        decay, beta2, 1.0 - beta1, 1.0 - beta2, step_size, sqrt_bias2, eps,
        HAS_COMPUTE_COPY=tables.keep[3] is not None and len(tables.keep[3]) > 0, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
