"""The timing harness, with a fake clock and a fake device so the ordering can be checked exactly."""

import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems.bench import harness as benchmarking
from cs336_systems.bench.harness import Measurement, Stats, SynchronizedClock, measure


class FakeDevice:
    """Records the order of sync / clock read / step events; the clock advances only when work runs."""

    def __init__(self, step_seconds=0.25):
        self.events = []
        self.now = 0.0
        self.pending = 0.0  # "queued" device work, only visible to the clock after a sync
        self.step_seconds = step_seconds

    def sync(self):
        self.events.append("sync")
        self.now += self.pending
        self.pending = 0.0

    def clock(self):
        self.events.append("read")
        return self.now

    def step(self):
        self.events.append("step")
        self.pending += self.step_seconds  # asynchronous: the host returns immediately

    def harness_clock(self):
        # the host-share reads (unsynchronized by design) are not logged: every logged read is a timed one
        return SynchronizedClock(sync=self.sync, clock=self.clock, host_clock=lambda: self.now)


def assert_every_read_follows_a_sync(events):
    for i, event in enumerate(events):
        if event == "read":
            assert i > 0 and events[i - 1] == "sync", f"clock read #{i} not preceded by sync: {events}"


def test_measure_syncs_before_every_read_and_skips_warmup():
    dev = FakeDevice(step_seconds=0.25)
    result = measure(lambda: dev.step, warmup=3, rounds=5, clock=dev.harness_clock())
    assert result.ok and result.warmup == 3
    assert dev.events.count("step") == 8
    assert result.times_s == (0.25,) * 5  # async work is inside every interval, warm-up in none
    assert_every_read_follows_a_sync(dev.events)
    first_read = dev.events.index("read")
    assert dev.events[:first_read].count("step") == 3  # warm-up drained before the first timed read


def test_host_share_of_each_round_is_recorded_without_a_sync():
    """timing="host" also records the host's time to run the step (before the closing sync): here the host
    spends 0.1 s queueing 0.25 s of device work, so each round reads 0.35 s and its host share 0.1 s."""
    dev = FakeDevice(step_seconds=0.25)

    def step():
        dev.now += 0.1  # host work: the clock moves without a sync
        dev.step()

    result = measure(lambda: step, warmup=1, rounds=4, clock=dev.harness_clock())
    assert result.times_s == pytest.approx((0.35,) * 4)
    assert result.host_s == pytest.approx((0.1,) * 4)
    assert result.as_dict()["host_s"] == pytest.approx([0.1] * 4)
    # device and graph timings have no host share
    assert Measurement("ok", 0, (1.0,)).host_s == ()


def test_gc_is_paused_while_measuring_and_restored_after():
    import gc

    states = []
    assert gc.isenabled()
    measure(lambda: (lambda: states.append(gc.isenabled())), warmup=2, rounds=3)
    assert states == [False] * 5
    assert gc.isenabled()


def test_without_sync_the_fake_device_would_measure_nothing():
    """Control for the test above: reading the clock without a sync misses the queued work."""
    dev = FakeDevice()
    start = dev.clock()
    dev.step()
    assert dev.clock() - start == 0.0


def test_setup_runs_once_and_is_not_timed():
    dev = FakeDevice()
    calls = []

    def setup():
        calls.append(1)
        dev.pending += 100.0  # expensive setup work (e.g. building a model) queued on the device
        return dev.step

    result = measure(setup, warmup=0, rounds=3, clock=dev.harness_clock())
    assert calls == [1]
    assert result.times_s == (0.25,) * 3


@pytest.mark.parametrize(
    "where", ["setup", "warmup", "measure"],
)
def test_oom_anywhere_becomes_a_result(where):
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if where == "warmup" or (where == "measure" and calls["n"] > 2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def setup():
        if where == "setup":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return step

    result = measure(setup, warmup=2, rounds=3)
    assert result.status == "oom" and not result.ok
    assert "out of memory" in result.error
    assert result.times_s == () and result.stats is None


def test_cublas_alloc_failure_counts_as_oom_but_other_errors_propagate():
    def cublas():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    assert measure(lambda: cublas, warmup=1, rounds=1).status == "oom"

    def bug():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure(lambda: bug, warmup=1, rounds=1)


@pytest.mark.parametrize("exc, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (torch.cuda.OutOfMemoryError("anything"), True),  # the same class as torch.OutOfMemoryError
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    # a worker's traceback relayed as text (perf/conftest.py turns a SpawnError into a RuntimeError)
    (RuntimeError("rank 1 failed:\nTraceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate"),
     True),
    (RuntimeError("index out of memory region"), False),
    (RuntimeError("the kernel ran out of memory bandwidth"), False),
    (RuntimeError("out of memory"), False),  # no allocator says only that
    (ValueError("CUDA out of memory"), False),  # only torch's OOM type or a RuntimeError
])
def test_only_real_allocation_failures_count_as_oom(exc, oom):
    assert benchmarking.is_out_of_memory(exc) is oom


def test_an_error_that_only_mentions_out_of_memory_propagates():
    def step():
        raise RuntimeError("index out of memory region")

    with pytest.raises(RuntimeError, match="index out of memory region"):
        measure(lambda: step, warmup=1, rounds=1)

    def cpu_oom():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")

    result = measure(lambda: cpu_oom, warmup=1, rounds=1)
    assert result.status == "oom" and "DefaultCPUAllocator" in result.error


def test_bad_arguments():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        measure(lambda: (lambda: None), rounds=0)
    with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
        measure(lambda: (lambda: None), warmup=-1)
    with pytest.raises(TypeError, match="setup must return a callable step"):
        measure(lambda: 3, warmup=0, rounds=1)


class FakeBackwardStep:
    """A step with its own per-round preparation (like a timed backward needing an untimed forward)."""

    def __init__(self, dev, prepare_seconds=50.0):
        self.dev = dev
        self.prepare_seconds = prepare_seconds
        self.prepared = False

    def before_each(self):
        self.dev.events.append("prepare")
        self.dev.pending += self.prepare_seconds
        self.prepared = True

    def __call__(self):
        assert self.prepared, "step ran without its before_each"
        self.prepared = False
        self.dev.step()


def timed_intervals(events):
    """The events between each (start read, end read) pair of the measured rounds."""
    reads = [i for i, e in enumerate(events) if e == "read"]
    # the first read drains warm-up; then reads come in (start, end) pairs
    return [events[a + 1:b] for a, b in zip(reads[1::2], reads[2::2])]


def test_before_each_runs_every_round_but_is_never_timed():
    dev = FakeDevice(step_seconds=0.25)

    def flush():
        dev.events.append("flush")
        dev.pending += 100.0  # queued device work, as zeroing a cache-flush buffer is

    result = measure(lambda: dev.step, warmup=2, rounds=4, clock=dev.harness_clock(), before_each=flush)
    assert result.times_s == (0.25,) * 4  # 100 s of hook work queued before each round, none timed
    assert dev.events.count("flush") == 6 and dev.events.count("step") == 6
    assert_every_read_follows_a_sync(dev.events)
    intervals = timed_intervals(dev.events)
    assert len(intervals) == 4
    assert all(interval == ["step", "sync"] for interval in intervals)


def test_step_before_each_runs_first_then_the_callers_hook():
    dev = FakeDevice(step_seconds=0.25)
    step = FakeBackwardStep(dev)
    result = measure(lambda: step, warmup=1, rounds=3, clock=dev.harness_clock(),
                     before_each=lambda: dev.events.append("flush"))
    assert result.ok and result.times_s == (0.25,) * 3
    warmup, drain = ["prepare", "flush", "step"], ["sync", "read"]
    measured = ["prepare", "flush", "sync", "read", "step", "sync", "read"]
    assert dev.events == warmup + drain + measured * 3


def test_oom_in_before_each_is_a_result_and_bad_hooks_are_rejected():
    def hook():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    result = measure(lambda: (lambda: None), warmup=0, rounds=2, before_each=hook)
    assert result.status == "oom" and "out of memory" in result.error
    with pytest.raises(TypeError, match="before_each must be callable"):
        measure(lambda: (lambda: None), warmup=0, rounds=1, before_each=3)


def test_l2_flush_zeroes_a_buffer_of_the_given_size():
    flush = benchmarking.L2Flush("cpu", nbytes=1024)
    assert flush.buffer is None  # allocated inside the harness, on the first round
    assert measure(lambda: (lambda: None), warmup=1, rounds=2, before_each=flush).ok
    assert flush.buffer.numel() == 1024 and not flush.buffer.any()
    assert benchmarking.L2Flush("cpu").nbytes == 256 * 2**20


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1e-6, 10.0), min_size=2, max_size=40))
def test_stats_match_numpy(times):
    s = Stats.of(times)
    assert s.rounds == len(times)
    assert s.mean == pytest.approx(np.mean(times))
    assert s.std == pytest.approx(np.std(times, ddof=1), abs=1e-12)
    assert s.median == pytest.approx(np.median(times))
    assert (s.min, s.max) == (min(times), max(times))
    q1, q3 = np.percentile(times, [25, 75])  # numpy's linear method == statistics' "inclusive"
    assert s.iqr == pytest.approx(q3 - q1, abs=1e-12)


def test_measurement_dict_has_stats():
    d = Measurement("ok", 1, (1.0, 2.0, 3.0), 10).as_dict()
    assert d["stats"]["median"] == 2.0 and d["stats"]["iqr"] == pytest.approx(1.0)
    assert d["peak_memory_bytes"] == 10
    assert statistics.fmean(d["times_s"]) == 2.0


def test_real_cpu_measurement_has_no_peak_memory():
    x = torch.randn(64, 64)
    result = measure(lambda: (lambda: x @ x), warmup=1, rounds=3, device="cpu")
    assert result.ok and len(result.times_s) == 3 and all(t > 0 for t in result.times_s)
    assert result.peak_memory_bytes is None


@pytest.mark.gpu
def test_cuda_measurement_tracks_peak_memory_of_measured_rounds_only():
    device = torch.device("cuda")

    def setup():
        big = torch.empty(2**28, device=device)  # 1 GiB, freed before the measured rounds
        del big
        x = torch.randn(1024, 1024, device=device)
        return lambda: x @ x

    result = measure(setup, warmup=2, rounds=5, device=device)
    assert result.ok and result.peak_memory_bytes < 2**28


@pytest.mark.gpu
def test_cuda_real_oom_is_recorded_and_memory_released():
    device = torch.device("cuda")
    before = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    held = []

    def setup():
        held.append(torch.empty(total // 2, dtype=torch.uint8, device=device))
        return lambda: torch.empty(total, dtype=torch.uint8, device=device)

    result = measure(setup, warmup=1, rounds=1, device=device)
    assert result.status == "oom"
    held.clear()
    benchmarking.free_memory(device)
    assert torch.cuda.memory_allocated(device) == before


# --- record_measured_times: rounds timed elsewhere (other processes), replayed into pytest-benchmark ---------

REPLAY_TESTS = '''
import pytest
from cs336_systems.bench.harness import record_measured_times


def test_decimal_times(benchmark):
    record_measured_times(benchmark, [0.1, 0.3, 0.2])


def test_binary_fraction_times(benchmark):
    record_measured_times(benchmark, (0.5, 0.25, 1.0, 0.125))


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")  # the point: nothing is recorded
@pytest.mark.parametrize("times", [[], (), [0.1, -0.2], [-1e-9]])
def test_bad_times_record_nothing(benchmark, times):
    with pytest.raises(ValueError, match="times_s must be a non-empty sequence of finite durations >= 0"):
        record_measured_times(benchmark, times)
    assert benchmark.stats is None
'''


def _replayed_benchmarks(pytester, monkeypatch) -> dict:
    """Run REPLAY_TESTS in an isolated pytest session; return {test name: its --benchmark-json entry}."""
    import json
    from pathlib import Path

    # Under `pytest -n`, xdist's variables would leak into the inner session and disable pytest-benchmark.
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    root = Path(__file__).resolve().parents[2]
    pytester.makeconftest((root / "conftest.py").read_text())
    pytester.makepyfile(test_replay=REPLAY_TESTS)
    result = pytester.runpytest_subprocess("--benchmark-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, warnings=0)
    data = json.loads((pytester.path / "out.json").read_text())
    return {b["name"]: b for b in data["benchmarks"]}


def _assert_stats_are(stats: dict, times: list[float], exact: bool) -> None:
    same = (lambda a, b: a == b) if exact else (lambda a, b: a == pytest.approx(b, rel=1e-12, abs=0))
    assert stats["rounds"] == len(times) and stats["iterations"] == 1
    assert len(stats["data"]) == len(times)
    assert all(same(a, b) for a, b in zip(stats["data"], times)), stats["data"]  # in the order given
    assert same(stats["min"], min(times)) and same(stats["max"], max(times))
    assert same(stats["median"], statistics.median(times))
    assert stats["mean"] == pytest.approx(statistics.fmean(times), rel=1e-12)  # summation order may round


def test_record_measured_times_become_the_rounds_of_the_saved_json(pytester, monkeypatch):
    benchmarks = _replayed_benchmarks(pytester, monkeypatch)
    assert set(benchmarks) == {"test_decimal_times", "test_binary_fraction_times"}  # bad input: nothing saved
    _assert_stats_are(benchmarks["test_binary_fraction_times"]["stats"], [0.5, 0.25, 1.0, 0.125], exact=True)
    _assert_stats_are(benchmarks["test_decimal_times"]["stats"], [0.1, 0.3, 0.2], exact=True)


class _PedanticRecorder:
    """Stands in for pytest-benchmark's fixture: pedantic reads ``_timer`` before and after each round
    (pytest-benchmark 5's runner: start = timer(); target(); end = timer()) and keeps end - start."""

    def __init__(self):
        self._timer = None
        self.data = None

    def pedantic(self, target, rounds, iterations, warmup_rounds, setup=None):
        assert iterations == 1 and warmup_rounds == 0 and setup is None
        self.data = []
        for _ in range(rounds):
            start = self._timer()
            target()
            self.data.append(self._timer() - start)


def test_record_measured_times_replays_decimal_times_exactly():
    fake = _PedanticRecorder()
    benchmarking.record_measured_times(fake, [0.1, 0.3, 0.2])
    assert fake.data == [0.1, 0.3, 0.2]


def test_record_measured_times_reads_the_clock_twice_per_round_only():
    fake = _PedanticRecorder()
    benchmarking.record_measured_times(fake, [0.5, 0.25])
    assert fake.data == [0.5, 0.25]
    with pytest.raises(RuntimeError, match="replay clock read more often"):
        fake._timer()  # a fifth read: pytest-benchmark reading more than (start, end) per round is caught


def test_record_measured_times_rejects_nan():
    with pytest.raises(ValueError, match="times_s"):
        benchmarking.record_measured_times(_PedanticRecorder(), [0.1, float("nan")])


class FakeStream:
    """A device queue for timing="device": an event's timestamp is the queued work ahead of it (the time
    the device reaches it), and nothing waits on the host until sync()."""

    def __init__(self, dev: FakeDevice):
        self.dev = dev

    def event(self):
        dev = self.dev
        dev.events.append("event")

        class Event:
            at = dev.now + dev.pending

            def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event.elapsed_time
                assert dev.events[-1] == "sync", "an event was read before the device was synchronized"
                return (end.at - self.at) * 1e3

        return Event()


def test_device_timing_brackets_only_the_step_and_syncs_once():
    dev = FakeDevice(step_seconds=0.25)
    stream = FakeStream(dev)
    step = FakeBackwardStep(dev, prepare_seconds=50.0)

    def flush():
        dev.events.append("flush")
        dev.pending += 100.0

    def hook():
        step.before_each()
        flush()

    times = benchmarking.device_timed_rounds(step, hook, 4, "cuda", event=stream.event, sync=dev.sync)
    assert times == [0.25] * 4  # 150 s of hook work queued before every round, none inside an interval
    assert dev.events == ["prepare", "flush", "event", "step", "event"] * 4 + ["sync"]


def test_device_timing_needs_cuda_and_a_known_name():
    with pytest.raises(ValueError, match="timing='device'.*CUDA.*device='cpu'"):
        measure(lambda: (lambda: None), warmup=0, rounds=1, device="cpu", timing="device")
    with pytest.raises(ValueError, match="timing='device'.*device=None"):
        measure(lambda: (lambda: None), warmup=0, rounds=1, timing="device")
    with pytest.raises(ValueError, match="timing must be one of .*'wall'"):
        measure(lambda: (lambda: None), warmup=0, rounds=1, timing="wall")


def test_graph_timing_captures_once_and_brackets_each_replay():
    dev = FakeDevice(step_seconds=0.25)
    stream = FakeStream(dev)
    captured = []

    def capture(step, device):
        captured.append((step, device))
        step()  # the capture runs the step once: the work is recorded, not timed
        dev.pending = 0.0

        def replay():
            dev.events.append("replay")
            dev.pending += 0.25

        return replay

    def flush():
        dev.events.append("flush")
        dev.pending += 100.0

    step = dev.step
    times = benchmarking.graph_timed_rounds(step, flush, 3, "cuda", capture=capture, event=stream.event,
                                            sync=dev.sync)
    assert captured == [(step, "cuda")]
    assert times == [0.25] * 3
    assert dev.events == ["step"] + ["flush", "event", "replay", "event"] * 3 + ["sync"]


def test_graph_timing_refuses_a_step_with_its_own_preparation():
    dev = FakeDevice()
    step = FakeBackwardStep(dev)
    with pytest.raises(ValueError, match="timing='graph'.*before_each.*timing='device'"):
        benchmarking.graph_timed_rounds(step, None, 1, "cuda", capture=lambda s, d: s)
    with pytest.raises(ValueError, match="timing='graph' uses CUDA events.*device='cpu'"):
        measure(lambda: step, warmup=0, rounds=1, device="cpu", timing="graph")


@pytest.mark.gpu
def test_cuda_graph_timing_replays_the_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.empty_like(x)
    device = measure(lambda: (lambda: x @ x), warmup=3, rounds=10, device="cuda", timing="device")
    graph = measure(lambda: (lambda: torch.mm(x, x, out=y)), warmup=3, rounds=10, device="cuda", timing="graph")
    assert device.ok and graph.ok and len(graph.times_s) == 10
    # the same kernel, host removed: within noise of the event-timed eager call
    assert 0.8 * device.stats.median <= graph.stats.median <= 1.2 * device.stats.median
    # a replay really recomputes: new inputs, new result
    x.copy_(torch.eye(4096, device="cuda"))
    replay = benchmarking.capture_cuda_graph(lambda: torch.mm(x, x, out=y), "cuda")
    y.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.eye(4096, device="cuda"))
    with pytest.raises(ValueError, match="timing='graph'.*before_each"):
        measure(lambda: FakeBackwardStep(FakeDevice()), warmup=0, rounds=1, device="cuda", timing="graph")


@pytest.mark.gpu
def test_cuda_device_timing_measures_the_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    host = measure(lambda: (lambda: x @ x), warmup=3, rounds=10, device="cuda")
    device = measure(lambda: (lambda: x @ x), warmup=3, rounds=10, device="cuda", timing="device")
    assert host.ok and device.ok and len(device.times_s) == 10
    # the same matmul: device time is positive and not above the host-synchronized latency by more than noise
    assert 0 < device.stats.median <= host.stats.median * 1.2


# --- the synthetic slowdown (CS336_PERF_SLOWDOWN): a regression of known size for calibrating the gate -------
class _FakeClock:
    """Events and a sleep kernel on a fake device clock (ms): the step takes 10 ms, a sleep 2e-6 ms a cycle."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def event(self):
        clock = self

        class Event:
            t = clock.now

            def elapsed_time(self, end):
                return end.t - self.t

        return Event()

    def step(self):
        self.now += 10.0

    def sleep(self, cycles):
        self.slept.append(cycles)
        self.now += cycles * 2e-6


def test_synthetic_slowdown_adds_the_fraction_of_the_steps_time():
    clock = _FakeClock()
    slowed = benchmarking.synthetic_slowdown(clock.step, None, "cuda", 0.1, event=clock.event, sync=lambda: None,
                                             sleep=clock.sleep)
    # sized from 3 rounds of the step (10 ms) and 3 sleeps of 1e6 cycles (2 ms): 1 ms is 5e5 cycles
    assert clock.slept == [benchmarking.SLEEP_PROBE_CYCLES] * 3
    before = clock.now
    slowed()
    assert clock.slept[-1] == 500_000 and clock.now - before == pytest.approx(11.0)
    step = clock.step
    assert benchmarking.synthetic_slowdown(step, None, "cpu", 0.0) is step  # 0: the step itself


def test_synthetic_slowdown_is_refused_off_the_gpu_and_outside_0_to_1(monkeypatch):
    with pytest.raises(ValueError, match="CS336_PERF_SLOWDOWN=0.05 slows the GPU .*the case runs on cpu"):
        benchmarking.synthetic_slowdown(lambda: None, None, "cpu", 0.05)
    with pytest.raises(ValueError, match="must be a fraction from 0 to 1, got 1.5"):
        benchmarking.synthetic_slowdown(lambda: None, None, "cuda", 1.5)
    monkeypatch.setenv("CS336_PERF_SLOWDOWN", "5%")
    with pytest.raises(ValueError, match=r"CS336_PERF_SLOWDOWN must be a fraction from 0 to 1 \(or unset\), got '5%'"):
        benchmarking.slowdown_fraction()
    monkeypatch.setenv("CS336_PERF_SLOWDOWN", ".1")
    assert benchmarking.slowdown_fraction() == 0.1
    # measure() reads the switch: on the CPU a set slowdown is an error, not a silently unslowed run
    with pytest.raises(ValueError, match="CS336_PERF_SLOWDOWN=0.1 slows the GPU"):
        benchmarking.measure(lambda: (lambda: None), warmup=0, rounds=1, device="cpu")


@pytest.mark.gpu
def test_synthetic_slowdown_on_cuda_sizes_the_real_sleep_kernel_from_real_events():
    """On CUDA events and torch.cuda._sleep: three probe sleeps, then one sleep per slowed round, sized from the
    probes' measured times, after the step (whose result is untouched).  How much slower a case reads is a
    measurement, not a unit test: the calibration runs in results/h200/gate-validation record it."""
    x = torch.randn(1024, 1024, device="cuda")
    out = []
    slept, marks = [], []

    def step():
        out.append(x @ x)

    def sleep(cycles):
        slept.append(cycles)
        torch.cuda._sleep(cycles)

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)
        return e

    slowed = benchmarking.synthetic_slowdown(step, None, "cuda", 0.2, event=event, sleep=sleep)
    assert slept == [benchmarking.SLEEP_PROBE_CYCLES] * benchmarking.SLOWDOWN_PROBE_ROUNDS
    torch.cuda.synchronize()
    rounds = benchmarking.SLOWDOWN_PROBE_ROUNDS
    times = [marks[2 * i].elapsed_time(marks[2 * i + 1]) for i in range(2 * rounds)]
    step_ms, sleep_ms = statistics.median(times[:rounds]), statistics.median(times[rounds:])
    assert sleep_ms > 0 and step_ms > 0
    slowed()
    slowed()
    expected = max(1, round(benchmarking.SLEEP_PROBE_CYCLES * 0.2 * step_ms / sleep_ms))
    assert slept[rounds:] == [expected, expected]
    torch.cuda.synchronize()
    torch.testing.assert_close(out[-1], x @ x)
