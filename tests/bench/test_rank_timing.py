"""cs336_systems.bench.rank_timing on gloo/CPU with 2 ranks: the slowest rank per round, per-rank medians,
uncounted warm-up, gather_floats, barrier, the all-ranks OOM outcome, and a failure on one rank (OOM or
error, in setup, a round or after the rounds) ending the measurement on every rank within seconds.

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

    out["failures"] = _failure_scenarios(rank, world_size)
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


# --- a failure on one rank ends the measurement on every rank within seconds ----------------------------
#
# Each scenario fails on one rank while the other waits for it in a collective of the default group (the
# case that used to block until the group's timeout).  The module's spawned job runs them all, in order,
# after the checks above, and then a measurement that succeeds: the default group was made again after
# each failure.  The job's timeout (60 s for collectives and the job) bounds a regression to a failed test,
# never a hung one.

OOM_TEXT = "CUDA out of memory. Tried to allocate 8.00 GiB"
FAILURE_BUDGET_S = 10.0  # per failed measurement, both ranks: far below the 60 s collective timeout


def _timed(out: dict, name: str, call) -> None:
    start = time.perf_counter()
    out[name] = call()
    out[name + "_s"] = time.perf_counter() - start


def _failure_scenarios(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    out: dict = {}

    # OOM while building the workload on rank 1; rank 0 goes on into a collective that needs rank 1.
    def setup_oom_on_rank1():
        if rank == 1:
            raise torch.OutOfMemoryError(OOM_TEXT)
        dist.broadcast(torch.zeros(4), src=1)
        return lambda: None

    _timed(out, "setup_oom", lambda: timing.measure_across_ranks(setup_oom_on_rank1, warmup=1, rounds=3, device=cpu))

    # OOM in measured round 2 on rank 0 (warm-up 1: its 3rd call); rank 1 is blocked in the step's all-reduce.
    def setup_round_oom_on_rank0():
        calls = [0]

        def step():
            calls[0] += 1
            if rank == 0 and calls[0] == 3:
                raise torch.OutOfMemoryError(OOM_TEXT)
            dist.all_reduce(torch.ones(16))

        return step

    _timed(out, "round_oom",
           lambda: timing.measure_across_ranks(setup_round_oom_on_rank0, warmup=1, rounds=4, device=cpu))

    # Any other exception: status "error" with the failing rank's traceback.
    def setup_error_on_rank1():
        def step():
            if rank == 1:
                raise ValueError("bad batch on purpose")
            dist.all_reduce(torch.ones(16))

        return step

    _timed(out, "round_error",
           lambda: timing.measure_across_ranks(setup_error_on_rank1, warmup=2, rounds=2, device=cpu))

    # after_rounds runs once, untimed, after agreement; a failure there (rank 1) is agreed like the others.
    def after_rounds_fails_on_rank1(step):
        if rank == 1:
            raise torch.OutOfMemoryError(OOM_TEXT)
        return timing.gather_floats([1.0], cpu)

    _timed(out, "after_oom", lambda: timing.measure_across_ranks(
        lambda: (lambda: None), warmup=0, rounds=2, device=cpu, after_rounds=after_rounds_fails_on_rank1))

    # The default group works again, and so does the next measurement (after_rounds sees the step).
    total = torch.ones(1)
    dist.all_reduce(total)
    out["all_reduce_after"] = total.item()
    out["next"] = timing.measure_across_ranks(
        lambda: (lambda: dist.all_reduce(torch.ones(4))), warmup=1, rounds=2, device=cpu,
        after_rounds=lambda step: [callable(step), timing.gather_floats([float(rank)], cpu)])
    return out


@pytest.fixture(scope="module")
def failures(results) -> list[dict]:
    return [r["failures"] for r in results]


@pytest.mark.parametrize("scenario, status, rank, where", [
    ("setup_oom", "oom", 1, "setup"),
    ("round_oom", "oom", 0, "round 2"),
    ("round_error", "error", 1, "warm-up round 1"),
    ("after_oom", "oom", 1, "after the rounds"),
])
def test_a_failure_on_one_rank_stops_every_rank_quickly_and_names_the_rank(failures, scenario, status, rank,
                                                                          where):
    for r in failures:
        m = r[scenario]
        assert m.status == status and m.times_s == () and m.rank_medians_s == (), m
        assert m.failed_ranks[0] == rank, m.failed_ranks  # the root cause first, then what it caused
        assert r[scenario + "_s"] < FAILURE_BUDGET_S, (scenario, r[scenario + "_s"])
        if status == "oom":
            assert m.error.startswith(f"rank {rank} ran out of memory in {where}: {OOM_TEXT}"), m.error
        else:
            assert m.error.startswith(f"rank {rank} raised in {where}: ValueError: bad batch on purpose"), m.error
            assert "Traceback (most recent call last)" in m.error and "in step" in m.error, m.error
    assert failures[0][scenario] == failures[1][scenario]  # every rank returns the same outcome


def test_the_default_group_is_made_again_after_a_failure(failures):
    for rank, r in enumerate(failures):
        assert r["all_reduce_after"] == 2.0
        nxt = r["next"]
        assert nxt.status == "ok" and len(nxt.times_s) == 2 and nxt.error is None
        assert nxt.after == [True, [[0.0], [1.0]]]


def test_nccl_abort_watcher_tears_down_once_signalled_and_never_after_stop(tmp_path):
    """The thread that releases NCCL device work waiting on a failed peer (the NCCL path itself needs
    several GPUs): it tears down once the key is set, and a stopped watcher never does."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    calls: list[str] = []
    signalled = timing._AbortWatcher(store, "m1/abort", tear_down=lambda: calls.append("m1"))
    stopped = timing._AbortWatcher(store, "m2/abort", tear_down=lambda: calls.append("m2"))
    stopped.stop()
    store.set("m2/abort", "1")
    store.set("m1/abort", "1")
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    signalled.stop()
    assert calls == ["m1"]
