"""GPU clocks, power and temperature while a benchmark's rounds run, and a cool-down between cases.

An H100 running a large training step draws up to its 700 W limit; the driver then lowers the SM clock
(clock event reason "SW power cap") by up to ~10%, and how far depends on the card, its temperature and
the host.  A case measured right after a heavy one starts hotter, leaks more power and is capped
sooner, so two cases of one run can differ by several percent for reasons that are not in the code.
Two tools make that visible and fair:

* `Telemetry`: a context manager that samples the device through NVML (``pynvml``, from the
  ``nvidia-ml-py`` package; optional) on a background thread every ``interval_s`` while the measured
  rounds run, and summarizes the SM clock (median and minimum, MHz), the power (median and maximum, W),
  the temperature (start and maximum, deg C) and the share of samples with a clock-lowering event
  reason (power cap, thermal or hardware slowdown).  The sampling thread only reads NVML counters; it
  issues no CUDA work.
* `cool_down`: waits (at most ``max_wait_s``) until the device's temperature is back at or below a
  target, so every case starts from the same thermal state.

Without NVML (CPU runs, no ``pynvml``) both do nothing and say so: `Telemetry.summary()` returns {} and
`cool_down` returns None.  An NVML error while sampling (a reading the device does not support, a lost
GPU) never fails the measurement: sampling stops, the samples so far are kept, and the summary names the
error (``gpu_telemetry_error``); `cool_down` stops waiting and says so the same way.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch

# nvmlClocksEventReason bits that lower the clock (idle, application-clock settings and the display are
# not slowdowns): SW power cap, HW slowdown, SW thermal, HW thermal, HW power brake.
SLOWDOWN_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}


_handles: dict[int, tuple] = {}  # CUDA device index -> (pynvml, handle): NVML is initialized once a process


def _nvml_handle(device: torch.device | str | None):
    """(pynvml module, device handle) for a CUDA device, or None without CUDA or NVML."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _handles:
        return _handles[index]
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        nvml_index = index
        try:  # CUDA_VISIBLE_DEVICES may reorder devices; torch knows NVML's index for this one
            nvml_index = torch.cuda._get_nvml_device_index(index)
        except Exception:  # noqa: BLE001 - a private helper; the CUDA index is right without remapping
            pass
        _handles[index] = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(nvml_index))
    except pynvml.NVMLError:
        return None
    return _handles[index]


def _nvml_error(nvml) -> type[BaseException]:
    """The exception class NVML readings raise (pynvml.NVMLError; Exception for stand-ins without one)."""
    return getattr(nvml, "NVMLError", Exception)


@dataclass(frozen=True)
class Sample:
    sm_clock_mhz: int
    power_w: float
    temperature_c: int
    reasons: int


def read_sample(nvml, handle) -> Sample:
    """One reading of the device's SM clock, power, temperature and clock event reasons."""
    reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return Sample(
        sm_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
        power_w=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        temperature_c=nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        reasons=int(reasons_fn(handle)),
    )


def summarize(samples: list[Sample]) -> dict:
    """The extra_info fields of a list of samples ({} for none)."""
    if not samples:
        return {}
    clocks = [s.sm_clock_mhz for s in samples]
    powers = [s.power_w for s in samples]
    slowed = [s for s in samples if s.reasons & sum(SLOWDOWN_REASONS)]
    seen = sorted({name for s in slowed for bit, name in SLOWDOWN_REASONS.items() if s.reasons & bit})
    return {
        "gpu_samples": len(samples),
        "gpu_sm_clock_mhz_median": statistics.median(clocks),
        "gpu_sm_clock_mhz_min": min(clocks),
        "gpu_power_w_median": round(statistics.median(powers), 1),
        "gpu_power_w_max": round(max(powers), 1),
        "gpu_temperature_c_start": samples[0].temperature_c,
        "gpu_temperature_c_max": max(s.temperature_c for s in samples),
        "gpu_slowdown_fraction": round(len(slowed) / len(samples), 3),
        "gpu_slowdown_reasons": seen,
    }


class Telemetry:
    """``with Telemetry(device) as t: ...`` samples the device every ``interval_s`` seconds (and once at
    entry and exit) on a daemon thread; ``t.summary()`` gives `summarize`'s dict, {} without NVML."""

    def __init__(self, device: torch.device | str | None, interval_s: float = 0.05) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._nvml = _nvml_handle(device)
        self._samples: list[Sample] = []
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _sample(self) -> bool:
        """Append one reading; on an NVML error record it and return False (sampling stops)."""
        if self._error is not None:
            return False
        try:
            self._samples.append(read_sample(*self._nvml))
        except _nvml_error(self._nvml[0]) as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and self._sample():
            pass

    def __enter__(self) -> Telemetry:
        if self._nvml is not None and self._sample():
            self._thread = threading.Thread(target=self._loop, name="gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10 * self.interval_s + 5.0)  # a reading stuck in the driver must not hang
            self._sample()

    def summary(self) -> dict:
        info = summarize(self._samples)
        if self._error is not None:
            info["gpu_telemetry_error"] = self._error
        return info


def temperature_c(device: torch.device | str | None) -> int | None:
    """The device's temperature now (deg C), or None without NVML."""
    nvml = _nvml_handle(device)
    if nvml is None:
        return None
    try:
        return read_sample(*nvml).temperature_c
    except _nvml_error(nvml[0]):
        return None


def cool_down(device: torch.device | str | None, target_c: float, max_wait_s: float,
              poll_s: float = 0.5, sleep=time.sleep, clock=time.monotonic) -> dict | None:
    """Wait until the device is at or below ``target_c`` deg C, at most ``max_wait_s`` seconds.

    Returns {"cooldown_s": waited, "cooldown_temperature_c": temperature when done, "cooldown_reached":
    bool} (plus "cooldown_error" if an NVML reading failed, which ends the wait), or None without NVML.
    ``sleep`` and ``clock`` are injectable for tests.
    """
    if max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
    nvml = _nvml_handle(device)
    if nvml is None:
        return None
    start = clock()
    temp, error = None, None
    try:
        temp = read_sample(*nvml).temperature_c
        while temp > target_c and clock() - start < max_wait_s:
            sleep(poll_s)
            temp = read_sample(*nvml).temperature_c
    except _nvml_error(nvml[0]) as exc:
        error = f"{type(exc).__name__}: {exc}"
    done = {"cooldown_s": round(clock() - start, 2), "cooldown_temperature_c": temp,
            "cooldown_reached": temp is not None and temp <= target_c}
    if error is not None:
        done["cooldown_error"] = error
    return done
