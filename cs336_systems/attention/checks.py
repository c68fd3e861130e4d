"""Input validation shared by every attention implementation.

Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, d_v == d); leading dims identical.
"""

from __future__ import annotations

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the offending argument and the shapes involved."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.shape[-1] != k.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"head dim d must match across q, k, v (last dim); got {shapes}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length Nk (dim -2); got {shapes}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"leading (batch/head) dims must match across q, k, v; got {shapes}")
