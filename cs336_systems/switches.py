"""The library's environment switches, declared once: name, allowed values, default and meaning.

Every ``CS336_*`` variable the project reads is a `Switch` in `REGISTRY`, and the library reads them only
through `read` (which validates the value and names the switch in its error).  The switches are for
debugging and A/B runs: callers that choose a kernel pass `cs336_systems.attention.plan.FlashOptions`
explicitly, and a switch set in the environment overrides those options.

    read("CS336_FLASH_TMA")         -> "" (unset: the default behaviour), "0" or "1"
    active()                        -> {name: value} of the registered switches that are set (saved runs)
    warn_unknown()                  -> warns once for a CS336_FLASH_* variable that is not registered
    markdown_table()                -> the docs' table (docs/flash-attention.md is checked against it)

`TRITON_INTERPRET` is Triton's own variable, read through `interpreter_active`; it is not registered here.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass

PREFIX = "CS336_"
FLASH_PREFIX = "CS336_FLASH_"


@dataclass(frozen=True)
class Switch:
    """One environment switch.  ``values``: the accepted non-empty values, or None for a free-form value
    that ``pattern`` (a regular expression, matched whole) checks; "" (unset) always means ``default``."""

    name: str
    values: tuple[str, ...] | None
    default: str
    meaning: str
    pattern: str | None = None
    affects_kernels: bool = False  # part of a recorded flash-triton call's signature (its replays)

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"switch name must start with {PREFIX!r}, got {self.name!r}")
        if (self.values is None) == (self.pattern is None):
            raise ValueError(f"switch {self.name}: give exactly one of values and pattern")

    def check(self, value: str) -> str:
        """``value`` if this switch accepts it, else a ValueError naming the switch and what it takes."""
        if value == "":
            return value
        if self.values is not None:
            if value not in self.values:
                raise ValueError(f"{self.name} must be one of {', '.join(self.values)} (or unset), got {value!r}")
        elif not re.fullmatch(self.pattern, value):
            raise ValueError(f"{self.name} must be {self.allowed()} (or unset), got {value!r}")
        return value

    def allowed(self) -> str:
        if self.values is not None:
            return " / ".join(self.values)
        return {r"[1-9][0-9]*": "a positive integer", r".+": "a path",
                r"[0-9]+(\.[0-9]+)?": "a number of seconds", r"0|1|0?\.[0-9]+": "a fraction from 0 to 1"}.get(self.pattern, self.pattern)


REGISTRY: dict[str, Switch] = {s.name: s for s in (
    Switch("CS336_FLASH_HOPPER_FWD", ("0", "1"), "the plan's rule",
           "Gluon (Hopper) forward: 0 never, 1 wherever the inputs allow; unset: the plan's size rules.",
           affects_kernels=True),
    Switch("CS336_FLASH_HOPPER_BWD", ("0", "1"), "the plan's rule",
           "every Gluon backward kernel (dQ, dK/dV, the fused pass): 0 never, 1 dQ and dK/dV wherever the inputs "
           "allow; unset: the plan's size rules.", affects_kernels=True),
    Switch("CS336_FLASH_FUSED_BWD", ("0", "1"), "the plan's rule",
           "the fused Gluon backward (one pass for dQ, dK, dV): 0 never, 1 wherever the inputs allow; unset: the "
           "plan's size rules.", affects_kernels=True),
    Switch("CS336_FLASH_TMA", ("0", "1"), "1",
           "0: no TMA descriptors anywhere (pointer loads; the Gluon kernels are off too); 1 or unset: descriptors "
           "where the tile configuration asks for them.", affects_kernels=True),
    Switch("CS336_FLASH_SPLITS", None, "the launcher's rule",
           "portable forward: split each row's keys across this many programs (1: never split).",
           pattern=r"[1-9][0-9]*", affects_kernels=True),
    Switch("CS336_FLASH_GROUP_SPLITS", None, "the launcher's rule",
           "dK/dV with grouped K/V heads (the portable kernel and the fused Gluon backward): split each group's "
           "query heads across this many programs (a divisor of the group).", pattern=r"[1-9][0-9]*", affects_kernels=True),
    Switch("CS336_FLASH_SPLIT_D", ("0", "1"), "split forward tiles where measured faster",
           "head dims that are not a power of two: 0 one padded tile everywhere, 1 split tiles in every kernel "
           "(experimental: faults under load on Hopper with Triton 3.6).", affects_kernels=True),
    Switch("CS336_FLASH_FP32_DOT", ("tf32x3", "ieee"), "tf32x3",
           "float32 inputs: tf32x3 (three TF32 products per fp32 product) or ieee (FMA dots).",
           affects_kernels=True),
    Switch("CS336_FLASH_AUTOTUNE", ("0", "1"), "0",
           "1: an eager call on CUDA tensors tunes its shape's tile configurations once and caches them.",
           affects_kernels=True),
    Switch("CS336_FLASH_CACHE", None, "~/.cache/cs336_systems/flash-autotune.json",
           "the autotune cache file (a regular file, or a link to one).", pattern=r".+", affects_kernels=True),
    Switch("CS336_FLASH_REPLAY", ("0", "1"), "1",
           "0: every eager call launches the ordinary way (no recorded launches replayed).",
           affects_kernels=True),
    Switch("CS336_PERF_SLOWDOWN", None, "0",
           "calibration only: a synthetic regression of this fraction (0 to 1) of each timed case's step time: every "
           "round also keeps the GPU busy that long (bench.harness.synthetic_slowdown).", pattern=r"0|1|0?\.[0-9]+"),
    Switch("CS336_DIST_TIMEOUT_S", None, "600",
           "distributed perf cases: the bound on every collective, in seconds.", pattern=r"[0-9]+(\.[0-9]+)?"),
    Switch("CS336_GPU_PYTHON", None, "python3",
           "GPU workflow only (.github/workflows/perf-gpu.yml): the interpreter with CUDA torch.", pattern=r".+"),
)}

# The switches a recorded flash-triton call's replay key holds (their raw values), in a fixed order.
KERNEL_SWITCHES: tuple[str, ...] = tuple(name for name, s in REGISTRY.items() if s.affects_kernels)


def read(name: str) -> str:
    """The value of the registered switch ``name`` ("" where unset), validated (ValueError naming it)."""
    try:
        switch = REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered switch (cs336_systems.switches.REGISTRY)") from None
    return switch.check(os.environ.get(name, ""))


def active(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``CS336_*`` variables that are set (non-empty), sorted by name: what a saved run records.
    Unregistered ``CS336_*`` names are kept too (marked by `unknown`), so a typo is visible in the record."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in sorted(env.items()) if name.startswith(PREFIX) and value}


def unknown(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """Each set ``CS336_FLASH_*`` variable that is not registered -> the closest registered name."""
    env = os.environ if environ is None else environ
    names = list(REGISTRY)
    return {name: (difflib.get_close_matches(name, names, n=1, cutoff=0.0) or [None])[0]
            for name in sorted(env) if name.startswith(FLASH_PREFIX) and name not in REGISTRY}


_warned: set[str] = set()


def warn_unknown(environ: dict[str, str] | None = None) -> None:
    """A UserWarning (once per name) for each unregistered ``CS336_FLASH_*`` variable, naming the closest
    registered switch: a misspelt switch would otherwise be ignored in silence."""
    for name, closest in unknown(environ).items():
        if name in _warned:
            continue
        _warned.add(name)
        warnings.warn(f"{name} is set but is not a cs336_systems switch and has no effect; did you mean {closest}?",
                      stacklevel=2)


def interpreter_active() -> bool:
    """Whether Triton's interpreter is asked for (TRITON_INTERPRET=1, Triton's own variable)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def markdown_table() -> str:
    """The registry as a Markdown table (name, values, default, meaning)."""
    rows = ["| switch | values | unset means | what it does |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.allowed()} | {s.default} | {s.meaning} |" for s in REGISTRY.values()]
    return "\n".join(rows)
