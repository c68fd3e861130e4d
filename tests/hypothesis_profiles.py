"""Hypothesis example counts by profile, for the property tests under tests/.

A property test whose examples are costly (the attention kernels against float64: up to a second per example in
Triton's interpreter or under torch.compile) names the number of examples a thorough run draws, through
`max_examples`, and the profile in force scales it:

    @settings(max_examples=max_examples(25), deadline=None)

  dev        the default: 30% of each named count, rounded up, but never fewer than 2 (or than the count,
             when it is 1), and 30 for a test that names no count
  thorough   every count as named, and Hypothesis's own 100 for a test that names none: what CI runs
             (`.ci/run`)

Select one with ``HYPOTHESIS_PROFILE=thorough`` (tests/conftest.py imports this module, which registers
both and loads that one before any test module is collected), or with Hypothesis's own
``--hypothesis-profile=thorough``.  The scale is read from the loaded profile's max_examples (over
Hypothesis's default of 100), so both ways agree.  Explicit ``@example`` cases run under every profile.  The
variable is the test suite's, not one of the package's CS336_ switches (cs336_systems/switches.py): it takes the
name Hypothesis's documentation gives it.

Cheap property tests keep fixed counts (their full count costs well under a second), and so do GPU tests: they
run only where a GPU is, and the GPU workflow runs the default profile.
"""

from __future__ import annotations

import math
import os

from hypothesis import settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
THOROUGH = 100  # Hypothesis's default max_examples: the scale at which counts are used as named
PROFILES = {"dev": 30, "thorough": THOROUGH}
FEWEST = 2  # a scaled count still draws more than one example (the named count permitting)

for _name, _count in PROFILES.items():
    settings.register_profile(_name, max_examples=_count)


def load_from_environment() -> str:
    """Load the profile ``HYPOTHESIS_PROFILE`` names (unset or empty: dev); ValueError for another name."""
    name = os.environ.get(PROFILE_ENV) or "dev"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV} must be one of {', '.join(PROFILES)} (or unset), got {name!r}")
    settings.load_profile(name)
    return name


def max_examples(thorough: int, profile: settings | None = None) -> int:
    """The number of examples to draw, under ``profile`` (default: the loaded one), for a test that draws
    ``thorough`` in a thorough run."""
    if thorough < 1:
        raise ValueError(f"max_examples: thorough must be >= 1, got {thorough}")
    scaled = math.ceil(thorough * (profile or settings.default).max_examples / THOROUGH)
    return max(scaled, min(thorough, FEWEST))
