"""Profiling helpers.

`nvtx_range(name)` marks a region for Nsight Systems (`nsys profile --capture-range=nvtx ...`) and for
`torch.profiler` (through `record_function`).  It is a no-op where it would cost or break something:
on builds without CUDA, and while `torch.compile` traces (a range there would be a graph break).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Push an NVTX range (CUDA builds) and a profiler record_function for the duration of the block."""
    if torch.compiler.is_compiling():
        yield
        return
    use_nvtx = torch.cuda.is_available()
    if use_nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.autograd.profiler.record_function(name):
            yield
    finally:
        if use_nvtx:
            torch.cuda.nvtx.range_pop()
