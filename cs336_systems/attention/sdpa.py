"""PyTorch's fused attention, `torch.nn.functional.scaled_dot_product_attention`.

"sdpa" lets PyTorch pick the backend per call; "sdpa-flash", "sdpa-cudnn" and "sdpa-efficient" pin one
backend (CUDA only) so benchmarks compare against a known kernel: FlashAttention-2, cuDNN's fused
attention, and the memory-efficient (xformers-style) kernel.  PyTorch's `is_causal` uses the top-left
alignment this package's signature specifies.

A pinned backend that cannot take the inputs (float32 for FlashAttention-2 and cuDNN, a head dim or a GPU
it does not support) makes SDPA fail with "No available kernel"; `unsupported_reason` asks PyTorch's own
dispatch checks (``torch.backends.cuda.can_use_*``) first, so the registry's `attention()` and the model
can refuse such inputs with the reason before calling.  Empty problems (no queries, no keys or an empty
batch) never reach the fused kernels, pinned or not: they get the reference computation, which handles them (zeros
where a query sees no key, empty where there is no query), with gradients.  Grouped-query attention (k, v with
fewer heads in dim -3 than q) goes through SDPA's ``enable_gqa=True``, on inputs folded to (B, H, N, d).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.naive import naive_attention


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    if not q.numel() or not k.shape[-2]:
        # empty problems: the reference computation (on CUDA, SDPA returns None for an empty 4-D batch)
        return naive_attention(q, k, v, is_causal)
    if _gqa(q, k):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[:-2] != k.shape[:-2]


def _fold(t: torch.Tensor) -> torch.Tensor:
    """(..., N, d) -> (B, 1, N, d): the fused backends take only 4-D inputs (any leading dims fold into B).

    Never ``reshape(-1, ...)``: with N or d equal to 0 the -1 is ambiguous and reshape refuses."""
    if t.dim() == 3:
        return t.unsqueeze(1)
    return t.reshape(t.shape[:-2].numel(), 1, t.shape[-2], t.shape[-1])


def _fold_heads(t: torch.Tensor) -> torch.Tensor:
    """(..., H, N, d) -> (B, H, N, d), keeping the head dim apart (grouped-query attention pairs heads)."""
    return t.reshape(t.shape[:-3].numel(), t.shape[-3], t.shape[-2], t.shape[-1])


def _pinned(backend: SDPBackend, q, k, v, is_causal: bool = False) -> torch.Tensor:
    if not q.numel() or not k.shape[-2]:
        # no queries, no keys or an empty batch: nothing for a fused kernel to do (and some refuse it)
        return naive_attention(q, k, v, is_causal)
    if _gqa(q, k):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(_fold_heads(q), _fold_heads(k), _fold_heads(v), is_causal=is_causal,
                                                 enable_gqa=True)
        return out.reshape(q.shape[:-1] + (v.shape[-1],))
    if q.dim() == 4:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(_fold(q), _fold(k), _fold(v), is_causal=is_causal)
    return out.reshape(q.shape[:-1] + (v.shape[-1],))


PINNED_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}

# PyTorch's own checks of whether a backend takes the inputs (dtype, head dim, GPU architecture, layout).
_CAN_USE = {
    "sdpa-flash": "can_use_flash_attention",
    "sdpa-cudnn": "can_use_cudnn_attention",
    "sdpa-efficient": "can_use_efficient_attention",
}


def pinned(name: str):
    """The attention function for a pinned backend name (see PINNED_BACKENDS)."""
    return functools.partial(_pinned, PINNED_BACKENDS[name])


def cuda_only(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def unsupported_reason(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    """Why the pinned backend ``name`` cannot run these (CUDA) inputs, or None if it can (or cannot tell).

    Asks ``torch.backends.cuda.can_use_<backend>`` on the folded 4-D inputs; its debug warnings are the reason.
    Empty problems are always supported (`_pinned` does not send them to the kernel).
    """
    if q.device.type != "cuda" or not q.numel() or not k.shape[-2]:
        return None
    check = getattr(torch.backends.cuda, _CAN_USE[name], None)
    if check is None:  # an older PyTorch without this query: let the call decide
        return None
    gqa = _gqa(q, k)
    fold = _fold_heads if gqa else _fold
    params = torch.backends.cuda.SDPAParams(fold(q), fold(k), fold(v), None, 0.0, bool(is_causal), gqa)
    if check(params, False):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(params, True)
    reasons = [str(w.message).strip() for w in caught]
    return "; ".join(reasons) or f"PyTorch's {_CAN_USE[name]} refuses these inputs"
