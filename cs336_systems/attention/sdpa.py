"""PyTorch's fused attention, `torch.nn.functional.scaled_dot_product_attention`.

"sdpa" lets PyTorch pick the backend per call; "sdpa-flash", "sdpa-cudnn" and "sdpa-efficient" pin one
backend (CUDA only) so benchmarks compare against a known kernel: FlashAttention-2, cuDNN's fused
attention, and the memory-efficient (xformers-style) kernel.  PyTorch's `is_causal` uses the top-left
alignment this package's signature specifies.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _pinned(backend: SDPBackend, q, k, v, is_causal: bool = False) -> torch.Tensor:
    # The fused backends take only (B, H, N, d): fold any leading dims into B, with H = 1.
    q4, k4, v4 = (t.reshape(-1, 1, t.shape[-2], t.shape[-1]) if t.dim() != 4 else t for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=is_causal)
    return out.reshape(q.shape[:-1] + (v.shape[-1],))


PINNED_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def pinned(name: str):
    """The attention function for a pinned backend name (see PINNED_BACKENDS)."""
    return functools.partial(_pinned, PINNED_BACKENDS[name])


def cuda_only(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()
