"""Mixed-precision probes (handout §1.1.5): what autocast actually does to each tensor of a small network.

`probe_dtypes` reports the dtype of each tensor of the handout's `ToyModel` under autocast (answers and
reasons in `EXPECTED_PROBE`); `accumulation_experiment` sums 0.01 a thousand times in fp32, fp16,
fp16-into-fp32 and explicitly upcast fp16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.amp import PRECISIONS, check_precision

class ToyModel(nn.Module):
    """The handout's toy network: x (B, in) -> fc1 (B, 10) -> ReLU -> LayerNorm(10) -> fc2 (B, out)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, in_features) -> logits (B, out_features)."""
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


PROBE_KEYS = ("parameters", "fc1", "relu", "ln", "logits", "loss", "gradients")

# The answers `probe_dtypes` gives, by device type, with L the autocast dtype (bf16 or fp16).  Why each one:
#   parameters  fp32: autocast never touches module state; it casts *copies* of the inputs per op (and caches
#               the low-precision copy of each weight for the duration of the context).
#   fc1, logits L: linear/matmul are on every device's "lower precision" list, so both operands are cast to L
#               and the GEMM runs (and writes) in L.
#   relu        L: not on any list; it runs in its input's dtype, fc1's output.
#   ln (CUDA)   fp32: layer_norm is on CUDA autocast's fp32 list (a mean/variance over L values loses too much).
#   ln (CPU)    L: CPU autocast does not list layer_norm; the CPU kernel accepts an L input with fp32
#               weight/bias and returns the input's dtype.
#   loss        fp32: cross_entropy is on the fp32 list (CPU: cross_entropy_loss; CUDA: log_softmax runs with
#               dtype=fp32 and nll_loss is fp32).
#   gradients   fp32: a gradient has its parameter's dtype; autograd carries it back through the fp32 -> L
#               cast that autocast recorded, upcasting it on the way.
# Verified on torch 2.13 (CPU, both L) and from the policy lists in aten/src/ATen/autocast_mode.cpp (CUDA).
EXPECTED_PROBE = {
    "cuda": {"parameters": "fp32", "fc1": "low", "relu": "low", "ln": "fp32",
             "logits": "low", "loss": "fp32", "gradients": "fp32"},
    "cpu": {"parameters": "fp32", "fc1": "low", "relu": "low", "ln": "low",
            "logits": "low", "loss": "fp32", "gradients": "fp32"},
}


def expected_probe(dtype: torch.dtype, device_type: str) -> dict[str, torch.dtype]:
    """`EXPECTED_PROBE[device_type]` with "low" replaced by ``dtype`` and "fp32" by torch.float32."""
    if device_type not in EXPECTED_PROBE:
        raise ValueError(f"device_type={device_type!r} has no pinned answers; valid: {', '.join(EXPECTED_PROBE)}")
    return {key: (dtype if kind == "low" else torch.float32) for key, kind in EXPECTED_PROBE[device_type].items()}


def _only_dtype(tensors: list[torch.Tensor], what: str) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"{what} have mixed dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def probe_dtypes(
    dtype: torch.dtype | str,
    *,
    device: torch.device | str = "cpu",
    batch: int = 4,
    in_features: int = 8,
    out_features: int = 5,
    seed: int = 0,
) -> dict[str, torch.dtype]:
    """Run ToyModel forward + cross-entropy backward under ``torch.autocast(device.type, dtype)``.

    ``dtype`` is torch.bfloat16 / torch.float16 or the precision name "bf16" / "fp16".  Returns the dtype of
    each tensor in PROBE_KEYS: the parameters as seen inside the autocast context, the outputs of fc1, ReLU
    and LayerNorm (read by forward hooks), the logits, the loss, and the parameters' gradients.  See
    EXPECTED_PROBE for the answers and the reason for each.
    """
    if isinstance(dtype, str):
        dtype = PRECISIONS[check_precision(dtype)]
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16 (or 'bf16'/'fp16'), got {dtype!r}")
    for name, value in (("batch", batch), ("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ToyModel(in_features, out_features).to(device)
    x = torch.randn(batch, in_features, generator=generator).to(device)
    targets = torch.randint(0, out_features, (batch,), generator=generator).to(device)

    seen: dict[str, torch.dtype] = {}
    handles = [
        getattr(model, name).register_forward_hook(
            lambda _module, _inputs, output, name=name: seen.__setitem__(name, output.dtype)
        )
        for name in ("fc1", "relu", "ln")
    ]
    try:
        with torch.autocast(device_type=device.type, dtype=dtype):
            seen["parameters"] = _only_dtype(list(model.parameters()), "parameters")
            logits = model(x)  # (B, out_features)
            loss = F.cross_entropy(logits, targets)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    seen["logits"] = logits.dtype
    seen["loss"] = loss.dtype
    seen["gradients"] = _only_dtype([p.grad for p in model.parameters()], "gradients")
    return {key: seen[key] for key in PROBE_KEYS}


class Accumulation(NamedTuple):
    """The four sums of the accumulation experiment (see `accumulation_experiment`)."""

    fp32: float
    fp16: float
    fp16_into_fp32: float
    fp16_upcast: float


def accumulation_experiment(steps: int = 1000, increment: float = 0.01) -> Accumulation:
    """Add ``increment`` ``steps`` times into an accumulator four ways (handout §1.1.5):

      fp32            fp32 accumulator += fp32 increment   -> 10.0001: fp32 rounding of 0.01 and of each sum
      fp16            fp16 accumulator += fp16 increment   -> 9.9531: every partial sum is rounded to fp16,
                      whose spacing near 8..10 is 2^-7 = 0.0078, comparable to the increment itself
      fp16_into_fp32  fp32 accumulator += fp16 increment   -> 10.0021: type promotion adds in fp32; the only
                      error left is fp16's representation of 0.01 (0.0100021...), times 1000
      fp16_upcast     fp32 accumulator += fp16 increment explicitly .type(fp32) -> 10.0021: the same thing
                      written out; the upcast cannot restore digits fp16 already dropped

    Lesson: keep accumulators (sums, reductions, optimizer state) in fp32 even when the values are fp16.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if not isinstance(increment, (int, float)) or isinstance(increment, bool):
        raise TypeError(f"increment must be a float, got {increment!r}")

    def run(acc_dtype: torch.dtype, inc_dtype: torch.dtype, upcast: bool) -> float:
        s = torch.tensor(0.0, dtype=acc_dtype)
        x = torch.tensor(increment, dtype=inc_dtype)
        for _ in range(steps):
            s += x.type(torch.float32) if upcast else x
        return float(s)

    return Accumulation(
        fp32=run(torch.float32, torch.float32, upcast=False),
        fp16=run(torch.float16, torch.float16, upcast=False),
        fp16_into_fp32=run(torch.float32, torch.float16, upcast=False),
        fp16_upcast=run(torch.float32, torch.float16, upcast=True),
    )
