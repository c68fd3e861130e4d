"""Named ranges for profilers: `nvtx_range(name)`.

The range is an NVTX push/pop for Nsight Systems (`nsys profile --capture-range=nvtx ...`) and a
`record_function` for `torch.profiler`, whose per-phase summaries (`cs336_systems.tools.kernel_summary`)
attribute kernels to these names.  The NVTX push is skipped on builds without CUDA, and the whole range
while `torch.compile` traces (a range there would be a graph break).
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
