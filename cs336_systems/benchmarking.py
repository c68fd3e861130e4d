"""The one timing harness.

Every measurement in this package goes through here, so the rules hold everywhere:

* warm-up rounds run first and are never counted;
* the clock is only ever read through a `SynchronizedClock`, which waits for the device (CUDA
  synchronize) before reading the host timer, so queued kernels are always inside the interval;
* peak memory is reset after warm-up and read after the measured rounds;
* Python's cyclic garbage collector is run once before warm-up and paused until the last measured
  round (as `timeit` does): a full collection over the object graph that torch.compile and autograd
  leave behind takes tens of milliseconds and would land at random in launch-bound steps;
* CUDA out-of-memory (while building the workload, warming up or measuring) becomes a `Measurement`
  with ``status="oom"`` and the memory is released so the next case can run.

Two front ends share these steps:
  `measure(setup, ...)`          times the rounds itself (scripts, profiling, anything outside pytest);
  `run_pytest_benchmark(benchmark, setup, ...)`  lets pytest-benchmark time them (perf/ cases), with
                                 its timer replaced by the synchronizing clock.

``setup`` is a zero-argument callable returning the zero-argument step to time; building the workload
inside the harness is what lets an OOM during model construction become a result too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Step = Callable[[], object]


def synchronize(device: torch.device | str | None) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class SynchronizedClock:
    """A timer that synchronizes the device before every read.

    ``sync`` and ``clock`` are injectable so tests can check the ordering with fakes.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._sync = sync if sync is not None else (lambda: synchronize(device))
        self._clock = clock

    def __call__(self) -> float:
        self._sync()
        return self._clock()


@dataclass(frozen=True)
class Stats:
    """Summary statistics of per-round times in seconds (quartiles by the inclusive method)."""

    rounds: int
    mean: float
    std: float
    median: float
    min: float
    max: float
    q1: float
    q3: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @classmethod
    def of(cls, times: list[float] | tuple[float, ...]) -> Stats:
        if not times:
            raise ValueError("Stats.of needs at least one time")
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
        return cls(
            rounds=len(times),
            mean=statistics.fmean(times),
            std=statistics.stdev(times) if len(times) > 1 else 0.0,
            median=statistics.median(times),
            min=min(times),
            max=max(times),
            q1=q1,
            q3=q3,
        )


@dataclass(frozen=True)
class Measurement:
    """The outcome of one benchmark case: times, or an OOM."""

    status: str  # "ok" | "oom"
    warmup: int
    times_s: tuple[float, ...] = ()
    peak_memory_bytes: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stats(self) -> Stats | None:
        return Stats.of(self.times_s) if self.times_s else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["times_s"] = list(self.times_s)
        if self.stats is not None:
            out["stats"] = {**dataclasses.asdict(self.stats), "iqr": self.stats.iqr}
        return out


class _OutOfMemory(Exception):
    """Internal: carries the message of an OOM out of the frames that held the tensors."""


_OOM_PATTERNS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and the allocation failures cuBLAS/cuDNN report as RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _OOM_PATTERNS)


def free_memory(device: torch.device | str | None) -> None:
    """Drop unreachable tensors and return cached blocks to the driver."""
    gc.collect()
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device | str | None) -> None:
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device | str | None) -> int | None:
    """Peak bytes allocated by tensors since the last reset (None on CPU, where torch does not track it)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


@contextlib.contextmanager
def gc_paused():
    """Collect once, then keep the cyclic GC off for the block (restoring its previous state)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _guard_oom(call: Callable[[], object]) -> object:
    """Run ``call``; re-raise an OOM as _OutOfMemory *without* its traceback (which pins the tensors)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - filtered just below
        if not is_out_of_memory(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise _OutOfMemory(message)


def _prepare(setup: Callable[[], Step], warmup: int, clock: SynchronizedClock, device) -> Step:
    """Build the step and run the warm-up rounds (timed by nobody), then reset the peak counter."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    step = _guard_oom(setup)
    if not callable(step):
        raise TypeError(f"setup must return a callable step, got {type(step).__name__}")
    for _ in range(warmup):
        _guard_oom(step)
    clock()  # drain the queue: warm-up work must not leak into the first measured round
    reset_peak_memory(device)
    return step


def measure(
    setup: Callable[[], Step],
    *,
    warmup: int = 5,
    rounds: int = 10,
    device: torch.device | str | None = None,
    clock: SynchronizedClock | None = None,
) -> Measurement:
    """Build the step with ``setup()``, run ``warmup`` uncounted rounds, then time ``rounds`` rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    clock = clock or SynchronizedClock(device)
    try:
        with gc_paused():
            step = _prepare(setup, warmup, clock, device)
            times = []
            for _ in range(rounds):
                start = clock()
                _guard_oom(step)
                times.append(clock() - start)
    except _OutOfMemory as oom:
        error = str(oom)
    else:
        del step
        return Measurement("ok", warmup, tuple(times), peak_memory_bytes(device))
    free_memory(device)
    return Measurement("oom", warmup, error=error)


def run_pytest_benchmark(
    benchmark,
    setup: Callable[[], Step],
    *,
    warmup: int,
    rounds: int,
    device: torch.device | str | None = None,
    clock: SynchronizedClock | None = None,
) -> Measurement:
    """Time a step with pytest-benchmark's ``benchmark`` fixture, under this harness's rules.

    pytest-benchmark's runner reads ``benchmark._timer`` before and after each round; pointing it at a
    SynchronizedClock makes every clock read wait for the device (a test pins this behaviour, because
    the attribute is pytest-benchmark's own).  Warm-up is run here rather than through pedantic's
    ``warmup_rounds`` so that an OOM there is caught like any other and peak memory covers only the
    measured rounds.  On OOM nothing is recorded in pytest-benchmark's stats (an OOM has no time);
    the caller records the returned Measurement instead.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    clock = clock or SynchronizedClock(device)
    try:
        with gc_paused():
            step = _prepare(setup, warmup, clock, device)
            benchmark._timer = clock
            benchmark.pedantic(lambda: _guard_oom(step), rounds=rounds, iterations=1, warmup_rounds=0)
    except _OutOfMemory as oom:
        error = str(oom)
    else:
        del step
        times = tuple(benchmark.stats.stats.data) if benchmark.stats is not None else ()
        return Measurement("ok", warmup, times, peak_memory_bytes(device))
    free_memory(device)
    return Measurement("oom", warmup, error=error)
