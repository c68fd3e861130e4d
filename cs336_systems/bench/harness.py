"""The one timing harness.

Every measurement in this package goes through here, so the rules hold everywhere:

* warm-up rounds run first and are never counted;
* the clock is only ever read through a `SynchronizedClock`, which waits for the device (CUDA
  synchronize) before reading the host timer, so queued kernels are always inside the interval;
* peak memory is reset after warm-up and read after the measured rounds;
* Python's cyclic garbage collector is run once before warm-up and paused until the last measured
  round (as `timeit` does): a full collection over the object graph that torch.compile and autograd
  leave behind takes tens of milliseconds and would land at random in launch-bound steps;
* work that must happen before each round but is not what is measured (the forward pass before a timed
  backward, an L2 cache flush) runs in a per-round hook *outside* the timed interval: the hook runs,
  then the clock's sync drains its queued device work, and only then is the start time read;
* out-of-memory (while building the workload, in a per-round hook, warming up or measuring) becomes a
  `Measurement` with ``status="oom"`` and the memory is released so the next case can run.  What counts
  as an OOM is `is_out_of_memory`: torch's OutOfMemoryError, or the allocators' exact messages
  (`OOM_MESSAGES`), never any error that happens to contain "out of memory".

Three ways to read a round's time (``timing``):
  "host"    (default) the synchronizing clock: the device is idle when a round starts and drained when it
            ends, so the round's time includes the host's latency to its first kernel (Python, dispatch,
            launches) and the final sync: the latency a caller waits for one call.  Each round also
            records the host's share (`Measurement.host_s`: start to the step's return, before the
            final sync), which says whether the round was host- or device-bound.
  "device"  as ``triton.testing.do_bench``: CUDA events recorded on the current stream right before and
            after the step, no synchronization between rounds (one at the end).  The host runs ahead,
            so host overhead is hidden behind device work already queued (the per-round hooks: the L2
            flush, the forward before a timed backward) as long as it is shorter; what is measured is
            device time, the convention of the FlashAttention and Triton benchmarks.  CUDA only.
            Hooks still run outside the interval: their kernels precede the start event on the stream.
            When one call's host work (Python, autograd, launches) takes longer than its kernels, the
            device waits for the host inside the interval and this is still a host measurement.
  "graph"   the step captured once into a CUDA graph (after the warm-up, plus a few rounds on a side
            stream as CUDA-graph capture requires), each round one replay bracketed by CUDA events, as
            ``triton.testing.do_bench_cudagraph`` times: the kernels' time with the host removed for
            every implementation alike, which is what compares kernels where a call's host work is longer
            than its device work (small attention problems).  CUDA only; the step's own
            ``before_each`` (the forward before a timed backward) cannot run between replays, so such
            a step is refused; the caller's ``before_each`` (the L2 flush) runs eagerly before each
            replay, outside the interval.

Two front ends share these steps:
  `measure(setup, ...)`          times the rounds itself (scripts, profiling, anything outside pytest);
  `run_pytest_benchmark(benchmark, setup, ...)`  lets pytest-benchmark time them (perf/ cases), with
                                 its timer replaced by the synchronizing clock.

``setup`` is a zero-argument callable returning the zero-argument step to time; building the workload
inside the harness is what lets an OOM during model construction become a result too.

Per-round hooks, run in this order before every warm-up and measured round, never timed:
  ``step.before_each()``   if the step has one: the workload's own preparation, which needs the objects
                           ``setup`` built (e.g. run the forward pass whose backward the step times);
  ``before_each()``        the caller's hook, independent of the workload (e.g. `L2Flush`), last so
                           that it sits right before the timed region.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cs336_systems import switches

Step = Callable[[], object]
Hook = Callable[[], object]

L2_FLUSH_BYTES = 256 * 2**20  # triton.testing.do_bench's cache-clearing buffer; > any GPU's L2 today


def synchronize(device: torch.device | str | None) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class SynchronizedClock:
    """A timer that synchronizes the device before every read.

    ``sync`` and ``clock`` are injectable so tests can check the ordering with fakes; ``host_clock`` (the
    same clock unless given) is the one `unsynced` reads.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        host_clock: Callable[[], float] | None = None,
    ) -> None:
        self._sync = sync if sync is not None else (lambda: synchronize(device))
        self._clock = clock
        self._host_clock = host_clock if host_clock is not None else clock

    def __call__(self) -> float:
        self._sync()
        return self._clock()

    def unsynced(self) -> float:
        """The host timer without waiting for the device: only for the host's own share of a round
        (`Measurement.host_s`), never for a round's time."""
        return self._host_clock()


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
    # timing="host" only: per round, the host's time to run the step (from the round's start, the device
    # idle, to the step's return, before the closing synchronization): the time to queue its work.  Near
    # the round's time the round is host-bound (the device waited on the host); well below it, device-bound
    # with the host that far ahead.  A step that synchronizes inside (.item()) reads host-bound.
    host_s: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stats(self) -> Stats | None:
        return Stats.of(self.times_s) if self.times_s else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["times_s"] = list(self.times_s)
        out["host_s"] = list(self.host_s)
        if self.stats is not None:
            out["stats"] = {**dataclasses.asdict(self.stats), "iqr": self.stats.iqr}
        return out


class _OutOfMemory(Exception):
    """Internal: carries the message of an OOM out of the frames that held the tensors."""


# The exact texts of allocation failures that reach Python as a plain RuntimeError (or as text only, e.g. a
# worker's traceback relayed by a SpawnError), never a bare "out of memory" that any message may contain
# ("index out of memory region"):
OOM_MESSAGES = (
    "CUDA out of memory",  # the CUDA caching allocator (torch.OutOfMemoryError, or its text in a traceback)
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation from a CUDA runtime call (C10_CUDA_CHECK)
    "DefaultCPUAllocator: can't allocate memory",  # the CPU allocator ("... Error code 12 (Cannot allocate memory)")
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace / handle
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN likewise
    "OutOfMemoryError: ",  # "torch.OutOfMemoryError: <message>" as a relayed traceback prints it
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError (``torch.cuda.OutOfMemoryError`` is the same class) and for a
    RuntimeError whose text holds one of the allocators' own messages (`OOM_MESSAGES`); a RuntimeError
    that merely contains the words "out of memory" is not an OOM."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(message in text for message in OOM_MESSAGES)


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


class L2Flush:
    """A per-round hook that zeroes an ``nbytes`` buffer, evicting the inputs from the device's caches.

    Pass it as ``before_each`` so every measured round starts with a cold L2, as
    ``triton.testing.do_bench`` does.  The buffer is allocated on the first call (inside the harness, so
    an OOM there is recorded) and kept: it counts in the case's peak memory.
    """

    def __init__(self, device: torch.device | str | None, nbytes: int = L2_FLUSH_BYTES) -> None:
        self.device = device
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.buffer.zero_()


def _round_hook(step: Step, before_each: Hook | None) -> Callable[[], None] | None:
    """The hooks to run before each round (step's own first, then the caller's), as one OOM-guarded call."""
    hooks = [h for h in (getattr(step, "before_each", None), before_each) if h is not None]
    if not hooks:
        return None
    for hook in hooks:
        if not callable(hook):
            raise TypeError(f"before_each must be callable, got {type(hook).__name__}")

    def run() -> None:  # returns None: pytest-benchmark would take a returned value as the step's args
        for hook in hooks:
            _guard_oom(hook)

    return run


def _guard_oom(call: Callable[[], object]) -> object:
    """Run ``call``; re-raise an OOM as _OutOfMemory *without* its traceback (which pins the tensors)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - filtered just below
        if not is_out_of_memory(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise _OutOfMemory(message)


def _prepare(
    setup: Callable[[], Step], warmup: int, clock: SynchronizedClock, device, before_each: Hook | None,
    timing: str = "host",
) -> tuple[Step, Callable[[], None] | None]:
    """Build the step and run the warm-up rounds (timed by nobody), then reset the peak counter.

    Returns the step and its per-round hook (None if there is none).
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    step = _guard_oom(setup)
    if not callable(step):
        raise TypeError(f"setup must return a callable step, got {type(step).__name__}")
    if timing == "graph":
        _check_graphable(step)  # before the warm-up, which would be wasted
    hook = _round_hook(step, before_each)
    for _ in range(warmup):
        if hook is not None:
            hook()
        _guard_oom(step)
    clock()  # drain the queue: warm-up work must not leak into the first measured round
    reset_peak_memory(device)
    return step, hook


TIMINGS = ("host", "device", "graph")
GRAPH_SIDE_STREAM_ROUNDS = 3  # torch's CUDA-graph recipe: run the step a few times on a side stream first


def _check_timing(timing: str, device: torch.device | str | None) -> None:
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    if timing in ("device", "graph") and (device is None or torch.device(device).type != "cuda"):
        raise ValueError(f"timing={timing!r} uses CUDA events and needs a CUDA device, got device={device!r}")


def _check_graphable(step: Step) -> None:
    if getattr(step, "before_each", None) is not None:
        raise ValueError(
            "timing='graph' replays one captured step, so the step's own per-round preparation "
            f"(before_each={step.before_each!r}, e.g. the forward before a timed backward) cannot run between "
            "rounds; time this step with timing='device' or 'host'")


def _queued(step: Step, clock: SynchronizedClock, host: list[float]) -> None:
    """Run one round's step and append the host's time to run it (`Measurement.host_s`), read without a
    synchronization; the caller's synchronizing reads around it time the round."""
    start = clock.unsynced()
    _guard_oom(step)
    host.append(clock.unsynced() - start)


def _host_timed_rounds(step: Step, hook: Callable[[], None] | None, rounds: int,
                       clock: SynchronizedClock) -> tuple[list[float], list[float]]:
    """Time ``rounds`` rounds with the synchronizing clock (timing="host"): seconds per round, and the
    host's share of each (`Measurement.host_s`)."""
    times, host = [], []
    for _ in range(rounds):
        if hook is not None:
            hook()
        start = clock()  # syncs first: the hook's queued device work finishes before this read
        _queued(step, clock, host)
        times.append(clock() - start)
    return times, host


def device_timed_rounds(step: Step, hook: Callable[[], None] | None, rounds: int, device,
                        *, event: Callable[[], object] | None = None,
                        sync: Callable[[], None] | None = None) -> list[float]:
    """Time ``rounds`` rounds with events on the current stream (timing="device"); seconds per round.

    Per round: the hook (untimed: its kernels are queued before the start event), start event, the step,
    end event.  No synchronization until every round is queued, then one; ``event`` and ``sync`` are
    injectable so tests can check that order with fakes.
    """
    if event is None:
        stream = torch.cuda.current_stream(torch.device(device))

        def event():
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e

    marks = []
    for _ in range(rounds):
        if hook is not None:
            hook()
        start = event()
        _guard_oom(step)
        marks.append((start, event()))
    (sync or (lambda: synchronize(device)))()
    return [start.elapsed_time(end) / 1e3 for start, end in marks]  # elapsed_time is in ms


def capture_cuda_graph(step: Step, device) -> Callable[[], None]:
    """Capture one call of ``step`` into a CUDA graph; returns its replay (which keeps the graph alive).

    The step runs ``GRAPH_SIDE_STREAM_ROUNDS`` times on a side stream first (lazy initialisation such as
    cuBLAS workspaces must not happen during capture), then once under capture.  Tensors the step
    allocates come from the graph's private memory pool and are reused by every replay.
    """
    device = torch.device(device)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(GRAPH_SIDE_STREAM_ROUNDS):
            _guard_oom(step)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _guard_oom(step)
    return graph.replay


SLOWDOWN_ENV = "CS336_PERF_SLOWDOWN"
SLOWDOWN_PROBE_ROUNDS = 3  # device-timed rounds that size the synthetic slowdown (and those of the sleep kernel)
SLEEP_PROBE_CYCLES = 1_000_000  # torch.cuda._sleep's argument when its rate is measured (~0.5 ms on an H100)


def slowdown_fraction() -> float:
    """The synthetic slowdown `SLOWDOWN_ENV` asks for (0.0 where unset)."""
    value = switches.read(SLOWDOWN_ENV)
    return float(value) if value else 0.0


def synthetic_slowdown(step: Step, hook: Callable[[], None] | None, device, fraction: float, *,
                       event: Callable[[], object] | None = None,
                       sync: Callable[[], None] | None = None,
                       sleep: Callable[[int], None] | None = None) -> Step:
    """``step`` made ``fraction`` of its time slower, as a regression of known size for calibrating the
    gate (docs/regression-gating.md): after the warm-up, `SLOWDOWN_PROBE_ROUNDS` device-timed rounds give
    the step's median time t and as many calls of the GPU's sleep kernel (torch.cuda._sleep, a spin of a
    number of clock cycles) its rate; every later round runs the step, then a sleep of fraction * t.  The
    sleep is queued on the step's stream, so all three timings (and a captured CUDA graph) include it.
    Where the GPU waits on the host (a host-bound step), the sleep can overlap that wait and the slowdown
    reads smaller; on calls of tens of microseconds the sleep kernel's own launch and minimum length, and
    under graph timing the eager probe's longer time, make it read larger.  So the calibration reports the
    ratio each case measured, not the fraction asked for.  ``event``, ``sync`` and ``sleep`` are injectable
    for tests."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{SLOWDOWN_ENV} must be a fraction from 0 to 1, got {fraction}")
    if fraction == 0.0:
        return step
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(f"{SLOWDOWN_ENV}={fraction} slows the GPU (a sleep kernel); the case runs on {device}")
    sleep = sleep or torch.cuda._sleep
    step_s = statistics.median(device_timed_rounds(step, hook, SLOWDOWN_PROBE_ROUNDS, device, event=event,
                                                   sync=sync))
    sleep_s = statistics.median(device_timed_rounds(lambda: sleep(SLEEP_PROBE_CYCLES), None, SLOWDOWN_PROBE_ROUNDS,
                                                    device, event=event, sync=sync))
    cycles = max(1, round(SLEEP_PROBE_CYCLES * fraction * step_s / sleep_s))

    def slowed() -> None:
        step()
        sleep(cycles)

    return slowed


def graph_timed_rounds(step: Step, hook: Callable[[], None] | None, rounds: int, device,
                       *, capture: Callable[[Step, object], Callable[[], object]] = capture_cuda_graph,
                       event: Callable[[], object] | None = None,
                       sync: Callable[[], None] | None = None) -> list[float]:
    """Time ``rounds`` replays of the captured step (timing="graph"); seconds per round.

    Per round: the hook (eager, untimed), start event, one graph replay, end event; one sync at the end
    (`device_timed_rounds`).  ``capture``, ``event`` and ``sync`` are injectable for tests.
    """
    _check_graphable(step)
    replay = capture(step, device)
    return device_timed_rounds(replay, hook, rounds, device, event=event, sync=sync)


def measure(
    setup: Callable[[], Step],
    *,
    warmup: int = 5,
    rounds: int = 10,
    device: torch.device | str | None = None,
    clock: SynchronizedClock | None = None,
    before_each: Hook | None = None,
    timing: str = "host",
    monitor: contextlib.AbstractContextManager | None = None,
) -> Measurement:
    """Build the step with ``setup()``, run ``warmup`` uncounted rounds, then time ``rounds`` rounds.

    ``before_each`` (and the step's own ``before_each``, if any) runs before every round, untimed.
    ``timing``: "host" (synchronizing clock), "device" (CUDA events, do_bench-style) or "graph" (CUDA
    events around replays of the step captured in a CUDA graph); module docstring.
    ``monitor``: a context manager entered around the measured rounds only (after setup and warm-up),
    e.g. `gpu_telemetry.Telemetry` sampling the clocks while they run.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    _check_timing(timing, device)
    clock = clock or SynchronizedClock(device)
    step = hook = None
    host = ()
    try:
        with gc_paused():
            step, hook = _prepare(setup, warmup, clock, device, before_each, timing)
            step = synthetic_slowdown(step, hook, device, slowdown_fraction())
            with monitor or contextlib.nullcontext():
                if timing == "device":
                    times = device_timed_rounds(step, hook, rounds, device)
                elif timing == "graph":
                    times = graph_timed_rounds(step, hook, rounds, device)
                else:
                    times, host = _host_timed_rounds(step, hook, rounds, clock)
    except _OutOfMemory as oom:
        error = str(oom)
        step = hook = None  # this frame's references would otherwise keep the workload's tensors alive
    else:
        del step, hook
        return Measurement("ok", warmup, tuple(times), peak_memory_bytes(device), host_s=tuple(host))
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
    before_each: Hook | None = None,
    timing: str = "host",
    monitor: contextlib.AbstractContextManager | None = None,
) -> Measurement:
    """Time a step with pytest-benchmark's ``benchmark`` fixture, under this harness's rules.

    ``monitor`` as in `measure`: entered around the measured rounds only.

    timing="device" or "graph" (CUDA events, see the module docstring) times the rounds with `measure` and
    hands the durations to pytest-benchmark through `record_measured_times`; the rest of this docstring
    is "host".

    pytest-benchmark's runner reads ``benchmark._timer`` before and after each round; pointing it at a
    SynchronizedClock makes every clock read wait for the device (a test pins this behaviour, because
    the attribute is pytest-benchmark's own).  Warm-up is run here rather than through pedantic's
    ``warmup_rounds`` so that an OOM there is caught like any other and peak memory covers only the
    measured rounds.  The per-round hooks (``before_each``, see the module docstring) go to pedantic's
    ``setup``, which pytest-benchmark calls before it reads the timer for the round.  On OOM nothing is
    recorded in pytest-benchmark's stats (an OOM has no time); the caller records the returned
    Measurement instead.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    _check_timing(timing, device)
    if timing in ("device", "graph"):
        result = measure(setup, warmup=warmup, rounds=rounds, device=device, clock=clock,
                         before_each=before_each, timing=timing, monitor=monitor)
        if result.ok:
            record_measured_times(benchmark, result.times_s)
        return result
    clock = clock or SynchronizedClock(device)
    step = hook = None
    host: list[float] = []
    try:
        with gc_paused():
            step, hook = _prepare(setup, warmup, clock, device, before_each)
            step = synthetic_slowdown(step, hook, device, slowdown_fraction())
            benchmark._timer = clock
            with monitor or contextlib.nullcontext():
                # pytest-benchmark reads the synchronizing start time right before each call
                benchmark.pedantic(lambda: _queued(step, clock, host), setup=hook, rounds=rounds, iterations=1,
                                   warmup_rounds=0)
    except _OutOfMemory as oom:
        error = str(oom)
        step = hook = None  # this frame's references would otherwise keep the workload's tensors alive
    else:
        del step, hook
        times = tuple(benchmark.stats.stats.data) if benchmark.stats is not None else ()
        return Measurement("ok", warmup, times, peak_memory_bytes(device), host_s=tuple(host) if times else ())
    free_memory(device)
    return Measurement("oom", warmup, error=error)


class _ReplayClock:
    """A timer whose successive reads are 0, t1, 0, t2, ...: read in (start, end) pairs by pytest-benchmark's
    pedantic runner, it yields exactly the durations t1, t2, ... it was given (end - start == tk, bit for
    bit; running sums would round)."""

    def __init__(self, times: tuple[float, ...]) -> None:
        self._reads = [value for t in times for value in (0.0, t)]
        self._next = 0

    def __call__(self) -> float:
        if self._next >= len(self._reads):
            raise RuntimeError("replay clock read more often than two reads per recorded round")
        value = self._reads[self._next]
        self._next += 1
        return value


def record_measured_times(benchmark, times_s: tuple[float, ...] | list[float]) -> None:
    """Record per-round times measured elsewhere (other processes) as pytest-benchmark rounds.

    Multi-process cases time their rounds in the worker processes with this harness (`measure`, i.e.
    synchronized clock, warm-up, OOM capture) and reduce them across ranks (the slowest rank per round,
    `cs336_systems.bench.rank_timing`).  This hands those durations to pytest-benchmark unchanged, one
    round each, through its own pedantic runner with a replaying timer, so its statistics, JSON,
    ``--benchmark-compare`` and reports treat them like any other case.  Nothing is timed here.
    """
    times = tuple(float(t) for t in times_s)
    if not times or not all(math.isfinite(t) and t >= 0 for t in times):
        raise ValueError(f"times_s must be a non-empty sequence of finite durations >= 0, got {list(times)!r}")
    benchmark._timer = _ReplayClock(times)
    benchmark.pedantic(lambda: None, rounds=len(times), iterations=1, warmup_rounds=0)
