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
    with pytest.raises(AccuracyError, match=r"less accurate than allowed.*per tensor: o [0-9.e+-]+, dq"):
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
    rows = attention_workloads.row_errors(torch.tensor([[1.0, math.nan], [1.0, 1.25]]), torch.ones(2, 2))
    assert rows.tolist() == [math.inf, 0.25]

    def nan_row(q, k, v, is_causal=False):
        out = attention.get("naive").fn(q, k, v, is_causal=is_causal)
        return torch.cat([out[..., :-1, :], out[..., -1:, :] * math.nan], dim=-2)

    q, k, v, do = attention_workloads.random_inputs((1, 64, 16), torch.float16, torch.device("cpu"), requires_grad=False)
    with pytest.raises(AccuracyError, match="o row 63 of 64"):
        attention_workloads.check_accuracy(nan_row, q, k, v, do, causal=True, mode="forward", dtype="fp16")


# --- the per-row rule (item: a wrong tail must not pass) ----------------------------------------------------
# At N = 4096, d = 64, bf16, causal, the last rows' outputs are ~1/sqrt(N) of the first rows': the earlier
# whole-tensor check (max|x - ref| / max|ref| <= 5e-2) measured 0.037 for a kernel that zeroes the last 10%
# of the rows and 0.042 for one that hands every row of that tail its predecessor's output, and passed both.
TAIL = dict(n=4096, d=64, start=3686)


def _broken_tail(kind: str, start: int):
    """naive attention with every output row from ``start`` on zeroed, or replaced by the row before it."""

    def fn(q, k, v, is_causal=False):
        out = attention.get("naive").fn(q, k, v, is_causal=is_causal)
        head, tail = out[..., :start, :], out[..., start:, :]
        tail = tail * 0 if kind == "zeroed" else out[..., start - 1:-1, :]
        return torch.cat([head, tail], dim=-2)

    return fn


# N 4096 in bf16 on the CPU, ~2 s a case: the shifted tail is slow (.ci/run runs it).
@pytest.mark.parametrize("kind", ["zeroed", pytest.param("shifted", marks=pytest.mark.slow)])
def test_a_wrong_tail_fails_the_accuracy_check(kind):
    q, k, v, do = attention_workloads.random_inputs((1, TAIL["n"], TAIL["d"]), torch.bfloat16, torch.device("cpu"),
                                                    requires_grad=False)
    fn = _broken_tail(kind, TAIL["start"])
    (ref,) = attention_workloads.reference(q, k, v, None, causal=True)
    # what the whole-tensor metric alone would have let through
    assert attention_workloads.relative_error(fn(q, k, v, is_causal=True), ref) < attention_workloads.TOLERANCE["bf16"]
    with pytest.raises(AccuracyError, match=r"less accurate than allowed: o row 3[6-9]\d\d of 4096"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode="forward", dtype="bf16", impl=kind)


@pytest.mark.parametrize("kind", ["zeroed", "shifted"])
def test_a_wrong_last_row_fails_the_accuracy_check(kind):
    q, k, v, do = attention_workloads.random_inputs((2, 512, 32), torch.float16, torch.device("cpu"), requires_grad=False)
    with pytest.raises(AccuracyError, match="o row 511 of 512"):
        attention_workloads.check_accuracy(_broken_tail(kind, 511), q, k, v, do, causal=True, mode="forward",
                                           dtype="fp16")


@pytest.mark.parametrize("grad", ["dq", "dk", "dv"])
def test_a_wrong_gradient_tail_fails_the_accuracy_check(grad):
    """A backward that zeroes the last quarter of one gradient's rows (dK, dV: the last keys, the smallest)."""

    def fn(q, k, v, is_causal=False):
        inputs = {"dq": q * 1, "dk": k * 1, "dv": v * 1}
        cut = q.shape[-2] * 3 // 4
        inputs[grad].register_hook(lambda g: torch.cat([g[..., :cut, :], g[..., cut:, :] * 0], dim=-2))
        return attention.get("naive").fn(inputs["dq"], inputs["dk"], inputs["dv"], is_causal=is_causal)

    q, k, v, do = attention_workloads.random_inputs((1, 1024, 64), torch.bfloat16, torch.device("cpu"), requires_grad=True)
    with pytest.raises(AccuracyError, match=rf"less accurate than allowed: {grad} row"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode="forward-backward", dtype="bf16")


# ~2.8 s a case at N 4096 on the CPU: the default run takes dK (a last row far inside the floors), dQ and dV are
# slow (.ci/run runs them).
@pytest.mark.parametrize("grad", [pytest.param("dq", marks=pytest.mark.slow), "dk",
                                  pytest.param("dv", marks=pytest.mark.slow)])
def test_a_single_zeroed_gradient_row_fails_the_accuracy_check(grad):
    """The last row alone zeroed at N 4096, bf16, causal: the last key's dK and dV rows are ~1e-4 of the
    tensors' largest, inside the floors of the per-row rule; a row of exact zeros is caught anyway."""

    def fn(q, k, v, is_causal=False):
        inputs = {"dq": q * 1, "dk": k * 1, "dv": v * 1}
        inputs[grad].register_hook(lambda g: torch.cat([g[..., :-1, :], g[..., -1:, :] * 0], dim=-2))
        return attention.get("naive").fn(inputs["dq"], inputs["dk"], inputs["dv"], is_causal=is_causal)

    q, k, v, do = attention_workloads.random_inputs((1, 4096, 64), torch.bfloat16, torch.device("cpu"), requires_grad=True)
    with pytest.raises(AccuracyError, match=rf"{grad} row 4095 of 4096 \(batch\*head 0\) is all zeros"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode="forward-backward", dtype="bf16")


# --- the timed path is the checked path: later calls and graph replays are checked too ---------------------
def _wrong_after(calls: int, when=lambda: True):
    """naive attention whose output loses its last row from call ``calls`` + 1 on, while ``when()``."""
    count = [0]

    def fn(q, k, v, is_causal=False):
        count[0] += 1
        out = attention.get("naive").fn(q, k, v, is_causal=is_causal)
        if count[0] > calls and when():
            out = torch.cat([out[..., :-1, :], out[..., -1:, :] * 0], dim=-2)
        return out

    return fn


def test_a_wrong_repeated_call_fails_the_accuracy_check():
    """Right on the first call (the one that compiles, autotunes and records launches), wrong on the next:
    the rounds that are timed."""
    q, k, v, do = attention_workloads.random_inputs((1, 512, 32), torch.float16, torch.device("cpu"), requires_grad=True)
    with pytest.raises(AccuracyError, match=r"repeat call\) is less accurate than allowed: o row 511 of 512"):
        attention_workloads.check_accuracy(_wrong_after(1), q, k, v, do, causal=True, mode="forward-backward",
                                           dtype="fp16")
    result = attention_workloads.check_accuracy(_wrong_after(2), q, k, v, do, causal=True, mode="forward-backward",
                                                dtype="fp16")
    assert result["accuracy_calls"] == "first+repeat" and result["accuracy_ratio"] < 0.6


def _fake_capture(replays: list):
    """A stand-in for harness.capture_cuda_graph on the CPU: the capture runs the step once; the "replay"
    runs it again (or does nothing, for ``replays=[False]``), counting in ``replays``."""

    def capture(step, device):
        step()

        def replay():
            if replays.pop(0):
                step()

        return replay

    return capture


def test_graph_timing_checks_a_graph_replayed_call():
    q, k, v, do = attention_workloads.random_inputs((1, 512, 32), torch.float16, torch.device("cpu"), requires_grad=True)
    common = dict(causal=True, mode="forward-backward", dtype="fp16", timing="graph")
    result = attention_workloads.check_accuracy(_wrong_after(4), q, k, v, do, capture=_fake_capture([True]), **common)
    assert result["accuracy_calls"] == "first+repeat+graph-replay"
    # calls 1, 2 eager, 3 captured, 4 replayed: a replay that computes the wrong thing
    with pytest.raises(AccuracyError, match=r"graph-replay call\) is less accurate than allowed: o row 511"):
        attention_workloads.check_accuracy(_wrong_after(3), q, k, v, do, capture=_fake_capture([True]), **common)
    # a replay that writes nothing leaves the NaN the outputs were filled with before it
    with pytest.raises(AccuracyError, match=r"graph-replay call\) is less accurate than allowed"):
        attention_workloads.check_accuracy(_wrong_after(9), q, k, v, do, capture=_fake_capture([False]), **common)


def test_bad_timing_is_refused_before_any_call():
    q, k, v, do = attention_workloads.random_inputs((1, 16, 8), torch.float32, torch.device("cpu"), requires_grad=False)
    fn = _wrong_after(0)  # would fail the check if it ran
    with pytest.raises(ValueError, match="unknown timing 'cudagraph'"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode="forward", dtype="fp32", timing="cudagraph")
    with pytest.raises(ValueError, match="timing 'graph' captures a CUDA graph; the inputs are on cpu"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode="forward", dtype="fp32", timing="graph")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["forward", "forward-backward"])
def test_a_wrong_graph_replay_fails_the_accuracy_check_on_cuda(mode):
    """The real capture (harness.capture_cuda_graph): flash-triton's replays pass; an implementation that
    is right eagerly and drops the last row only inside a CUDA graph fails."""
    step = attention_step(impl="flash-triton", batch_size=1, heads=2, seq_len=1024, head_dim=64, dtype="bf16",
                          causal=True, mode=mode, timing="graph", device="cuda")
    assert step.metrics["accuracy_calls"] == "first+repeat+graph-replay"
    assert step.metrics["accuracy_ratio"] < 0.6
    q, k, v, do = attention_workloads.random_inputs((1, 2, 1024, 64), torch.bfloat16, torch.device("cuda"),
                                                    requires_grad=mode != "forward")
    fn = _wrong_after(0, when=torch.cuda.is_current_stream_capturing)
    with pytest.raises(AccuracyError, match=r"graph-replay call\) is less accurate than allowed: o row 1023"):
        attention_workloads.check_accuracy(fn, q, k, v, do, causal=True, mode=mode, dtype="bf16", timing="graph")


def test_zeroed_rows_spare_rows_whose_reference_is_zero_or_below_the_dtypes_range():
    ref = torch.tensor([[[1.0, -2.0], [1e-17, 0.0], [0.0, 0.0], [3e-5, 1e-5], [1e-7, 0.0]]], dtype=torch.float64)
    x = torch.tensor([[[1.0, -2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    # row 1: float64 noise of an exact zero; row 2: zero; row 3: 1.5e-5 of the largest, dropped; row 4: 5e-8
    # of the largest, below the floor
    for dtype in ("bf16", "fp16", "fp32"):
        assert attention_workloads.zeroed_rows(x, ref, dtype).tolist() == [False, False, False, True, False]
    # a small tensor: 5e-7 is above the floor, and below fp16's TINY (where it may underflow to zero)
    ref, x = torch.tensor([[[1e-3, 0.0], [5e-7, 0.0]]], dtype=torch.float64), torch.tensor([[[1e-3, 0.0], [0.0, 0.0]]])
    assert attention_workloads.zeroed_rows(x, ref, "bf16").tolist() == [False, True]
    assert attention_workloads.zeroed_rows(x, ref, "fp16").tolist() == [False, False]


# naive-compiled compiles each case anew (5-10 s on a CPU): without the mask it runs the same graph less one
# masked_fill, so those three cases are marked slow (CI runs them); every dtype keeps its masked case.
@pytest.mark.parametrize("causal, dtype, impl", [
    pytest.param(causal, dtype, impl, id=f"{causal}-{dtype}-{impl}",
                 marks=[pytest.mark.slow] if impl == "naive-compiled" and not causal else [])
    for causal in (True, False) for dtype in ("fp32", "bf16", "fp16")
    for impl in ("naive", "naive-compiled", "sdpa", "flash-pytorch")])
def test_real_implementations_pass_the_accuracy_check(impl, dtype, causal):
    """Correct implementations stay well inside the rule (a wrong tail measures >= 10x the allowance).
    naive-compiled, whose every shape is a compile of several seconds, takes the 4-D one only."""
    shapes = (((1, 256, 64), 0), ((2, 3, 100, 16), 1))
    for shape, seed in shapes[1:] if impl == "naive-compiled" else shapes:
        q, k, v, do = attention_workloads.random_inputs(shape, attention_workloads.DTYPES[dtype], torch.device("cpu"),
                                                        requires_grad=True, seed=seed)
        result = attention_workloads.check_accuracy(attention.get(impl).fn, q, k, v, do, causal=causal,
                                                    mode="forward-backward", dtype=dtype, impl=impl)
        assert result["accuracy_ratio"] < 0.6, (shape, result)
        assert result["accuracy_error"] <= result["accuracy_tolerance"] == attention_workloads.TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # the interpreter's bf16 tl.dot is wrong (refused)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_triton_passes_the_accuracy_check(dtype, causal):
    if not attention.get("flash-triton").available(torch.device("cpu")):
        pytest.skip("flash-triton on the CPU needs TRITON_INTERPRET=1")
    q, k, v, do = attention_workloads.random_inputs((1, 2, 96, 32), attention_workloads.DTYPES[dtype],
                                                    torch.device("cpu"), requires_grad=True)
    result = attention_workloads.check_accuracy(attention.get("flash-triton").fn, q, k, v, do, causal=causal,
                                                mode="forward-backward", dtype=dtype, impl="flash-triton")
    assert result["accuracy_ratio"] < 0.6, result


def test_rows_whose_reference_is_zero_are_judged_by_the_floors():
    """One key: softmax is constant, so dQ and dK are exactly 0 in float64 and in the naive computation;
    a kernel's rounding noise there (~1e-7 of the tensors' scale) passes, an error of 1e-3 of it fails."""
    q, k, v, do = attention_workloads.random_inputs((1, 64, 32), torch.float32, torch.device("cpu"), requires_grad=True)
    k, v = k[:, :1].detach().requires_grad_(), v[:, :1].detach().requires_grad_()

    def noisy(scale):
        def fn(q, k, v, is_causal=False):
            out = attention.get("naive").fn(q, k, v, is_causal=is_causal)
            return out + scale * (q - q.detach()).sum(-1, keepdim=True)  # same O; dQ += scale * rowsum(dO)
        return fn

    assert attention_workloads.check_accuracy(noisy(1e-8), q, k, v, do, causal=False, mode="forward-backward",
                                              dtype="fp32")["accuracy_ratio"] < 1
    with pytest.raises(AccuracyError, match="dq row"):
        attention_workloads.check_accuracy(noisy(1e-3), q, k, v, do, causal=False, mode="forward-backward",
                                           dtype="fp32")


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
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_reference_in_blocks_matches_float64(monkeypatch, causal, block_bytes, dtype, tol):
    monkeypatch.setattr(attention_workloads, "REFERENCE_BLOCK_BYTES", block_bytes)
    q, k, v, do = attention_workloads.random_inputs((2, 3, 20, 8), torch.bfloat16, torch.device("cpu"),
                                                    requires_grad=True)
    got = attention_workloads.reference(q, k, v, do, causal=causal, dtype=dtype)
    want = _float64_attention(q, k, v, do, causal)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == q.shape
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)
    (o,) = attention_workloads.reference(q, k, v, None, causal=causal)
    assert o.dtype == torch.float64  # the accuracy check's reference
    torch.testing.assert_close(o, want[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_bytes", [2**30, 5 * 40 * 2])  # one block; blocks of 5 rows
def test_naive_baseline_in_blocks_is_the_naive_implementation(monkeypatch, causal, block_bytes):
    monkeypatch.setattr(attention_workloads, "REFERENCE_BLOCK_BYTES", block_bytes)
    q, k, v, do = attention_workloads.random_inputs((2, 40, 16), torch.bfloat16, torch.device("cpu"), requires_grad=True)
    got = attention_workloads.naive_same_dtype(q, k, v, do, causal=causal)
    out = attention.get("naive").fn(q, k, v, is_causal=causal)
    want = [out, *torch.autograd.grad(out, (q, k, v), do)]
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape, name
        if block_bytes == 2**30 or name in ("o", "dq"):  # rows are independent: the same arithmetic
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
        else:  # dK, dV summed over blocks in float32, rounded once: within a rounding of the dtype
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=name)


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
        impl="naive", batch_size=2, heads=4, kv_heads=None, seq_len=128, head_dim=64, dtype="bf16", causal=True,
        mode="forward-backward", compile=True, flash_options="", timing="host")
    # grouped-query attention: the FLOPs are the query heads' (each K/V head serves its group)
    assert attention_workloads.case_flops(case | {"kv_heads": 1}) == expected
    assert attention_workloads.step_arguments(case | {"kv_heads": 2})["kv_heads"] == 2


@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash-triton"])
def test_grouped_query_step_checks_against_the_repeated_heads_reference(impl):
    """A GQA case builds K/V with kv_heads heads, passes the accuracy check (dK, dV summed over each group
    in the reference) and runs; kv_heads that do not divide heads are a ValueError naming both."""
    step = attention_workloads.attention_step(impl=impl, batch_size=1, heads=4, kv_heads=2, seq_len=40, head_dim=16,
                                              dtype="fp32", causal=True, mode="forward-backward")
    assert step.k.shape == (1, 2, 40, 16) and step.q.shape == (1, 4, 40, 16)
    step()
    with pytest.raises(ValueError, match="kv_heads must divide heads .* got heads=4, kv_heads=3"):
        attention_workloads.attention_step(impl=impl, batch_size=1, heads=4, kv_heads=3, seq_len=8, head_dim=16)


def test_grouped_query_reference_sums_key_gradients_over_each_group():
    """The blocked reference on (B, Hkv, N, d) K/V equals the dense one on K/V repeated per query head, with dK
    and dV summed over each group of query heads."""
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 4, 9, 8, generator=g)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    o, dq, dk, dv = attention_workloads.reference(q, k, v, do, causal=True)
    k_rep, v_rep = (t.repeat_interleave(2, dim=1) for t in (k, v))
    o2, dq2, dk2, dv2 = attention_workloads.reference(q, k_rep, v_rep, do, causal=True)
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(dq, dq2)
    torch.testing.assert_close(dk, dk2.reshape(1, 2, 2, 9, 8).sum(2))
    torch.testing.assert_close(dv, dv2.reshape(1, 2, 2, 9, 8).sum(2))


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


def test_flash_options_axis_passes_explicit_choices_to_flash_triton():
    """benchmarks.json's "flash_options" axis (FlashOptions text) reaches flash-triton as explicit options and
    shows in the case id; the defaults keep the ids of before; bad strings and other implementations fail."""
    from cs336_systems.bench import matrix

    grid = {"impls": ["flash-triton"], "batch_sizes": [1], "seq_lens": [64], "head_dims": [16], "dtypes": ["fp32"],
            "causal": [True], "modes": ["forward"], "flash_options": ["", "fused_bwd=off"], "warmup": 1,
            "rounds": 1}
    ids = [matrix.case_id(c) for c in matrix._expand(matrix._validate_grid(grid, matrix._ATTENTION_GRID, "grid"))]
    assert ids == ["flash-triton-b1-n64-d16-forward-fp32-causal-eager-w1",
                   "flash-triton-b1-n64-d16-forward-fp32-causal-eager-opts-fused_bwd=off-w1"]
    fn = attention_workloads.attention_function("flash-triton", flash_options="fused_bwd=off")
    q = torch.randn(1, 2, 64, 16)
    torch.testing.assert_close(fn(q, q, q, True), torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    with pytest.raises(ValueError, match="unknown flash option 'fused'"):
        attention_workloads.attention_function("flash-triton", flash_options="fused=off")
    with pytest.raises(ValueError, match="flash_options apply to impl 'flash-triton' only; got impl 'naive'"):
        attention_workloads.attention_function("naive", flash_options="fused_bwd=off")
    with pytest.raises(matrix.MatrixError, match="unknown flash option 'fused'"):
        matrix._flash_options("fused=on", "flash_options")
    with pytest.raises(matrix.MatrixError, match="flash option tma must be on or off"):
        matrix._flash_options("tma=no", "flash_options")
