"""Attention workloads: each mode does what it says, the accuracy check catches wrong implementations."""

import math

import pytest
import torch

from cs336_systems import attention
from cs336_systems.bench.workloads import attention as attention_workloads
from cs336_systems.bench import harness as benchmarking
from cs336_systems.bench import flops
from cs336_systems.bench.workloads.attention import AccuracyError, Unsupported, attention_step


def _step(mode, **kw):
    args = dict(impl="naive", batch_size=2, seq_len=32, head_dim=16, causal=True, mode=mode)
    return attention_step(**(args | kw))


def test_forward_keeps_no_graph_and_has_no_per_round_hook():
    metrics = {}
    step = _step("forward", metrics=metrics)
    assert step.before_each is None
    assert not step.q.requires_grad
    step()
    assert metrics["accuracy_error"] < 1e-6 and metrics["accuracy_tolerance"] == 1e-3


def test_backward_times_only_the_backward_of_a_fresh_forward():
    step = _step("backward", dtype="bf16")
    assert step.q.requires_grad and callable(step.before_each)
    calls = []
    fn = step.fn
    step.fn = lambda *a, **kw: calls.append("forward") or fn(*a, **kw)
    with pytest.raises(RuntimeError, match="needs its before_each"):
        step()  # a backward round without its untimed forward is a wiring bug, not a measurement
    for _ in range(3):
        step.before_each()
        step()  # a second backward through one graph would raise: each round gets a fresh forward
    assert calls == ["forward"] * 3
    assert step.q.grad is None  # torch.autograd.grad: nothing accumulates between rounds


def test_forward_backward_runs_both_in_one_round():
    step = _step("forward-backward", heads=3)
    assert step.before_each is None and step.q.shape == (2, 3, 32, 16)
    step()
    step()


def test_harness_runs_the_backward_step_with_its_forward_before_each_round():
    metrics = {}
    result = benchmarking.measure(lambda: _step("backward", metrics=metrics), warmup=1, rounds=3)
    assert result.ok and len(result.times_s) == 3
    assert "memory_before_backward_gib" not in metrics  # CUDA only
    assert metrics["accuracy_error"] < 1e-6


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_inputs_are_seeded_random_in_the_case_dtype(dtype):
    torch_dtype = attention_workloads.DTYPES[dtype]
    a = attention_workloads.random_inputs((2, 8, 4), torch_dtype, torch.device("cpu"), requires_grad=False)
    b = attention_workloads.random_inputs((2, 8, 4), torch_dtype, torch.device("cpu"), requires_grad=False)
    for x, y in zip(a, b):
        assert x.dtype == torch_dtype and torch.equal(x, y) and (x != 0).all()
    assert not torch.equal(a[0], a[1])


def test_wrong_implementation_fails_the_accuracy_check():
    q, k, v, do = attention_workloads.random_inputs((1, 16, 8), torch.float32, torch.device("cpu"), requires_grad=True)
    with pytest.raises(AccuracyError, match=r"disagrees with the float32 reference.*o [0-9.e+-]+, dq"):
        attention_workloads.check_accuracy(lambda q, k, v, is_causal: (q + k + v) / 3, q, k, v, do, causal=True,
                                           mode="backward", dtype="fp32", impl="broken")

    def bad_backward(q, k, v, is_causal):  # right forward, gradients scaled by 1.1
        out = attention.get("naive").fn(q, k, v, is_causal=is_causal)
        return out * 1.1 - out.detach() * 0.1

    result = attention_workloads.check_accuracy(bad_backward, q, k, v, do, causal=True, mode="forward", dtype="fp32")
    assert result["accuracy_error"] < 1e-6  # forward mode only compares the output
    with pytest.raises(AccuracyError, match="dq"):
        attention_workloads.check_accuracy(bad_backward, q, k, v, do, causal=True, mode="forward-backward",
                                           dtype="fp32")


def test_nan_is_never_accurate():
    ref = torch.ones(4)
    assert attention_workloads.relative_error(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref) == math.inf
    assert attention_workloads.relative_error(torch.tensor([1.0, 1.5, 1.0, 1.0]), ref) == pytest.approx(0.5)


def _float64_attention(q, k, v, do, causal):
    """Independent check of the reference: float64, whole score matrix, einsum."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    o = torch.einsum("...qk,...kd->...qd", torch.softmax(s, -1), v)
    return [o, *torch.autograd.grad(o, (q, k, v), do.double())]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_bytes", [2**30, 3 * 20 * 4])  # one block; blocks of 1 row (< 1 row's bytes)
def test_reference_in_blocks_matches_float64(monkeypatch, causal, block_bytes):
    monkeypatch.setattr(attention_workloads, "REFERENCE_BLOCK_BYTES", block_bytes)
    q, k, v, do = attention_workloads.random_inputs((2, 3, 20, 8), torch.bfloat16, torch.device("cpu"),
                                                    requires_grad=True)
    got = attention_workloads.reference(q, k, v, do, causal=causal)
    want = _float64_attention(q, k, v, do, causal)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == q.shape
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    (o,) = attention_workloads.reference(q, k, v, None, causal=causal)
    torch.testing.assert_close(o.double(), want[0], rtol=1e-5, atol=1e-5)


def _patched_impl(monkeypatch, fn):
    real_get = attention.get
    impl = attention.AttentionImpl(name="fake", fn=fn, available=lambda device: True)
    monkeypatch.setattr(attention, "get", lambda name: impl if name == "fake" else real_get(name))


def test_no_kernel_for_the_inputs_is_unsupported_and_other_errors_propagate(monkeypatch):
    def no_kernel(q, k, v, is_causal=False):
        raise RuntimeError("No available kernel. Aborting execution.")

    _patched_impl(monkeypatch, no_kernel)
    with pytest.raises(Unsupported, match=r"fake has no kernel for fp32 inputs of shape \(1, 8, 16\)"):
        attention_step(impl="fake", batch_size=1, seq_len=8, head_dim=16, mode="forward")

    def out_of_memory(q, k, v, is_causal=False):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    _patched_impl(monkeypatch, out_of_memory)
    result = benchmarking.measure(
        lambda: attention_step(impl="fake", batch_size=1, seq_len=8, head_dim=16, mode="forward"), rounds=1
    )
    assert result.status == "oom"  # an OOM during the check is a recorded result, not a skip


def test_case_flops_and_step_arguments():
    case = {"impl": "naive", "batch_size": 2, "heads": 4, "seq_len": 128, "head_dim": 64, "dtype": "bf16",
            "causal": True, "mode": "forward-backward", "compile": True, "flush_l2": True, "warmup": 1,
            "rounds": 2, "group": "g"}
    expected = 4 * 8 * 128 * 128 * 64 * 0.5 * 3.5
    assert attention_workloads.case_flops(case) == expected
    assert attention_workloads.case_flops(case) == flops.attention_flops(8, 128, 128, 64, causal=True,
                                                                         mode="forward-backward")
    assert attention_workloads.case_flops(case | {"heads": None, "causal": False, "mode": "backward"}) == (
        4 * 2 * 128 * 128 * 64 * 2.5)
    assert attention_workloads.step_arguments(case) == dict(
        impl="naive", batch_size=2, heads=4, seq_len=128, head_dim=64, dtype="bf16", causal=True,
        mode="forward-backward", compile=True)


def test_bad_mode_and_dtype():
    with pytest.raises(ValueError, match="unknown mode 'train-step'"):
        _step("train-step")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        _step("forward", dtype="fp8")


@pytest.mark.gpu
def test_cuda_backward_records_memory_in_use_before_backward():
    metrics = {}
    step = _step("backward", device="cuda", seq_len=1024, causal=False, metrics=metrics)
    step.before_each()
    # inputs, dO, the output and naive's saved (B, N, N) scores and probabilities are all in use
    assert metrics["memory_before_backward_gib"] * 2**30 >= 2 * 2 * 1024 * 1024 * 4
    step()
