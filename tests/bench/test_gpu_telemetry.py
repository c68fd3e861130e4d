"""GPU telemetry (clocks, power, temperature while rounds run) and the cool-down between perf cases."""

import time

import pytest
import torch

from cs336_systems.bench import gpu_telemetry
from cs336_systems.bench.gpu_telemetry import Sample, Telemetry, cool_down, summarize
from cs336_systems.bench.harness import measure


class FakeNvml:
    """What gpu_telemetry reads of pynvml, returning scripted readings (temperatures in order)."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, temperatures, clock=1980, power_mw=650_000, reasons=0x4):
        self.temperatures = list(temperatures)
        self.clock, self.power_mw, self.reasons = clock, power_mw, reasons

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return self.clock

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw

    def nvmlDeviceGetTemperature(self, handle, kind):
        return self.temperatures.pop(0) if len(self.temperatures) > 1 else self.temperatures[0]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.reasons


def test_summary_of_samples():
    samples = [Sample(1980, 120.0, 40, 0x0), Sample(1800, 690.0, 55, 0x4), Sample(1900, 650.0, 58, 0x4 | 0x20),
               Sample(1980, 300.0, 50, 0x1)]
    info = summarize(samples)
    assert info["gpu_samples"] == 4
    assert info["gpu_sm_clock_mhz_median"] == 1940 and info["gpu_sm_clock_mhz_min"] == 1800
    assert info["gpu_power_w_max"] == 690.0 and info["gpu_power_w_median"] == 475.0
    assert info["gpu_temperature_c_start"] == 40 and info["gpu_temperature_c_max"] == 58
    assert info["gpu_slowdown_fraction"] == 0.5  # idle (0x1) is not a slowdown
    assert info["gpu_slowdown_reasons"] == ["sw_power_cap", "sw_thermal"]
    assert summarize([]) == {}


def test_without_nvml_nothing_is_sampled_or_waited_for():
    with Telemetry("cpu") as telemetry:
        pass
    assert not telemetry.available and telemetry.summary() == {}
    assert cool_down("cpu", 40, 10) is None and gpu_telemetry.temperature_c("cpu") is None


def test_telemetry_samples_at_entry_exit_and_in_between(monkeypatch):
    fake = FakeNvml([45])
    monkeypatch.setattr(gpu_telemetry, "_nvml_handle", lambda device: (fake, "handle"))
    with Telemetry("cuda", interval_s=0.001) as telemetry:
        time.sleep(0.05)
    info = telemetry.summary()
    assert info["gpu_samples"] >= 3  # entry, exit, and the thread's
    assert info["gpu_slowdown_reasons"] == ["sw_power_cap"] and info["gpu_slowdown_fraction"] == 1.0
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        Telemetry("cpu", interval_s=0)


def test_cool_down_waits_until_the_target_or_the_limit(monkeypatch):
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    monkeypatch.setattr(gpu_telemetry, "_nvml_handle", lambda device: (fake, "handle"))
    fake = FakeNvml([60, 55, 50, 44, 41])
    done = cool_down("cuda", 45, 30, poll_s=1.0, sleep=sleep, clock=lambda: now[0])
    assert done == {"cooldown_s": 3.0, "cooldown_temperature_c": 44, "cooldown_reached": True}
    now[0] = 0.0
    fake = FakeNvml([70])  # never cools: gives up after max_wait_s
    done = cool_down("cuda", 45, 5, poll_s=1.0, sleep=sleep, clock=lambda: now[0])
    assert done == {"cooldown_s": 5.0, "cooldown_temperature_c": 70, "cooldown_reached": False}
    with pytest.raises(ValueError, match="max_wait_s must be >= 0, got -1"):
        cool_down("cuda", 45, -1)


def test_the_monitor_sees_the_measured_rounds_only():
    calls = []

    class Monitor:
        def __enter__(self):
            calls.append(("enter", len(steps)))

        def __exit__(self, *exc):
            calls.append(("exit", len(steps)))

    steps = []
    result = measure(lambda: (lambda: steps.append(1)), warmup=3, rounds=4, device=torch.device("cpu"),
                     monitor=Monitor())
    assert result.ok and calls == [("enter", 3), ("exit", 7)]


class FailingNvml(FakeNvml):
    """A device whose power reading fails after ``ok`` successful readings (an unsupported or lost GPU)."""

    class NVMLError(Exception):
        pass

    def __init__(self, ok):
        super().__init__([50])
        self.ok = ok

    def nvmlDeviceGetPowerUsage(self, handle):
        if self.ok <= 0:
            raise self.NVMLError("Not Supported")
        self.ok -= 1
        return self.power_mw


@pytest.mark.parametrize("ok", [0, 2])
def test_an_nvml_error_stops_sampling_but_never_fails_the_measurement(monkeypatch, ok):
    fake = FailingNvml(ok)
    monkeypatch.setattr(gpu_telemetry, "_nvml_handle", lambda device: (fake, "handle"))
    with Telemetry("cuda", interval_s=0.001) as telemetry:
        time.sleep(0.05)
    info = telemetry.summary()
    assert info["gpu_telemetry_error"] == "NVMLError: Not Supported"
    assert info.get("gpu_samples", 0) == ok  # the readings before the error are kept
    done = cool_down("cuda", 45, 30, sleep=lambda s: None, clock=lambda: 0.0)
    assert done["cooldown_error"] == "NVMLError: Not Supported" and done["cooldown_reached"] is False
