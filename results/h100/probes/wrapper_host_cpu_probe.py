"""CPU probe (sixth session, no device time): host cost of FlashAttentionTriton's Python wrapper alone.

The three kernel launchers are replaced by no-ops and the call runs on CPU tensors (TRITON_INTERPRET=1 only
so `available()` accepts them), next to a minimal autograd.Function that allocates the same outputs: the
difference is what the wrapper itself (validation, reshapes/views, config selection, ctx) costs per call,
without Triton's launch path.  The pieces are timed alone as well.  Best of 5 repeats.

    PYTHONPATH=$PWD python results/h100/probes/wrapper_host_cpu_probe.py > results/h100/probes/wrapper-host-cpu-2026-11-21f.txt
"""

import os
import timeit

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is imported

import torch  # noqa: E402

from cs336_systems.attention import flash_launch, flash_triton  # noqa: E402
from cs336_systems.attention.checks import check_qkv  # noqa: E402

for name in ("forward", "dq", "dkdv"):
    setattr(flash_launch, name, lambda *args, **kwargs: None)


class Minimal(torch.autograd.Function):
    """The floor: same allocations and saved tensors, no validation, no reshapes."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


q, k, v = (torch.randn(1, 1, 1024, 64, requires_grad=True) for _ in range(3))
grad_out = torch.randn(1, 1, 1024, 64)


def fwd_bwd(fn):
    torch.autograd.grad(fn(q, k, v, True), (q, k, v), grad_out)


def best_us(stmt, number):
    return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e6


print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
for label, fn in (("minimal autograd.Function", Minimal.apply), ("FlashAttentionTriton (stubbed)",
                                                                   flash_triton.FlashAttentionTriton.apply)):
    print(f"{label:32s} fwd+bwd {best_us(lambda: fwd_bwd(fn), 3000):6.1f} us")
q3 = flash_triton._as_3d(q.detach())
pieces = {
    "check_qkv": lambda: check_qkv(q, k, v),
    "_validate": lambda: flash_triton._validate(q, k, v),
    "_as_3d (reshape)": lambda: flash_triton._as_3d(q),
    "view back to (B, H, N, d)": lambda: q3.view(q.shape),
    "empty_like": lambda: torch.empty_like(q3),
}
for label, stmt in pieces.items():
    print(f"  {label:30s} {best_us(stmt, 20000):5.2f} us")
