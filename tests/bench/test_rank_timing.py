"""cs336_systems.bench.rank_timing on gloo/CPU with 2 ranks: the slowest rank per round, per-rank medians,
uncounted warm-up, gather_floats, barrier, and the all-ranks OOM outcome.

One spawned job runs every multi-process check (a spawn costs ~3 s here); the worker returns plain numbers
and the parent asserts, so a failure names the check instead of a worker traceback.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from cs336_systems.bench import rank_timing as timing
from cs336_systems.parallel.launch import spawn

SLEEP_S = (0.005, 0.040)  # rank 0 is fast, rank 1 slow
WARMUP, ROUNDS = 2, 4
BARRIER_LATE_S = 0.2  # how late rank 1 arrives at the barrier


def _checks(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    out: dict = {}

    # measure_across_ranks: a step of known, rank-dependent duration.
    calls = {"setup": 0, "step": 0}

    def setup():
        calls["setup"] += 1

        def step():
            calls["step"] += 1
            time.sleep(SLEEP_S[rank])

        return step

    m = timing.measure_across_ranks(setup, warmup=WARMUP, rounds=ROUNDS, device=cpu)
    out["measured"] = m
    out["calls"] = dict(calls)

    # gather_floats: [rank][i], float64 exact for these values.
    out["gathered"] = timing.gather_floats([float(rank), rank * 10.0 + 0.5, -1.25], cpu)

    # barrier: rank 1 arrives late; rank 0 must wait for it inside barrier().
    if rank == 1:
        time.sleep(BARRIER_LATE_S)
    start = time.perf_counter()
    timing.barrier(cpu)
    out["barrier_wait_s"] = time.perf_counter() - start

    # OOM while building the workload, on every rank: an "oom" result everywhere, nothing timed.
    def oom_setup():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    out["oom"] = timing.measure_across_ranks(oom_setup, warmup=1, rounds=3, device=cpu)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_checks, 2, timeout_s=60)


def test_slowest_rank_time_per_round_and_rank_medians(results):
    for r in results:
        m = r["measured"]
        assert m.status == "ok" and m.error is None
        assert len(m.times_s) == ROUNDS
        assert all(t >= SLEEP_S[1] for t in m.times_s), m.times_s  # rank 1 is the slowest every round
        assert len(m.rank_medians_s) == 2
        fast, slow = m.rank_medians_s
        assert SLEEP_S[0] <= fast < SLEEP_S[1] - 0.01, m.rank_medians_s  # rank 0 did not wait for rank 1 inside a round
        assert slow >= SLEEP_S[1]
        assert m.peak_memory_bytes is None  # CPU: no peak-memory counter
    # The reduction is collective: every rank reports the same numbers.
    assert results[0]["measured"] == results[1]["measured"]


def test_warmup_rounds_run_but_are_not_counted(results):
    for r in results:
        assert r["calls"] == {"setup": 1, "step": WARMUP + ROUNDS}


def test_gather_floats_returns_every_ranks_values_by_rank(results):
    expected = [[0.0, 0.5, -1.25], [1.0, 10.5, -1.25]]
    assert [r["gathered"] for r in results] == [expected, expected]


def test_barrier_waits_for_the_late_rank(results):
    assert results[0]["barrier_wait_s"] >= BARRIER_LATE_S * 0.75
    assert results[1]["barrier_wait_s"] < BARRIER_LATE_S * 0.75


def test_oom_on_every_rank_is_a_result(results):
    for r in results:
        oom = r["oom"]
        assert oom.status == "oom" and oom.times_s == () and oom.rank_medians_s == ()
        assert "CUDA out of memory" in oom.error


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="measure_across_ranks needs an initialized torch.distributed"):
        timing.measure_across_ranks(lambda: (lambda: None), warmup=0, rounds=1, device="cpu")
