"""Launchers of the FlashAttention-2 Triton kernels, one per kernel, with an explicit tile configuration.

Every tensor is (BH, N, d) with unit stride on d; L and D are (BH, Nq) float32.  `wrap` is applied to
each kernel before launching it: `torch.library.wrap_triton` inside the registered ops (so
torch.compile traces the launch), the identity on the eager fast path and in the autotuner.

The softmax scales are constexprs: inductor passes Python floats to user kernels as fp64 scalars,
which once turned every score tile's multiply into fp64 (see results/h100/flash-attention-log.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton

from cs336_systems.attention import triton_kernels as kernels
from cs336_systems.attention.flash_configs import TileConfig

LOG2E = 1.4426950408889634


def direct(kernel):
    """Launch the kernel as is (no tracing wrapper)."""
    return kernel


def precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs (TF32 would lose fp32 accuracy); ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
            cfg: TileConfig, wrap: Callable = direct, longest_first: bool = True) -> None:
    """o (BH, Nq, d) and lse (BH, Nq) written in place."""
    bh, n_queries, d = q.shape
    grid = (triton.cdiv(n_queries, cfg.block_m), bh)
    wrap(kernels.flash_fwd_kernel)[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        n_queries, k.shape[1], qk_scale=LOG2E / math.sqrt(d),
        CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), LONGEST_FIRST=longest_first, **cfg.launch_kwargs(),
    )


def dkdv(q, k, v, do, lse, delta, dk, dv, causal: bool, cfg: TileConfig, wrap: Callable = direct) -> None:
    """dk, dv (BH, Nk, d) written in place."""
    bh, n_queries, d = q.shape
    n_keys = k.shape[1]
    sm_scale = 1.0 / math.sqrt(d)
    wrap(kernels.flash_bwd_dkdv_kernel)[(triton.cdiv(n_keys, cfg.block_n), bh)](
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        n_queries, n_keys, sm_scale=sm_scale, qk_scale=sm_scale * LOG2E,
        CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), **cfg.launch_kwargs(),
    )


def dq(q, k, v, do, lse, delta, dq_out, causal: bool, cfg: TileConfig, wrap: Callable = direct,
       longest_first: bool = True, *, o: torch.Tensor) -> None:
    """dq_out (BH, Nq, d) and delta (BH, Nq) = rowsum(o * do) written in place (delta is what the dK/dV
    kernel reads: launch this one first)."""
    bh, n_queries, d = q.shape
    sm_scale = 1.0 / math.sqrt(d)
    wrap(kernels.flash_bwd_dq_kernel)[(triton.cdiv(n_queries, cfg.block_m), bh)](
        q, k, v, do, lse, delta, dq_out, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq_out.stride(0), dq_out.stride(1), o.stride(0), o.stride(1),
        n_queries, k.shape[1], sm_scale=sm_scale, qk_scale=sm_scale * LOG2E,
        CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), LONGEST_FIRST=longest_first,
        **cfg.launch_kwargs(),
    )
