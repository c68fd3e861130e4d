"""The reference attention: scores by matmul, causal mask, softmax, matmul.

Shapes: q (..., Nq, d), k and v (..., Nk, d) -> o (..., Nq, d).  Grouped-query attention: k and v may have
fewer heads (dim -3) than q, a divisor of q's; each K/V head is repeated for its group of query heads
(materialized: this is the reference, not a fast path).

Each step runs inside an NVTX range ("attention scores", "softmax", "final matmul") so a profiler can
attribute time to the sub-steps.  Masked scores are set to -1e6 (the handout's convention) rather than
-inf, so a fully masked row would give a uniform distribution instead of NaN.
"""

from __future__ import annotations

import math

import torch

from cs336_systems.nvtx import nvtx_range

MASK_VALUE = -1e6


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """Boolean (Nq, Nk) mask, True where query i may attend key j (j <= i, aligned at position 0)."""
    i = torch.arange(n_queries, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    return i >= j


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    d = q.shape[-1]
    if q.dim() >= 3 and k.dim() == q.dim() and k.shape[-3] != q.shape[-3] and k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]  # query head h reads K/V head h // group
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    with nvtx_range("attention scores"):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (..., Nq, Nk)
        if is_causal:
            mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
            # -1e6 overflows float16: clamp to the dtype's range (exp underflows to 0 either way).
            scores = scores.masked_fill(~mask, max(MASK_VALUE, torch.finfo(scores.dtype).min))
    with nvtx_range("softmax"):
        probs = torch.softmax(scores, dim=-1)  # (..., Nq, Nk)
    with nvtx_range("final matmul"):
        return probs.to(v.dtype) @ v  # (..., Nq, d)


_compiled = None


def naive_attention_compiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    """`torch.compile` of `naive_attention`, compiled on first use (the NVTX ranges are skipped inside)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(naive_attention)
    return _compiled(q, k, v, is_causal=is_causal)
