"""All-reduce benchmark: the slowest rank's time per operation and nccl-tests-style bandwidths.

    algbw = bytes / time                       (what the caller sees: tensor size over latency)
    busbw = algbw * 2 (n - 1) / n              (all-reduce; the per-link traffic of a ring all-reduce,
                                                comparable across world sizes: nccl-tests'
                                                doc/PERFORMANCE.md)

`allreduce_case(device, case)` is collective: every rank builds a float32 tensor of ``size_mb`` MiB on
its device, checks once that the all-reduce sums correctly, then times rounds of ``inner_iters``
back-to-back blocking all-reduces (nccl-tests' default loop; a single small all-reduce is dominated by
launch and synchronization overhead) with the shared harness: uncounted warm-up, a barrier and device
sync before each round, the device synchronized before every clock read (even though the gloo call is
blocking, NCCL's is not).  Round times are divided by ``inner_iters`` and reduced to the slowest rank
per round (`cs336_systems.bench.rank_timing`).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from cs336_systems.bench import rank_timing as timing

MiB = 2**20


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for an all-reduce of ``nbytes`` that took ``seconds`` on ``world_size`` ranks."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


class AllReduceStep:
    """``inner_iters`` blocking all-reduces of one float32 tensor of ``nbytes`` bytes."""

    def __init__(self, nbytes: int, inner_iters: int, device: torch.device) -> None:
        if nbytes % 4:
            raise ValueError(f"nbytes must be a multiple of 4 (float32 elements), got {nbytes}")
        if inner_iters < 1:
            raise ValueError(f"inner_iters must be >= 1, got {inner_iters}")
        self.inner_iters = inner_iters
        rank, world = dist.get_rank(), dist.get_world_size()
        self.tensor = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(self.tensor)
        expected = world * (world + 1) / 2
        if not torch.all(self.tensor == expected):
            raise RuntimeError(f"all_reduce returned wrong sums on rank {rank} (expected {expected})")
        self.tensor.zero_()  # zeros stay zeros however often they are summed: no overflow to inf

    def __call__(self) -> None:
        for _ in range(self.inner_iters):
            dist.all_reduce(self.tensor)


def allreduce_case(device: torch.device, case: dict) -> dict:
    """Collective perf-case body: see the module docstring.  Returns what rank 0 records."""
    nbytes = int(case["size_mb"] * MiB)
    inner = case["inner_iters"]
    world = dist.get_world_size()
    measured = timing.measure_across_ranks(
        lambda: AllReduceStep(nbytes, inner, device), warmup=case["warmup"], rounds=case["rounds"], device=device,
    )
    if measured.status != "ok":
        return {"status": measured.status, "error": measured.error}
    per_op = tuple(t / inner for t in measured.times_s)
    median = statistics.median(per_op)
    algbw, busbw = bus_bandwidth(nbytes, median, world)
    return {
        "status": "ok",
        "times_s": per_op,
        "extra_info": {
            "bytes": nbytes,
            "backend": dist.get_backend(),
            "algbw_gbps": algbw / 1e9,
            "busbw_gbps": busbw / 1e9,
            "rank_median_ms": [m / inner * 1e3 for m in measured.rank_medians_s],
        },
    }
