"""Attention benchmarks (cases from benchmarks.json; workloads: cs336_systems.bench.workloads.attention).

attention    the handout's PyTorch-attention sweep (1.2.1): batch 8, q, k, v of shape (B, N, d), head
             dim x sequence length, forward and backward timed separately (the backward's forward
             runs untimed before each round) and the memory in use before backward; naive vs its
             torch.compile, FlashAttention-2 in Triton for contrast.  Large N runs out of memory: those
             cells are recorded as OOM, not failures.
flash        FlashAttention-2 (Triton) against naive and PyTorch's fused kernels (SDPA pinned to
             FlashAttention-2 and to cuDNN): batch 1, causal, N from 128 to 65536 x d x bf16/fp32,
             forward, backward and both.
leaderboard  the assignment's leaderboard shape (B=1, H=16, N=16384, d=64, bf16, causal), and the same at
             H=8, d=128, timed as
             triton.testing.do_bench does: median, L2 flushed before every round; flash-triton (through
             torch.compile with compile=true) next to SDPA's FlashAttention-2 and cuDNN in the same run.

Every case first checks the implementation against a float32 reference on the same inputs and fails if
it is wrong; an implementation that cannot run on this device, or has no kernel for the case's dtype,
is skipped with the reason.
"""

import pytest

from cs336_systems import attention
from cs336_systems.bench.workloads import attention as attention_workloads


def _run_attention_case(case, bench, device):
    name = case["impl"]
    if not attention.get(name).available(device):
        pytest.skip(f"{name} is not available on {device.type}")
    metrics: dict = {}  # accuracy error, memory before backward: filled by the workload as it runs
    try:
        bench(
            lambda: attention_workloads.attention_step(
                **attention_workloads.step_arguments(case), device=device, metrics=metrics
            ),
            case=case,
            flops_per_step=attention_workloads.case_flops(case),
            extra_info=metrics,
        )
    except attention_workloads.Unsupported as exc:  # raised by the accuracy check, before any timing
        pytest.skip(str(exc))


@pytest.mark.suite("attention")
def test_attention(case, bench, perf_device):
    _run_attention_case(case, bench, perf_device)


@pytest.mark.suite("flash")
def test_flash(case, bench, perf_device):
    _run_attention_case(case, bench, perf_device)


@pytest.mark.suite("leaderboard")
def test_leaderboard(case, bench, perf_device):
    _run_attention_case(case, bench, perf_device)
