"""Attention implementations behind one signature, selected by name.

Every implementation is a function ``fn(q, k, v, is_causal=False) -> o`` with

    q: (..., Nq, d)    k, v: (..., Nk, d)    o: (..., Nq, d)

and any leading batch/head dimensions.  Causal masking is aligned at position 0: query i attends to keys
j <= i (PyTorch SDPA's top-left convention, and the handout's ``torch.where(i >= j, S, -1e6)``).

Public names: `attention(q, k, v, is_causal, impl=...)`, `names()`, `available(device)`, `get(name)`,
`register(...)`, and the autograd.Function classes `FlashAttentionPytorch` and `FlashAttentionTriton`
(Triton is imported only when the latter is first used).

Each registered implementation carries an availability predicate, so callers (the model, the perf
suites) can ask which implementations run on a device before trying them, and an ``unsupported(q, k, v,
is_causal)`` hook that names what it cannot compute (a dtype, a head dim) on a device where it is
available.  Unknown names raise ``ValueError`` listing the valid ones.

`attention()` is the checked entry point: it validates the inputs (`checks.check_qkv`: shapes, dtypes, one
device, d >= 1; ``is_causal`` a bool), then refuses, with a ValueError naming the implementation, the device
and the implementations available there, an implementation that is not available on the inputs' device or
does not support the inputs.  `check_available(name, device, head_dim=...)` and `check_inputs(name, q, k, v,
is_causal)` are the same checks for callers that call ``get(name).fn`` themselves (the model checks at build
time and at its first forward on each device and dtype).  ``get(name).fn`` itself checks nothing beyond what
the implementation does: it is what the benchmarks time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cs336_systems import switches
from cs336_systems.attention.checks import check_is_causal, check_qkv, dims_text, is_gqa

AttentionFn = Callable[..., torch.Tensor]
# unsupported(q, k, v, is_causal) -> None if the implementation computes these inputs, else the reason
UnsupportedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], "str | None"]


def _always_available(device: torch.device) -> bool:
    return True


def _always_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class AttentionImpl:
    """A registered implementation: ``fn``, where it runs (``available``), what it computes there
    (``unsupported``, given valid inputs on an available device: the reason it cannot, or None) and the head
    dims it takes (``head_dims``; None: any), which the model checks when it is built."""

    name: str
    fn: AttentionFn
    available: Callable[[torch.device], bool]
    description: str = ""
    unsupported: UnsupportedFn = _always_supported
    head_dims: tuple[int, ...] | None = None
    gqa: bool = False


_REGISTRY: dict[str, AttentionImpl] = {}


def register(
    name: str,
    fn: AttentionFn,
    *,
    available: Callable[[torch.device], bool] | None = None,
    description: str = "",
    unsupported: UnsupportedFn | None = None,
    head_dims: tuple[int, ...] | None = None,
    gqa: bool = False,
) -> None:
    """Register ``fn`` under ``name``; ``available(device)`` says whether it can run on that device,
    ``unsupported(q, k, v, is_causal)`` why it cannot compute given inputs there (None: it can); ``gqa``
    whether it takes k and v with fewer heads than q (grouped-query attention)."""
    if name in _REGISTRY:
        raise ValueError(f"attention implementation {name!r} is already registered")
    _REGISTRY[name] = AttentionImpl(
        name=name, fn=fn, available=available or _always_available, description=description,
        unsupported=unsupported or _always_supported, head_dims=head_dims, gqa=gqa,
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


def check_available(name: str, device: torch.device | str, *, head_dim: int | None = None) -> AttentionImpl:
    """The implementation ``name`` if it runs on ``device`` (and takes ``head_dim``, when given); otherwise a
    ValueError naming the implementation, the device and the implementations available there."""
    impl = get(name)
    device = torch.device(device)
    if not impl.available(device):
        raise ValueError(
            f"attention implementation {name!r} is not available on device {device}; available "
            f"there: {', '.join(available(device)) or 'none'}")
    if head_dim is not None and impl.head_dims is not None and head_dim not in impl.head_dims:
        takes = [n for n in available(device) if _REGISTRY[n].head_dims is None or head_dim in _REGISTRY[n].head_dims]
        raise ValueError(
            f"attention implementation {name!r} supports head dims {dims_text(impl.head_dims)}, got "
            f"head_dim={head_dim}; "
            f"available on device {device} for head_dim={head_dim}: {', '.join(takes) or 'none'}")
    return impl


def check_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> AttentionImpl:
    """Everything `attention()` checks before it calls ``name``: the inputs (`check_qkv`, ``is_causal`` a
    bool), that ``name`` is available on their device and that it supports them (dtype, head dim, ...).
    ValueError naming the implementation, the device and the alternatives otherwise; plain Python on shapes,
    dtypes and devices (no device synchronization)."""
    impl = get(name)
    check_qkv(q, k, v, allow_gqa=True)
    check_is_causal(is_causal)
    device = q.device
    check_available(name, device, head_dim=q.shape[-1])
    if is_gqa(q, k) and not impl.gqa:
        others = [n for n in available(device) if _REGISTRY[n].gqa]
        raise ValueError(
            f"attention implementation {name!r} does not support grouped-query attention (q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}: {q.shape[-3]} query heads, {k.shape[-3]} K/V heads); implementations that "
            f"do on device {device}: {', '.join(others) or 'none'}")
    reason = impl.unsupported(q, k, v, is_causal)
    if reason is not None:
        others = [n for n in available(device) if n != name and _REGISTRY[n].unsupported(q, k, v, is_causal) is None]
        raise ValueError(
            f"attention implementation {name!r} does not support these inputs on device {device} "
            f"({q.dtype}, q {tuple(q.shape)}, k {tuple(k.shape)}, is_causal={is_causal}): {reason}; "
            f"implementations that do: {', '.join(others) or 'none'}")
    return impl


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *, impl: str = "naive"
) -> torch.Tensor:
    """Validate the inputs and ``impl``'s availability and support for them (`check_inputs`: ValueError
    naming the argument or the implementation), then dispatch to ``impl``."""
    return check_inputs(impl, q, k, v, is_causal).fn(q, k, v, is_causal=is_causal)


def _flash_triton_available(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and switches.interpreter_active()


def _flash_triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    # Mirrors flash_triton's own checks without importing Triton (the Function raises the same errors).
    from cs336_systems.attention.kernels.portable.configs import HEAD_DIMS

    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"flash-triton supports float32, bfloat16, float16; got dtype {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"flash-triton supports head dims that are {dims_text(HEAD_DIMS)}; got d={q.shape[-1]}"
    if q.dtype == torch.bfloat16 and (q.device.type != "cuda" or _triton_interpreted()):
        return ("flash-triton cannot compute bfloat16 under Triton's interpreter (TRITON_INTERPRET=1: the "
                "interpreter's bf16 tl.dot is wrong); use float32 or float16 there, or a CUDA device")
    if q.numel() and not k.shape[-2]:
        return "flash-triton needs Nk >= 1 when there are queries"
    return None


def _triton_interpreted() -> bool:
    """Whether flash-triton's kernels run in Triton's interpreter (decided when they are first imported)."""
    import sys

    kernels = sys.modules.get("cs336_systems.attention.kernels.portable.kernels")
    if kernels is not None:
        return type(kernels.flash_fwd_kernel).__name__ == "InterpretedFunction"
    return switches.interpreter_active()


_flash_triton_fn = None


def _flash_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    # Imported on first use: importing Triton is slow, and TRITON_INTERPRET must be set before the
    # @triton.jit decorators run for the CPU interpreter to take effect.  Kept after that: at the models'
    # short sequences every microsecond of an eager call's host time shows.
    # Only an eager call keeps it: torch.compile guards on this global, so a traced call that set it would
    # fail its own guard at the next call and compile the caller's frame a second time.
    global _flash_triton_fn
    fn = _flash_triton_fn
    if fn is None:
        from cs336_systems.attention.flash_triton import flash_attention as fn

        if not torch.compiler.is_compiling():
            _flash_triton_fn = fn
    return fn(q, k, v, is_causal)


def _pinned_unsupported(name: str):
    from cs336_systems.attention import sdpa

    def unsupported(q, k, v, is_causal):
        return sdpa.unsupported_reason(name, q, k, v, is_causal)

    return unsupported


def _flash_triton_head_dims() -> tuple[int, ...]:
    from cs336_systems.attention.kernels.portable.configs import HEAD_DIMS  # tables only: no Triton import

    return HEAD_DIMS


def _register_builtin() -> None:
    from cs336_systems.attention import flash_pytorch, naive, sdpa

    register("naive", naive.naive_attention, description="matmul, mask, softmax, matmul (reference)", gqa=True)
    register("naive-compiled", naive.naive_attention_compiled, description="torch.compile of naive", gqa=True)
    register("sdpa", sdpa.sdpa_attention, description="torch.nn.functional.scaled_dot_product_attention", gqa=True)
    for name, backend in sdpa.PINNED_BACKENDS.items():
        # GQA through enable_gqa=True; a backend that cannot take it says so through `unsupported`
        register(name, sdpa.pinned(name), available=sdpa.cuda_only, description=f"SDPA pinned to {backend.name}",
                 unsupported=_pinned_unsupported(name), gqa=True)
    register(
        "flash-pytorch", flash_pytorch.flash_attention_pytorch,
        description="FlashAttention-2 in plain PyTorch tiles, compiled recomputing backward (debug reference)",
    )
    register(
        "flash-triton", _flash_triton, available=_flash_triton_available, unsupported=_flash_triton_unsupported,
        head_dims=_flash_triton_head_dims(), gqa=True,
        description="FlashAttention-2 forward and backward in Triton (cs336_systems.attention.flash_triton)",
    )


_register_builtin()

# The autograd.Function classes, importable from here; FlashAttentionTriton is loaded on first access so
# that importing the registry does not import Triton (see _flash_triton).
_LAZY = {
    "FlashAttentionPytorch": "cs336_systems.attention.flash_pytorch",
    "FlashAttentionTriton": "cs336_systems.attention.flash_triton",
    "flash_attention": "cs336_systems.attention.flash_triton",
    "FlashOptions": "cs336_systems.attention.plan",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionImpl", "FlashAttentionPytorch", "FlashAttentionTriton", "FlashOptions", "attention", "available",
           "check_available", "check_inputs", "flash_attention", "get", "names", "register"]
