"""Facts about the machine a measurement ran on, and peak throughput per GPU.

`machine_facts()` is what extends pytest-benchmark's machine_info: GPU name and count, driver, CUDA,
cuDNN, torch and triton versions, and the library's switches set in the environment (``CS336_*``
variables, e.g. ``CS336_FLASH_TMA=0`` or ``CS336_FLASH_SPLIT_D=1`` for an A/B run), so a saved run says
which code paths it measured.  Two saved runs are only comparable in absolute time when the fields in
COMPARABLE_FIELDS agree (`incomparable_fields`); switches are not among them: an A/B pair differs in them
on purpose.

`peak_tflops(gpu_name, precision)` looks up the dense (no sparsity) datasheet peak used for MFU.
Sources: NVIDIA H100 datasheet (SXM5: FP32 67, TF32 495, BF16/FP16 989.4 TFLOP/s dense; PCIe: 51,
378, 756), H200 datasheet (same tensor-core rates as H100 SXM), A100 datasheet (FP32 19.5, TF32 156,
BF16 312).  Pass an explicit peak (``--peak-tflops``) for any GPU not listed or for a measured ceiling
(this workplace's H100 reaches ~745-798 TFLOP/s on a large bf16 GEMM: MFU against that is ~1.3x
higher than against the datasheet).
"""

from __future__ import annotations

import platform
import subprocess

import torch

from cs336_systems import switches as _switches

# (substring of torch.cuda.get_device_name(), {precision: dense TFLOP/s}); first match wins.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
]

COMPARABLE_FIELDS = ("gpu_name", "gpu_count", "cuda", "torch", "triton")


def peak_tflops(gpu_name: str | None, precision: str) -> float | None:
    """Datasheet dense peak for ``precision`` ("fp32", "tf32", "bf16", "fp16") or None if unknown."""
    if not gpu_name:
        return None
    for key, peaks in _PEAKS:
        if key in gpu_name:
            return peaks.get(precision)
    return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def machine_facts() -> dict[str, object]:
    """GPU and software facts; GPU fields are None on a machine without CUDA."""
    facts: dict[str, object] = {
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "gpu_name": None,
        "gpu_count": 0,
        "gpu_memory_gib": None,
        "driver": None,
        "switches": switches(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu_name=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=_driver_version(),
        )
    return facts


SWITCH_PREFIX = _switches.PREFIX


def switches() -> dict[str, str]:
    """The ``CS336_*`` environment variables that are set (non-empty), sorted by name: the library's own
    switches (`cs336_systems.switches.REGISTRY`: flash-triton's kernel choices, TMA, key splits, split
    tiles, float32 dots, autotuning, ...), and any unregistered ``CS336_*`` name, so that a typo shows."""
    return _switches.active()


def default_profile() -> str:
    """The benchmarks.json profile suited to this machine: "gpu" with CUDA, else "cpu"."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def incomparable_fields(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(field, value in a, value in b) for each COMPARABLE_FIELDS entry on which two runs differ."""
    return [(f, a.get(f), b.get(f)) for f in COMPARABLE_FIELDS if a.get(f) != b.get(f)]


# What a baseline comparison also holds equal (`baseline_differences`), beyond COMPARABLE_FIELDS: the cuDNN and
# the driver (SDPA's kernels and the GPU's clocks change with them), and the library's switches set in the
# environment (a run with a kernel switched off is an A/B run, not a regression check).  Reports and A/B
# comparisons do not hold these equal: an A/B pair differs in its switches on purpose.
BASELINE_FIELDS = ("cudnn", "driver", "switches")


def baseline_differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(field, value in a, value in b) for each BASELINE_FIELDS entry on which two runs differ (a run saved
    without a field, before it was recorded, is not held to it)."""
    return [(f, a.get(f), b.get(f)) for f in BASELINE_FIELDS
            if f in a and f in b and (a.get(f) or {} if f == "switches" else a.get(f))
            != (b.get(f) or {} if f == "switches" else b.get(f))]
