"""Timing a step that runs on every rank: the harness per rank, then the slowest rank per round.

`measure_across_ranks(setup, ...)` is collective (every rank calls it with the same arguments).  Each
rank times its rounds with `cs336_systems.bench.harness.measure` (synchronizing clock, uncounted warm-up,
peak memory after warm-up, OOM capture), with a barrier before every round (untimed, in the per-round
hook) so that all ranks start each round together.  The per-round times are then all-gathered and
reduced to the maximum over ranks: a data-parallel step is as slow as its slowest rank, and that is
the number nccl-tests and the DDP benchmarks report.  Per-rank medians are kept for skew diagnosis,
and peak memory is the maximum over ranks.

OOM: a rank that runs out of memory while its peers wait in a collective cannot tell them; the peers
fail when the process group's timeout expires.  The caller (spawn or torchrun) sees the failure.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cs336_systems.bench import harness as benchmarking
from cs336_systems.parallel.launch import require_process_group


@dataclass(frozen=True)
class RankedMeasurement:
    status: str  # "ok" | "oom"
    times_s: tuple[float, ...]  # per round, the slowest rank's time
    rank_medians_s: tuple[float, ...]  # each rank's own median
    peak_memory_bytes: int | None  # max over ranks (None on CPU)
    error: str | None = None


def barrier(device: torch.device) -> None:
    """All ranks wait for each other, with this rank's queued device work finished first."""
    benchmarking.synchronize(device)
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()
    benchmarking.synchronize(device)


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """All-gather a same-length list of floats from every rank -> [rank][i]."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def measure_across_ranks(
    setup: Callable[[], benchmarking.Step], *, warmup: int, rounds: int, device: torch.device,
) -> RankedMeasurement:
    """Collective: time ``rounds`` rounds of the step on every rank; reduce to the slowest rank per round."""
    require_process_group("measure_across_ranks")
    device = torch.device(device)
    result = benchmarking.measure(setup, warmup=warmup, rounds=rounds, device=device,
                                  before_each=lambda: barrier(device))
    # Agree on the outcome first, so a rank that hit OOM after the last collective does not leave the
    # others waiting on a gather of times it cannot provide.
    ok = gather_floats([1.0 if result.ok else 0.0], device)
    peak = result.peak_memory_bytes if result.peak_memory_bytes is not None else -1
    peaks = [int(p[0]) for p in gather_floats([float(peak)], device)]
    peak_max = max(peaks) if max(peaks) >= 0 else None
    if not all(o[0] == 1.0 for o in ok):
        return RankedMeasurement("oom", (), (), peak_max, error=result.error or "OOM on another rank")
    per_rank = gather_floats(list(result.times_s), device)
    slowest = tuple(max(column) for column in zip(*per_rank))
    return RankedMeasurement("ok", slowest, tuple(statistics.median(r) for r in per_rank), peak_max)
