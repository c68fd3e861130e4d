"""Precision modes, used everywhere by name.

  "fp32"  no autocast; float32 weights, activations and matmuls (TF32 left at PyTorch's default: off)
  "bf16"  torch.autocast(dtype=bfloat16); float32 master weights, gradients and optimizer state
  "fp16"  torch.autocast(dtype=float16) with a torch.amp.GradScaler for the backward pass

What autocast does to each tensor of a small network is probed in `cs336_systems.tools.amp_probe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


@contextlib.contextmanager
def autocast(precision: str, device: torch.device | str) -> Iterator[None]:
    """The autocast context of a precision mode on ``device`` (nothing for fp32)."""
    dtype = PRECISIONS[check_precision(precision)]
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


def grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (whose gradients underflow without one), None otherwise."""
    if check_precision(precision) != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)
