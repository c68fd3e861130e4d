"""FlashAttention-2 in Triton: launchers, torch.library ops and the autograd.Function.

    FlashAttentionTriton.apply(q, k, v, is_causal=False) -> o
    q: (..., Nq, d)   k, v: (..., Nk, d)   o: (..., Nq, d)   d in {16, 32, 64, 128}

Forward: one fused kernel (grid: query tiles x batch*heads) with an online softmax over key tiles;
saves Q, K, V, O and L = logsumexp(Q K^T / sqrt(d)) (shape q.shape[:-1], float32).
Backward: preprocess D = rowsum(O * dO); a dK/dV kernel (K, V resident, loop over query tiles) and a
dQ kernel (Q, dO resident, loop over key tiles): every output tile has exactly one writer, no atomics.

The kernels are registered as `torch.library.triton_op`s (cs336::flash_attn_fwd / _bwd) and launched
through `wrap_triton`, so `torch.compile(FlashAttentionTriton.apply, fullgraph=True)` traces them as
opaque ops without graph breaks.

On a CPU tensor the kernels only run under Triton's interpreter (TRITON_INTERPRET=1 set before this
module is imported); otherwise a ValueError says so.  float32 inputs use IEEE fp32 dots (not TF32) so
fp32 results stay at fp32 accuracy.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from torch.library import triton_op, wrap_triton

from cs336_systems.attention import triton_kernels as kernels
from cs336_systems.attention.checks import check_qkv

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """CUDA tensors, or CPU tensors under the Triton interpreter."""
    return (device.type == "cuda" and torch.cuda.is_available()) or (device.type == "cpu" and interpreter_active())


def _config(d: int, dtype: torch.dtype, kind: str) -> dict:
    """Tile sizes and launch settings per kernel (tuned later by the speed issue)."""
    if interpreter_active():
        # The interpreter runs each program as numpy ops: bigger tiles mean fewer Python iterations.
        return dict(BLOCK_M=32, BLOCK_N=32)
    if kind == "fwd":
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8 if d >= 128 else 4, num_stages=3 if d <= 64 else 2)
    # backward: dK/dV tiles over keys (BLOCK_N), dQ tiles over queries (BLOCK_M)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4 if d <= 64 else 8, num_stages=2)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton_op("cs336::flash_attn_fwd", mutates_args={})
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (BH, Nq, d), k, v: (BH, Nk, d), unit stride on d -> (o (BH, Nq, d), L (BH, Nq) float32)."""
    bh, n_queries, d = q.shape
    n_keys = k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty((bh, n_queries), device=q.device, dtype=torch.float32)
    cfg = _config(d, q.dtype, "fwd")
    block_m = cfg.pop("BLOCK_M")
    block_n = cfg.pop("BLOCK_N")
    grid = (triton.cdiv(n_queries, block_m), bh)
    wrap_triton(kernels.flash_fwd_kernel)[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        n_queries, n_keys, qk_scale=(1.0 / math.sqrt(d)) * 1.4426950408889634,
        CAUSAL=is_causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype), **cfg,
    )
    return o, lse


@triton_op("cs336::flash_attn_bwd", mutates_args={})
def flash_attn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn_fwd; all tensors (BH, N, d) with unit stride on d, lse (BH, Nq)."""
    bh, n_queries, d = q.shape
    n_keys = k.shape[1]
    delta = torch.empty((bh, n_queries), device=q.device, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg = _config(d, q.dtype, "bwd")
    block_m = cfg.pop("BLOCK_M")
    block_n = cfg.pop("BLOCK_N")
    sm_scale = 1.0 / math.sqrt(d)
    qk_scale = sm_scale * 1.4426950408889634
    precision = _precision(q.dtype)
    wrap_triton(kernels.flash_bwd_preprocess_kernel)[(triton.cdiv(n_queries, block_m), bh)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), n_queries,
        HEAD_DIM=d, BLOCK_M=block_m,
    )
    wrap_triton(kernels.flash_bwd_dkdv_kernel)[(triton.cdiv(n_keys, block_n), bh)](
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        n_queries, n_keys, sm_scale=sm_scale, qk_scale=qk_scale,
        CAUSAL=is_causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, **cfg,
    )
    wrap_triton(kernels.flash_bwd_dq_kernel)[(triton.cdiv(n_queries, block_m), bh)](
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1),
        n_queries, n_keys, sm_scale=sm_scale, qk_scale=qk_scale,
        CAUSAL=is_causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, **cfg,
    )
    return dq, dk, dv


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_qkv(q, k, v)
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash-triton supports head dims {SUPPORTED_HEAD_DIMS}; got d={d} (q shape {tuple(q.shape)})")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"flash-triton supports float32, bfloat16, float16; got dtype {q.dtype}")
    if not available(q.device):
        raise ValueError(
            f"flash-triton needs CUDA tensors (q is on {q.device}); on CPU it runs only under the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing cs336_systems.attention.flash_triton"
        )
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"flash-triton needs Nq >= 1 and Nk >= 1; got q {tuple(q.shape)}, k {tuple(k.shape)}")


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """(..., N, d) -> (BH, N, d) with unit stride on d (a view when the layout allows)."""
    t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        _validate(q, k, v)
        o, lse = torch.ops.cs336.flash_attn_fwd(_as_3d(q), _as_3d(k), _as_3d(v), bool(is_causal))
        o = o.view(q.shape)
        lse = lse.view(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.cs336.flash_attn_bwd(
            _as_3d(q), _as_3d(k), _as_3d(v), _as_3d(o), lse.reshape(-1, q.shape[-2]), _as_3d(grad_out),
            ctx.is_causal,
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return FlashAttentionTriton.apply(q, k, v, is_causal)
