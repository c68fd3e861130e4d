"""Input validation shared by every attention implementation.

Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, d_v == d); leading dims identical; d >= 1.
``is_causal`` is a Python bool (a string such as "false" is truthy, so it is refused rather than read as
causal).  The checks are plain Python on shapes and dtypes: no device work, no synchronization.
"""

from __future__ import annotations

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, allow_gqa: bool = False) -> None:
    """Raise ValueError naming the offending argument and the shapes involved.

    ``allow_gqa``: k and v may have fewer heads (dim -3) than q, a divisor of q's (grouped-query attention:
    query head h reads K/V head h // (Hq // Hkv)); the other leading dims still match."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    d = q.shape[-1]
    if not d or k.shape[-1] != d or v.shape[-1] != d:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if not d:
            raise ValueError(f"head dim d (the last dim of q, k, v) must be >= 1; got {shapes}")
        raise ValueError(f"head dim d must match across q, k, v (last dim); got {shapes}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length Nk (dim -2); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"leading (batch/head) dims must match across k and v; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[:-2] == k.shape[:-2]:
        return
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if allow_gqa and q.dim() == k.dim() >= 3 and q.shape[:-3] == k.shape[:-3]:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv and hq % hkv == 0:
            return
        raise ValueError(f"grouped-query attention needs the K/V head count (dim -3) to divide the query head "
                         f"count; got {hq} query heads and {hkv} K/V heads ({shapes})")
    raise ValueError(f"leading (batch/head) dims must match across q, k, v{' (or differ only in the head dim -3, for grouped-query attention)' if allow_gqa else ''}; got {shapes}")


def dims_text(dims: tuple[int, ...]) -> str:
    """A set of head dims for an error message: (8, 16, ..., 256) -> "multiples of 8 from 8 to 256"; any other
    set as the tuple."""
    step = dims[1] - dims[0] if len(dims) > 2 else 0
    if step > 0 and dims[0] == step and dims == tuple(range(dims[0], dims[-1] + 1, step)):
        return f"multiples of {step} from {dims[0]} to {dims[-1]}"
    return str(dims)


def is_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k has fewer heads than q (inputs already passed `check_qkv(..., allow_gqa=True)`)."""
    return q.shape[:-2] != k.shape[:-2]


def check_is_causal(is_causal: object) -> None:
    """``is_causal`` must be True or False (ValueError naming it otherwise: "false" would read as causal)."""
    if is_causal is not True and is_causal is not False:
        raise ValueError(f"is_causal must be a bool (True or False), got {is_causal!r} ({type(is_causal).__name__})")
