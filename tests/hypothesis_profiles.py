"""Hypothesis example counts by profile, for the property tests under tests/.

A property test that runs without a GPU names the number of examples a thorough run draws, through
`max_examples`, and the profile in force scales it:

    @settings(max_examples=max_examples(25), deadline=None)

  dev        the default: 40% of each named count, rounded up, but never fewer than 2 (or than the count,
             when it is 1), and 40 for a test that names no count
  thorough   every count as named, and Hypothesis's own 100 for a test that names none: what CI runs
             (`.ci/run`)

Select one with ``CS336_HYPOTHESIS_PROFILE=thorough`` (tests/conftest.py imports this module, which registers
both and loads that one before any test module is collected), or with Hypothesis's own
``--hypothesis-profile=thorough``.  The scale is read from the loaded profile's max_examples (over
Hypothesis's default of 100), so both ways agree.  Explicit ``@example`` cases run under every profile.

GPU tests keep fixed counts: they run only where a GPU is, and the GPU workflow runs the default profile.
"""

from __future__ import annotations

import math
import os

from hypothesis import settings

PROFILE_ENV = "CS336_HYPOTHESIS_PROFILE"
THOROUGH = 100  # Hypothesis's default max_examples: the scale at which counts are used as named
PROFILES = {"dev": 40, "thorough": THOROUGH}
FEWEST = 2  # a scaled count still draws more than one example (the named count permitting)

for _name, _count in PROFILES.items():
    settings.register_profile(_name, max_examples=_count)


def load_from_environment() -> str:
    """Load the profile ``CS336_HYPOTHESIS_PROFILE`` names (unset or empty: dev); ValueError for another name."""
    name = os.environ.get(PROFILE_ENV) or "dev"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV} must be one of {', '.join(PROFILES)} (or unset), got {name!r}")
    settings.load_profile(name)
    return name


def max_examples(thorough: int) -> int:
    """The number of examples to draw for a test that draws ``thorough`` in a thorough run."""
    if thorough < 1:
        raise ValueError(f"max_examples: thorough must be >= 1, got {thorough}")
    scaled = math.ceil(thorough * settings.default.max_examples / THOROUGH)
    return max(scaled, min(thorough, FEWEST))
