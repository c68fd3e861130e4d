"""What a run of tests/ selects: tests marked slow are left out unless asked for (the root conftest), and
Hypothesis draws fewer examples under the default profile than under ``thorough`` (tests/hypothesis_profiles.py)."""

from pathlib import Path

import hypothesis_profiles
import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_long():
    pass

@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_long_cases(n):
    pass
"""


@pytest.fixture
def project(pytester, perf_session):
    """The project's root conftest (markers, --run-slow) over a module of one quick and three slow tests."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_mix=TESTS)
    return perf_session


def _ran(result) -> set[str]:
    return {line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line}


def test_slow_tests_are_left_out_by_default_and_the_summary_says_how_to_run_them(project):
    result = project("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=3)
    assert _ran(result) == {"test_quick"}
    result.stdout.fnmatch_lines(["3 tests marked slow left out: --run-slow runs them too, -m slow only them"])


@pytest.mark.parametrize("args, ran", [
    (["--run-slow"], {"test_quick", "test_long", "test_long_cases[1]", "test_long_cases[2]"}),
    (["-m", "slow"], {"test_long", "test_long_cases[1]", "test_long_cases[2]"}),
    (["-m", "not slow"], {"test_quick"}),
    (["test_mix.py::test_long_cases"], {"test_long_cases[1]", "test_long_cases[2]"}),  # named by id: always runs
    (["-k", "long and 2"], set()),  # -k keeps one slow test, which the default then leaves out
])
def test_asking_for_slow_tests_runs_them(project, args, ran):
    result = project("-v", "-p", "no:cacheprovider", *args)
    assert _ran(result) == ran
    left_out = "*marked slow left out*"
    if args == ["-k", "long and 2"]:
        result.stdout.fnmatch_lines(["1 test marked slow left out: --run-slow runs them too, -m slow only them"])
    else:
        result.stdout.no_fnmatch_line(left_out)


@pytest.mark.parametrize("thorough, dev", [(1, 1), (2, 2), (5, 2), (10, 3), (12, 4), (25, 8), (150, 45)])
def test_example_counts_scale_by_profile(thorough, dev):
    assert hypothesis_profiles.max_examples(thorough, settings.get_profile("dev")) == dev
    assert hypothesis_profiles.max_examples(thorough, settings.get_profile("thorough")) == thorough


def test_profile_variable_is_validated(monkeypatch):
    monkeypatch.setenv(hypothesis_profiles.PROFILE_ENV, "ci")
    with pytest.raises(ValueError, match=r"HYPOTHESIS_PROFILE must be one of dev, thorough \(or unset\), "
                                         r"got 'ci'"):
        hypothesis_profiles.load_from_environment()
    with pytest.raises(ValueError, match="max_examples: thorough must be >= 1, got 0"):
        hypothesis_profiles.max_examples(0)
