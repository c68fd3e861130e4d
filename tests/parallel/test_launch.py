"""launch.spawn: results come back by rank (tensors included), failures and hangs raise, never hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from cs336_systems.parallel import launch


def _sum_ranks(rank, world_size):
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return {"rank": rank, "sum": t, "world": dist.get_world_size()}


def _one_rank_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes: must end by the collective timeout


def _one_rank_hangs(rank, world_size):
    if rank == 0:
        time.sleep(60)


def _one_rank_exits_quietly(rank, world_size):
    if rank == 1:
        os._exit(0)  # no result, no traceback, exit code 0
    return rank


def test_spawn_returns_results_by_rank_with_tensors():
    results = launch.spawn(_sum_ranks, 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["world"] == 3
        torch.testing.assert_close(r["sum"], torch.full((3,), 3.0))


def test_spawn_reports_a_failing_rank_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(launch.SpawnError, match="rank one fails on purpose"):
        launch.spawn(_one_rank_raises, 2, timeout_s=10)
    assert time.monotonic() - start < 60


def test_spawn_reports_a_rank_that_exits_without_a_result_at_once():
    start = time.monotonic()
    with pytest.raises(launch.SpawnError, match=r"rank\(s\) \[1\] exited with codes \[0\] without reporting"):
        launch.spawn(_one_rank_exits_quietly, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the job's deadline (180 s)


@pytest.mark.slow  # two spawned jobs, one of them waited out (~7 s)
def test_spawn_kills_a_hung_job():
    # A job first, so that the forkserver (started once per process, importing torch) is up: a 5 s startup_s
    # then bounds forking the ranks only; the server's own start took longer than that under a loaded xdist run.
    launch.spawn(_sum_ranks, 2)
    start = time.monotonic()
    with pytest.raises(launch.SpawnError, match="timed out"):
        launch.spawn(_one_rank_hangs, 2, timeout_s=1, startup_s=5)
    assert time.monotonic() - start < 45


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_spawn_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        launch.spawn(_sum_ranks, bad)


def test_init_from_env_outside_torchrun_says_so(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.init_from_env()


def test_require_process_group_names_the_caller():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="MyWrapper needs an initialized"):
        launch.require_process_group("MyWrapper")
