"""Attention implementations behind one signature, selected by name.

Every implementation is a function ``fn(q, k, v, is_causal=False) -> o`` with

    q: (..., Nq, d)    k, v: (..., Nk, d)    o: (..., Nq, d)

and any leading batch/head dimensions.  Causal masking is aligned at position 0: query i attends to keys
j <= i (PyTorch SDPA's top-left convention, and the handout's ``torch.where(i >= j, S, -1e6)``).

Public names: `attention(q, k, v, is_causal, impl=...)`, `names()`, `available(device)`, `get(name)`,
`register(...)`, and the autograd.Function classes `FlashAttentionPytorch` and `FlashAttentionTriton`
(Triton is imported only when the latter is first used).

Each registered implementation carries an availability predicate, so callers (the model, the perf
suites) can ask which implementations run on a device before trying them.  Unknown names raise
``ValueError`` listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cs336_systems.attention.checks import check_qkv

AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class AttentionImpl:
    name: str
    fn: AttentionFn
    available: Callable[[torch.device], bool]
    description: str = ""


_REGISTRY: dict[str, AttentionImpl] = {}


def register(
    name: str,
    fn: AttentionFn,
    *,
    available: Callable[[torch.device], bool] | None = None,
    description: str = "",
) -> None:
    """Register ``fn`` under ``name``; ``available(device)`` says whether it can run on that device."""
    if name in _REGISTRY:
        raise ValueError(f"attention implementation {name!r} is already registered")
    _REGISTRY[name] = AttentionImpl(
        name=name, fn=fn, available=available or (lambda device: True), description=description
    )


def names() -> list[str]:
    """All registered implementation names, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> AttentionImpl:
    """The implementation registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {name!r}; valid: {', '.join(sorted(_REGISTRY))}"
        ) from None


def available(device: torch.device | str | None = None) -> list[str]:
    """Names of the implementations that can run on ``device`` (default: CUDA if present, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return [name for name, impl in _REGISTRY.items() if impl.available(device)]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *, impl: str = "naive"
) -> torch.Tensor:
    """Validate the inputs (ValueError naming the argument), then dispatch to ``impl``."""
    fn = get(impl).fn
    check_qkv(q, k, v)
    return fn(q, k, v, is_causal=is_causal)


def _flash_triton_available(device: torch.device) -> bool:
    import os

    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _flash_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    # Imported on first use: importing Triton is slow, and TRITON_INTERPRET must be set before the
    # @triton.jit decorators run for the CPU interpreter to take effect.
    from cs336_systems.attention.flash_triton import flash_attention_triton

    return flash_attention_triton(q, k, v, is_causal)


def _register_builtin() -> None:
    from cs336_systems.attention import flash_pytorch, naive, sdpa

    register("naive", naive.naive_attention, description="matmul, mask, softmax, matmul (reference)")
    register("naive-compiled", naive.naive_attention_compiled, description="torch.compile of naive")
    register("sdpa", sdpa.sdpa_attention, description="torch.nn.functional.scaled_dot_product_attention")
    for name, backend in sdpa.PINNED_BACKENDS.items():
        register(name, sdpa.pinned(name), available=sdpa.cuda_only, description=f"SDPA pinned to {backend.name}")
    register(
        "flash-pytorch", flash_pytorch.flash_attention_pytorch,
        description="FlashAttention-2 in plain PyTorch tiles, compiled recomputing backward (debug reference)",
    )
    register(
        "flash-triton", _flash_triton, available=_flash_triton_available,
        description="FlashAttention-2 forward and backward in Triton (cs336_systems.attention.flash_triton)",
    )


_register_builtin()

# The autograd.Function classes, importable from here; FlashAttentionTriton is loaded on first access so
# that importing the registry does not import Triton (see _flash_triton).
_LAZY = {
    "FlashAttentionPytorch": "cs336_systems.attention.flash_pytorch",
    "FlashAttentionTriton": "cs336_systems.attention.flash_triton",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionImpl", "FlashAttentionPytorch", "FlashAttentionTriton", "attention", "available", "get",
           "names", "register"]
