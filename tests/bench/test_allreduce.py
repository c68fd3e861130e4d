"""cs336_systems.bench.workloads.allreduce: the nccl-tests bandwidth formulas, AllReduceStep's argument checks and
sums, and allreduce_case on gloo/CPU with 2 and 3 ranks (one spawned job per world size)."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from cs336_systems.bench.workloads import allreduce as comm
from cs336_systems.bench import rank_timing as timing
from cs336_systems.parallel.launch import spawn

CASE = {"size_mb": 0.25, "inner_iters": 3, "warmup": 1, "rounds": 4}


# --- bus_bandwidth ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_known_values(world, factor):
    algbw, busbw = comm.bus_bandwidth(2_000_000, 0.5, world)
    assert algbw == 4_000_000.0  # bytes / s
    assert busbw == pytest.approx(4_000_000.0 * factor, rel=1e-15, abs=0)  # 2 (n - 1) / n


@given(st.integers(1, 2**40), st.floats(1e-9, 1e3), st.integers(1, 4096))
def test_bus_bandwidth_matches_the_nccl_tests_formula(nbytes, seconds, world):
    algbw, busbw = comm.bus_bandwidth(nbytes, seconds, world)
    assert algbw == pytest.approx(nbytes / seconds, rel=1e-12)
    assert busbw == pytest.approx(nbytes / seconds * 2 * (world - 1) / world, rel=1e-12, abs=0)
    assert busbw < 2 * algbw


@pytest.mark.parametrize("args, match", [
    ((0, 1.0, 2), "nbytes must be > 0, got 0"),
    ((-4, 1.0, 2), "nbytes must be > 0, got -4"),
    ((4, 0.0, 2), "seconds must be > 0, got 0.0"),
    ((4, -1.0, 2), "seconds must be > 0, got -1.0"),
    ((4, 1.0, 0), "world_size must be >= 1, got 0"),
])
def test_bus_bandwidth_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        comm.bus_bandwidth(*args)


# --- AllReduceStep ------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 6, 1023])
def test_allreduce_step_needs_whole_float32_elements(nbytes):
    with pytest.raises(ValueError, match=f"nbytes must be a multiple of 4 \\(float32 elements\\), got {nbytes}"):
        comm.AllReduceStep(nbytes, 1, torch.device("cpu"))


@pytest.mark.parametrize("inner", [0, -1])
def test_allreduce_step_needs_at_least_one_inner_iteration(inner):
    with pytest.raises(ValueError, match=f"inner_iters must be >= 1, got {inner}"):
        comm.AllReduceStep(64, inner, torch.device("cpu"))


# --- under spawn --------------------------------------------------------------------------------------


def _job(rank: int, world_size: int, case: dict) -> dict:
    cpu = torch.device("cpu")
    out: dict = {}
    step = comm.AllReduceStep(40, 2, cpu)  # checks its own sums on construction, then zeroes the tensor
    out["step_tensor_after_init"] = step.tensor.clone()
    step()
    out["step_tensor_after_call"] = step.tensor.clone()
    # Count the collectives one call issues: inner_iters all-reduces of the whole tensor.
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    try:
        step()
    finally:
        dist.all_reduce = real
    out["all_reduce_calls"] = calls
    out["case"] = comm.allreduce_case(cpu, case)

    # With the cross-rank measurement replaced by known numbers, the per-op conversion is exact to check.
    real_measure = comm.timing.measure_across_ranks

    def fake_measure(setup, *, warmup, rounds, device):
        setup()  # builds the step (its construction is collective and checks the sums)
        return timing.RankedMeasurement("ok", (0.3, 0.9, 0.6), (0.2, 0.4), None)

    comm.timing.measure_across_ranks = fake_measure
    try:
        out["known"] = comm.allreduce_case(cpu, dict(case, inner_iters=3))
        comm.timing.measure_across_ranks = lambda *a, **k: timing.RankedMeasurement("oom", (), (), None, "OOM x")
        out["oom"] = comm.allreduce_case(cpu, case)
    finally:
        comm.timing.measure_across_ranks = real_measure
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_case_times_and_bandwidths(world):
    results = spawn(_job, world, CASE, timeout_s=60)
    nbytes = int(CASE["size_mb"] * 2**20)
    for r in results:
        assert torch.equal(r["step_tensor_after_init"], torch.zeros(10))
        assert torch.equal(r["step_tensor_after_call"], torch.zeros(10))  # zeros stay zeros when summed
        assert r["all_reduce_calls"] == [10, 10]

        out = r["case"]
        assert out["status"] == "ok"
        times = out["times_s"]
        assert len(times) == CASE["rounds"] and all(t > 0 for t in times)
        info = out["extra_info"]
        assert info["bytes"] == nbytes == 262_144 and info["backend"] == "gloo"
        median = statistics.median(times)
        assert info["algbw_gbps"] == pytest.approx(nbytes / median / 1e9, rel=1e-12)
        assert info["busbw_gbps"] == pytest.approx(nbytes / median * 2 * (world - 1) / world / 1e9, rel=1e-12)
        per_rank = info["rank_median_ms"]
        assert len(per_rank) == world and all(m > 0 for m in per_rank)
        # times_s holds the slowest rank per round, so its median is at least every rank's own median
        # (max over ranks per round, then median, dominates each rank's median).
        assert median * 1e3 >= max(per_rank) * (1 - 1e-9)
    # Slowest-rank times are the same numbers on every rank.
    assert all(r["case"] == results[0]["case"] for r in results)

    known = results[0]["known"]  # round times 0.3, 0.9, 0.6 s of 3 all-reduces each; rank medians 0.2, 0.4 s
    assert known["times_s"] == pytest.approx((0.1, 0.3, 0.2), rel=1e-12)
    assert known["extra_info"]["rank_median_ms"] == pytest.approx([0.2 / 3 * 1e3, 0.4 / 3 * 1e3], rel=1e-12)
    assert known["extra_info"]["algbw_gbps"] == pytest.approx(nbytes / 0.2 / 1e9, rel=1e-12)
    assert known["extra_info"]["busbw_gbps"] == pytest.approx(nbytes / 0.2 * 2 * (world - 1) / world / 1e9, rel=1e-12)
    assert results[0]["oom"] == {"status": "oom", "error": "OOM x"}


# --- through perf/'s dist_bench: a rank's OOM is an OOM cell, a rank's error fails the case ----------------

DIST_MATRIX = {"suites": {"allreduce": {"profiles": {"cpu": [
    {"group": "allreduce-cpu", "backends": ["gloo"], "sizes_mb": [0.125, 0.25, 0.5], "world_sizes": [2],
     "inner_iters": 1, "warmup": 1, "rounds": 2},
]}}}}

DIST_PERF_TESTS = '''
import pytest, torch
import torch.distributed as dist
from cs336_systems.bench import rank_timing
from cs336_systems.bench.workloads.allreduce import allreduce_case

def one_rank_fails(device, case):
    """0.125 MiB: all well; 0.25 MiB: rank 1 runs out of memory while building; 0.5 MiB: rank 1 raises in a
    round."""
    if case["size_mb"] == 0.125:
        return allreduce_case(device, case)
    def setup():
        if dist.get_rank() == 1 and case["size_mb"] == 0.25:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        def step():
            if dist.get_rank() == 1:
                raise ValueError("rank one's step is broken")
            dist.all_reduce(torch.ones(8))
        return step
    m = rank_timing.measure_across_ranks(setup, warmup=case["warmup"], rounds=case["rounds"], device=device)
    return {"status": m.status, "error": m.error}

@pytest.mark.suite("allreduce")
def test_allreduce(case, dist_bench):
    dist_bench(one_rank_fails, case=case)
'''


@pytest.mark.timeout(120)  # a hang fails
def test_dist_bench_records_a_rank_oom_as_an_oom_cell_and_fails_on_a_rank_error(pytester, perf_session):
    import json
    from pathlib import Path

    from cs336_systems.reporting import render

    root = Path(__file__).resolve().parents[2]
    pytester.makeconftest((root / "conftest.py").read_text())
    perf = pytester.mkdir("perf")
    (perf / "conftest.py").write_text((root / "perf" / "conftest.py").read_text())
    (perf / "test_dist.py").write_text(DIST_PERF_TESTS)
    (pytester.path / "benchmarks.json").write_text(json.dumps(DIST_MATRIX))
    # in this process (tests/conftest.py's `perf_session`); the ranks are processes of their own, as always
    result = perf_session("perf", "--perf-profile=cpu", "--benchmark-json=out.json", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*distributed case failed: rank 1 raised in warm-up round 1: ValueError: rank one's step is broken*",
        "*OOM (recorded in the saved JSON): rank 1 ran out of memory in setup: CUDA out of memory*",
    ])
    assert "Traceback" in result.stdout.str() and "in step" in result.stdout.str()  # the failing rank's
    data = json.loads((pytester.path / "out.json").read_text())
    (oom,) = data["oom"]
    assert oom["name"] == "test_allreduce[gloo-0.25MiB-ranks2-w1]" and oom["extra_info"]["size_mb"] == 0.25
    assert oom["error"].startswith("rank 1 ran out of memory in setup: CUDA out of memory. Tried to allocate 64")
    report = render.render([pytester.path / "out.json"])
    assert "| 0.25 | 2 | OOM |" in report, report
