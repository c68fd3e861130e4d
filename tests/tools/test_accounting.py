"""cs336_systems.tools.accounting: the XXL numbers, the FSDP x TP critical batch, the DDP bucket model, the CLI.

Every expected value is recomputed here from first principles (shapes, exact fractions, brute-force
searches, autograd's own saved tensors) rather than by calling the helper under test, and the headline
numbers are also pinned as literals so a changed convention shows up as a failing test.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from cs336_systems.tools import accounting as acc

D_MODEL, D_FF, N_BLOCKS = 16384, 53248, 126
GB = 10**9


# ---- (a) parameters, state bytes, H100s ------------------------------------------------------
def test_parameter_count_from_weight_shapes():
    shapes = [(D_FF, D_MODEL), (D_MODEL, D_FF)] * N_BLOCKS  # nn.Linear weights (out, in), no biases
    expected = sum(rows * cols for rows, cols in shapes)
    assert expected == 219_848_638_464
    assert acc.XXL.n_params == expected


def test_state_bytes_gb_gib_and_h100s():
    params = 219_848_638_464
    # master weight, accumulated gradient, Adam m and v -- all fp32
    per_param = 4 + 4 + 4 + 4
    expected = params * per_param
    assert acc.XXL.state_bytes == expected == 3_517_578_215_424
    assert expected / 2**30 == 3276.0  # exact: P = 1638 * 2**27
    assert round(expected / GB, 2) == 3517.58
    # smallest whole number of 80 GB cards whose memory covers the state
    h100s = next(n for n in range(1, 10_000) if n * 80 * GB >= expected)
    assert h100s == 44
    assert acc.devices_to_hold(acc.XXL.state_bytes) == h100s
    assert acc.devices_to_hold(acc.XXL.state_bytes, 80 * 2**30) == 41  # the 80 GiB reading
    assert acc.devices_to_hold(0) == 0
    assert acc.devices_to_hold(80 * GB) == 1 and acc.devices_to_hold(80 * GB + 1) == 2


def test_the_mistyped_d_ff_is_not_the_default():
    assert acc.XXL.d_ff == 53248
    assert acc.FFNStack(d_ff=54328).n_params != acc.XXL.n_params


# ---- (a) activations: compare with what autograd really saves -------------------------------
def _saved_activation_bytes(d_model: int, d_ff: int, n_blocks: int, tokens: int) -> int:
    """Bytes of non-parameter tensors autograd keeps for backward through a bf16 linear stack."""
    torch.manual_seed(0)
    layers = []
    for _ in range(n_blocks):
        layers += [torch.nn.Linear(d_model, d_ff, bias=False), torch.nn.Linear(d_ff, d_model, bias=False)]
    stack = torch.nn.Sequential(*layers).to(torch.bfloat16)
    param_storages = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(tokens, d_model, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stack(x)
    out.float().sum().backward()  # the saved tensors were enough for a real backward
    return sum(saved.values())


@pytest.mark.parametrize("d_model,d_ff,n_blocks,tokens", [(8, 24, 3, 5), (16, 40, 2, 7)])
def test_activation_bytes_match_autograd(d_model, d_ff, n_blocks, tokens):
    model = acc.FFNStack(d_model=d_model, d_ff=d_ff, n_blocks=n_blocks)
    assert model.activation_bytes(tokens) == _saved_activation_bytes(d_model, d_ff, n_blocks, tokens)


def test_xxl_activation_bytes_per_token():
    # per block, bf16: the input of W_in (d_model values) and the input of W_out (d_ff values)
    per_block = 2 * D_MODEL + 2 * D_FF
    assert acc.XXL.activation_bytes_per_token == N_BLOCKS * per_block == 17_547_264
    assert acc.XXL.activation_bytes(1024) == 17_968_398_336
    assert acc.XXL.activation_bytes(0) == 0


# ---- (b) FSDP --------------------------------------------------------------------------------
def _per_device(n: int, tokens: int) -> Fraction:
    state = Fraction(16 * 219_848_638_464)
    acts = Fraction(17_547_264 * tokens)
    sharded = state + acts / 2  # state and every second layer's activations split n ways
    return sharded / n + acts / 2


@pytest.mark.parametrize("tokens,expected", [(0, 38), (512, 39), (1024, 41), (2048, 46), (4096, 61)])
def test_min_fsdp_degree_by_search(tokens, expected):
    cap = 95 * GB
    first_fit = next(n for n in range(1, 1000) if _per_device(n, tokens) <= cap)
    assert first_fit == expected
    assert acc.min_fsdp_degree(tokens) == expected
    assert acc.fsdp_bytes_per_device(expected, tokens) <= cap < acc.fsdp_bytes_per_device(expected - 1, tokens)


def test_default_token_count_and_per_device_bytes():
    assert acc.DEFAULT_ACTIVATION_TOKENS == 1024
    assert acc.min_fsdp_degree() == 41
    for n in (1, 7, 41, 64):
        assert acc.fsdp_bytes_per_device(n) == pytest.approx(float(_per_device(n, 1024)), rel=1e-15)
    # a GiB reading of the 95 GB budget moves the answer: the parameter is honoured
    assert acc.min_fsdp_degree(1024, device_bytes=95 * 2**30) == 38


def test_min_fsdp_degree_exact_boundary():
    model = acc.FFNStack(d_model=1, d_ff=1, n_blocks=1)  # 2 params -> 32 state bytes, 4 B/token
    assert acc.min_fsdp_degree(0, device_bytes=16, model=model) == 2  # 32/2 == 16 fits exactly
    assert acc.min_fsdp_degree(0, device_bytes=15, model=model) == 3
    # 2 tokens: A = 8, unsharded half 4 B, sharded (32 + 4) / N
    assert acc.min_fsdp_degree(2, device_bytes=10, model=model) == 6


def test_activations_that_cannot_fit_raise():
    tokens = 2 * 95 * GB // 17_547_264 + 1  # the unsharded half alone exceeds 95 GB
    with pytest.raises(ValueError, match=f"tokens={tokens}"):
        acc.min_fsdp_degree(tokens)


# ---- (c) compute-bound batch on the v5p mesh -------------------------------------------------
W_ICI = Fraction(2 * 9 * 10**10)
C_PEAK = Fraction(46 * 10**13)
X, Y, M_X, M_Y = 16, 4, 2, 1


def _forward_block_seconds(global_tokens: int) -> tuple[Fraction, Fraction, Fraction]:
    """(math, fsdp comms, tp comms) for one block, counted operation by operation."""
    b, d, f, n = Fraction(global_tokens), Fraction(D_MODEL), Fraction(D_FF), X * Y
    flops_per_chip = 2 * (b / X) * d * (f / Y) * 2  # two matmuls on a [B/X, D] x [D, F/Y] shard
    gathered_weight_bytes = 2 * (d * f / Y) * 2  # W_in[D, F_Y] and W_out[F_Y, D] in bf16
    activation_bytes = 2 * (b / X) * d * 2  # AllGather_Y In[B_X, D] + ReduceScatter_Y Out[B_X, D]
    assert flops_per_chip == 4 * b * d * f / n
    return flops_per_chip / C_PEAK, gathered_weight_bytes / (W_ICI * M_X), activation_bytes / (W_ICI * M_Y)


def _compute_bound(global_tokens: int) -> bool:
    math_s, fsdp_s, tp_s = _forward_block_seconds(global_tokens)
    return fsdp_s + tp_s <= math_s


def test_critical_batch_by_search():
    n = X * Y
    per_device = next(b for b in range(1, 10_000) if _compute_bound(b * n))
    assert per_device == 396
    assert not _compute_bound(395 * n)
    crit = acc.critical_batch()
    assert crit.per_device_tokens == per_device
    assert crit.global_tokens == per_device * n == 25_344


def test_critical_batch_threshold_exact():
    alpha = C_PEAK / W_ICI  # 23000/9
    threshold = (X * alpha / M_X) / (1 - Y * alpha / (D_FF * M_Y))
    assert threshold == Fraction(9_797_632_000, 387_232)
    math_s, fsdp_s, tp_s = _forward_block_seconds(threshold)
    assert fsdp_s + tp_s == math_s  # the threshold is exactly where comms equal compute
    crit = acc.critical_batch()
    assert crit.global_tokens_threshold == pytest.approx(float(threshold), rel=1e-12)
    assert crit.per_device_threshold == pytest.approx(float(threshold / 64), rel=1e-12)
    assert round(crit.per_device_threshold, 2) == 395.34


def test_forward_block_times_agree_with_operation_count():
    for tokens in (1_000, 25_344, 1_000_000):
        expected = _forward_block_seconds(tokens)
        t = acc.forward_block_times(tokens)
        assert (t.math_s, t.fsdp_comm_s, t.tp_comm_s) == pytest.approx([float(e) for e in expected], rel=1e-12)
        assert t.compute_bound == _compute_bound(tokens)


def test_optimal_mix_bound_and_wide_tp_raises():
    alpha = C_PEAK / W_ICI
    assert acc.optimal_mix_min_tokens_per_device() == pytest.approx(float(4 * alpha**2 / (D_FF * M_X * M_Y)))
    # Y alpha >= F M_Y: the TP comms alone outlast the matmuls at any batch
    too_wide = math.ceil(D_FF / float(alpha))
    with pytest.raises(ValueError, match=f"tp={too_wide}"):
        acc.critical_batch(acc.Mesh(fsdp=1, tp=too_wide))
    acc.critical_batch(acc.Mesh(fsdp=1, tp=too_wide - 1))


# ---- DDP bucket model ------------------------------------------------------------------------
def test_ddp_overhead_formula():
    s, w, o = 4e9, 100e9, 50e-6
    assert acc.ddp_overhead_s(s, w, o, 8) == pytest.approx(8 * 50e-6 + 4e9 / (8 * 100e9))
    assert acc.ddp_overhead_s(s, w, o, 1) == pytest.approx(50e-6 + 0.04)


@pytest.mark.parametrize(
    "s,w,o",
    [(4 * 2.7e9, 300e9, 30e-6), (4 * 124e6, 2e9, 1e-3), (1e6, 1e9, 1e-5), (1e12, 1e11, 1e-6)],
)
def test_optimum_minimises_the_overhead(s, w, o):
    n_opt = acc.optimal_n_buckets(s, w, o)
    bucket = acc.optimal_bucket_bytes(s, w, o)
    assert n_opt * bucket == pytest.approx(s)
    best = acc.ddp_overhead_s(s, w, o, n_opt)
    assert best == pytest.approx(2 * math.sqrt(s * o / w))
    # a dense geometric grid over 12 decades around the optimum never does better
    grid = [n_opt * 10 ** (k / 200) for k in range(-1200, 1201) if k]
    assert all(acc.ddp_overhead_s(s, w, o, n) >= best for n in grid)
    # among whole bucket counts the best is a neighbour of the continuous optimum
    if n_opt >= 1:
        whole = min(range(1, int(4 * n_opt) + 2), key=lambda n: acc.ddp_overhead_s(s, w, o, n))
        assert whole in (math.floor(n_opt), math.ceil(n_opt))


def _timings(o: float, w: float, sizes: list[float], noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [(o + x / w) * (1 + rng.uniform(-noise, noise)) for x in sizes]


def test_fit_recovers_o_and_w():
    sizes = [2.0**k for k in range(10, 31)]  # 1 KiB .. 1 GiB
    exact = acc.fit_allreduce_model(sizes, _timings(25e-6, 40e9, sizes, 0.0, 0))
    assert exact.per_call_overhead_s == pytest.approx(25e-6, rel=1e-6)
    assert exact.bandwidth_Bps == pytest.approx(40e9, rel=1e-9)
    # two points determine the line
    two = acc.fit_allreduce_model([1e6, 1e8], [1e-4 + 1e6 / 5e9, 1e-4 + 1e8 / 5e9])
    assert (two.per_call_overhead_s, two.bandwidth_Bps) == pytest.approx((1e-4, 5e9), rel=1e-9)
    # with 0.1 % multiplicative noise on many mid-sized messages both survive to a few percent
    sizes = [float(x) for x in range(1_000_000, 50_000_001, 1_000_000)]
    noisy = acc.fit_allreduce_model(sizes, _timings(100e-6, 20e9, sizes, 1e-3, 1))
    assert noisy.per_call_overhead_s == pytest.approx(100e-6, rel=0.05)
    assert noisy.bandwidth_Bps == pytest.approx(20e9, rel=0.01)


@pytest.mark.parametrize(
    "sizes,times,exc,match",
    [
        ([1.0, 2.0], [1.0], ValueError, "sizes_bytes has 2 points but times_s has 1"),
        ([1.0], [1.0], ValueError, "at least 2 points"),
        ([], [], ValueError, "at least 2 points"),
        ([1.0, -2.0], [1.0, 2.0], ValueError, r"sizes_bytes\[1\]"),
        ([1.0, 2.0], [0.0, 2.0], ValueError, r"times_s\[0\]"),
        ([1.0, float("nan")], [1.0, 2.0], ValueError, r"sizes_bytes\[1\]"),
        ([1.0, "2"], [1.0, 2.0], TypeError, r"sizes_bytes\[1\]"),
        ([3.0, 3.0], [1.0, 2.0], ValueError, "two distinct sizes"),
        ([1.0, 2.0], [2.0, 1.0], ValueError, "do not grow"),
    ],
)
def test_fit_rejects_bad_input(sizes, times, exc, match):
    with pytest.raises(exc, match=match):
        acc.fit_allreduce_model(sizes, times)


@pytest.mark.parametrize(
    "fn,args,exc,match",
    [
        (acc.ddp_overhead_s, (0, 1e9, 1e-5, 4), ValueError, "total_bytes"),
        (acc.ddp_overhead_s, (1e9, -1, 1e-5, 4), ValueError, "bandwidth_Bps"),
        (acc.ddp_overhead_s, (1e9, 1e9, float("inf"), 4), ValueError, "per_call_overhead_s"),
        (acc.ddp_overhead_s, (1e9, 1e9, 1e-5, 0), ValueError, "n_buckets"),
        (acc.ddp_overhead_s, (1e9, 1e9, 1e-5, True), TypeError, "n_buckets"),
        (acc.optimal_bucket_bytes, ("1e9", 1e9, 1e-5), TypeError, "total_bytes"),
        (acc.optimal_n_buckets, (1e9, 1e9, 0.0), ValueError, "per_call_overhead_s"),
        (acc.devices_to_hold, (10, 0), ValueError, "device_bytes"),
        (acc.devices_to_hold, (1.5,), TypeError, "total_bytes"),
        (acc.fsdp_bytes_per_device, (0,), ValueError, "n_fsdp"),
        (acc.min_fsdp_degree, (-1,), ValueError, "tokens"),
        (acc.forward_block_times, (0,), ValueError, "global_tokens"),
    ],
)
def test_functions_reject_bad_arguments(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


@pytest.mark.parametrize(
    "cls,kwargs,exc,match",
    [
        (acc.FFNStack, {"d_ff": 0}, ValueError, "d_ff"),
        (acc.FFNStack, {"d_model": 16384.0}, TypeError, "d_model"),
        (acc.FFNStack, {"n_blocks": True}, TypeError, "n_blocks"),
        (acc.Mesh, {"fsdp": 0}, ValueError, "fsdp"),
        (acc.Mesh, {"tp_axes": 1.0}, TypeError, "tp_axes"),
        (acc.Mesh, {"peak_flops": -1.0}, ValueError, "peak_flops"),
        (acc.Mesh, {"ici_bandwidth_Bps": float("nan")}, ValueError, "ici_bandwidth_Bps"),
    ],
)
def test_configs_validate(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


# ---- CLI -------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cs336_systems.accounting", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_prints_the_worked_answer():
    result = _cli()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for needle in (
        "219,848,638,464",  # parameters
        "3,517,578,215,424 B",  # state bytes
        "3,276.00 GiB",
        "= 44",  # H100s
        "17,547,264 B/token",
        "N_FSDP = 41",
        "396 tokens per chip",
        "25,344 tokens",
    ):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    assert result.stderr == ""


def test_cli_token_option_and_errors():
    assert "N_FSDP = 38" in _cli("--tokens", "0").stdout
    bad = _cli("--tokens", "1000000")
    assert bad.returncode == 2 and "does not fit" in bad.stderr
