"""The statistical gate (cs336_systems.reporting.significance, --perf-gate): verdicts from per-round samples
against known truths, its false-alarm rate on same-distribution runs, its settings in benchmarks.json, the
baseline keeping samples, and the pytest option end to end."""

import json
from pathlib import Path

import numpy as np
import pytest

from cs336_systems.bench import matrix
from cs336_systems.bench.matrix import GateSettings, MatrixError
from cs336_systems.reporting import baseline, significance
from cs336_systems.reporting.run_files import RunFileError, check_stats

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = GateSettings(min_effect=0.05, alpha=0.002)


def rounds(median: float, n: int, spread: float, seed: int) -> np.ndarray:
    """Per-round times: ``median`` times lognormal noise of relative spread ``spread``."""
    return median * np.exp(np.random.default_rng(seed).normal(0.0, spread, n))


@pytest.mark.parametrize("shift, verdict", [(1.20, "regressed"), (0.80, "improved"), (1.00, "unchanged"),
                                            (1.02, "unchanged"), (0.98, "unchanged")])
def test_verdicts_on_stable_rounds(shift, verdict):
    """1% noise, 50 rounds a side: a 20% change is decided, a 2% change is inside the 5% minimum effect."""
    result = significance.decide(rounds(1e-3, 50, 0.01, 1), rounds(1e-3 * shift, 50, 0.01, 2), DEFAULT, "c", "g")
    assert result.verdict == verdict, result
    assert result.low <= result.ratio <= result.high and abs(result.ratio - shift) < 0.02
    assert (result.n_old, result.n_new, result.case, result.group) == (50, 50, "c", "g")


def test_a_significant_change_below_the_minimum_effect_is_not_a_regression():
    """3% slower, with p far below alpha: real, but under the group's 5% minimum effect."""
    result = significance.decide(rounds(1e-3, 200, 0.002, 3), rounds(1.03e-3, 200, 0.002, 4), DEFAULT)
    assert result.p_slower < 1e-6 and result.verdict == "unchanged", result
    assert significance.decide(rounds(1e-3, 200, 0.002, 3), rounds(1.03e-3, 200, 0.002, 4),
                               GateSettings(min_effect=0.02)).verdict == "regressed"


def test_an_absolute_floor_holds_microsecond_calls_to_a_fixed_change():
    """A 12 us call 25% slower (3 us): a regression at 5% alone, unchanged under a 4 us floor; a 2 ms call
    10% slower is still one (its 200 us are far above the floor)."""
    floored = GateSettings(min_effect=0.05, alpha=0.002, min_abs_effect_s=4e-6)
    short_old, short_new = rounds(12e-6, 50, 0.01, 7), rounds(15e-6, 50, 0.01, 8)
    assert significance.decide(short_old, short_new, DEFAULT).verdict == "regressed"
    assert significance.decide(short_old, short_new, floored).verdict == "unchanged"
    assert significance.decide(short_old, rounds(18e-6, 50, 0.01, 8), floored).verdict == "regressed"  # 6 us
    assert significance.decide(rounds(2e-3, 50, 0.01, 9), rounds(2.2e-3, 50, 0.01, 10), floored).verdict == "regressed"
    assert floored.threshold(12e-6) == pytest.approx(4 / 12) and floored.threshold(2e-3) == 0.05
    assert floored.label() == "5% + 4 us, 0.002" and DEFAULT.label() == "5%, 0.002"


def test_noisy_or_short_runs_are_inconclusive_not_a_pass_or_a_fail():
    noisy = significance.decide(rounds(1e-3, 10, 0.30, 5), rounds(1.08e-3, 10, 0.30, 6), DEFAULT)
    assert noisy.verdict == "inconclusive" and noisy.high - noisy.low > 0.1, noisy
    short = significance.decide([1.0] * 5, [2.0] * 5, DEFAULT)
    assert short.verdict == "inconclusive" and "rounds" in short.note
    assert significance.failures([noisy, short]) == [] and significance.failures([noisy, short], strict=True) == [
        noisy, short]


def test_no_false_alarm_in_many_same_distribution_comparisons():
    """A/A: 300 comparisons of runs drawn from one distribution (3% noise, 20 rounds, heavy tail) declare no
    regression and no improvement."""
    verdicts = []
    for i in range(300):
        old, new = rounds(1e-3, 20, 0.03, 2 * i), rounds(1e-3, 20, 0.03, 2 * i + 1)
        new[::7] *= 1.5  # host hiccups in some rounds
        verdicts.append(significance.decide(old, new, DEFAULT).verdict)
    assert verdicts.count("regressed") == 0 and verdicts.count("improved") == 0


def test_constant_rounds_need_no_bootstrap():
    result = significance.decide([2.0] * 8, [2.0] * 8, DEFAULT)
    assert result.verdict == "unchanged" and result.low == result.high == 1.0
    assert significance.decide([2.0] * 8, [3.0] * 8, DEFAULT).verdict == "regressed"


@pytest.mark.parametrize("bad", [[1.0, float("nan")] * 4, [1.0, -1.0] * 4, [[1.0]] * 8])
def test_bad_rounds_are_refused(bad):
    with pytest.raises(ValueError, match="rounds"):
        significance.decide(bad, [1.0] * 8, DEFAULT)


def test_compare_pairs_cases_by_name_and_uses_each_groups_settings():
    old = {"a": rounds(1e-3, 30, 0.01, 1), "b": rounds(1e-3, 30, 0.01, 2), "gone": [1.0] * 8}
    new = {"a": rounds(1.08e-3, 30, 0.01, 3), "b": rounds(1.08e-3, 30, 0.01, 4), "new": [1.0] * 8}
    settings = {"kernels": GateSettings(min_effect=0.05), "e2e": GateSettings(min_effect=0.10)}
    verdicts = significance.compare(old, new, {"a": {"group": "kernels"}, "b": {"group": "e2e"}},
                                    lambda group, fields: settings[group])
    # 8% slower: past the kernels' 5% minimum effect, inside the end-to-end group's 10%
    assert [(v.case, v.verdict) for v in verdicts] == [("a", "regressed"), ("b", "unchanged")]
    table = significance.table(verdicts)
    assert table.index("| a | **regressed**") < table.index("| b | unchanged") and "10%, 0.002" in table
    assert significance.summary(verdicts) == ("2 case(s) compared: 1 regressed, 0 improved, 1 unchanged, "
                                              "0 inconclusive")


@pytest.mark.parametrize("kwargs, match", [({"min_effect": 0}, "min_effect"), ({"min_effect": 1.5}, "min_effect"),
                                           ({"alpha": 0.7}, "alpha"), ({"alpha": "0.01"}, "alpha"),
                                           ({"min_abs_effect_s": -1e-6}, "min_abs_effect_s"),
                                           ({"min_abs_effect_s": 2.0}, "min_abs_effect_s")])
def test_gate_settings_name_the_bad_value(kwargs, match):
    with pytest.raises(MatrixError, match=match):
        GateSettings(**kwargs)


def _with_regression(block: dict) -> dict:
    data = matrix.loads((ROOT / "benchmarks.json").read_text())
    data["regression"] = block
    return data


def test_case_overrides_apply_to_the_cases_they_match_first_match_winning():
    parsed = matrix.parse(_with_regression({
        "groups": {"leaderboard": {"min_effect": 0.03}},
        "cases": [{"group": "leaderboard", "match": {"mode": "forward", "head_dim": 128}, "min_effect": 0.2},
                  {"group": "leaderboard", "match": {"mode": "forward"}, "min_abs_effect_s": 1e-5}]}))
    assert parsed.gate_settings("leaderboard", {"mode": "forward", "head_dim": 128}) == GateSettings(0.2, 0.002)
    # the second entry, on top of its group's settings
    assert parsed.gate_settings("leaderboard", {"mode": "forward", "head_dim": 64}) == GateSettings(0.03, 0.002, 1e-5)
    assert parsed.gate_settings("leaderboard", {"mode": "backward"}) == GateSettings(0.03, 0.002)
    assert parsed.gate_settings("leaderboard") == GateSettings(0.03, 0.002)  # no fields: the group's
    old, new = {"f": rounds(1e-3, 30, 0.01, 1), "b": rounds(1e-3, 30, 0.01, 2)}, {
        "f": rounds(1.1e-3, 30, 0.01, 3), "b": rounds(1.1e-3, 30, 0.01, 4)}
    verdicts = significance.compare(old, new, {"f": {"group": "leaderboard", "mode": "forward", "head_dim": 128},
                                               "b": {"group": "leaderboard", "mode": "backward"}},
                                    parsed.gate_settings)
    assert [(v.case, v.verdict) for v in verdicts] == [("f", "unchanged"), ("b", "regressed")]
    assert loaded_default_forward_override() == GateSettings(0.10, 0.002)
    for bad, match in (({"group": "leaderbord", "match": {"mode": "forward"}}, r"cases\[0\].group: no grid"),
                       ({"group": "leaderboard", "match": {}}, r"cases\[0\].match: expected a non-empty"),
                       ({"group": "leaderboard"}, r"cases\[0\]: expected an object"),
                       ({"group": "leaderboard", "match": {"mode": "forward"}, "min_efect": 0.1}, "unknown")):
        with pytest.raises(MatrixError, match=match):
            matrix.parse(_with_regression({"cases": [bad]}))


def loaded_default_forward_override() -> GateSettings:
    """The committed benchmarks.json: the leaderboard's forwards at 10% (docs/regression-gating.md)."""
    return matrix.load().gate_settings("leaderboard", {"mode": "forward"})


def test_benchmarks_json_sets_the_gate_per_group_and_refuses_unknown_groups():
    loaded = matrix.load()
    assert loaded.gate_settings("leaderboard") == GateSettings(0.05, 0.002)
    assert loaded.gate_settings("e2e-hf").min_effect == 0.10 and loaded.gate_settings("e2e-hf").alpha == 0.002
    assert loaded.gate_settings("not-a-group") == loaded.regression_default
    parsed = matrix.parse(_with_regression({"default": {"alpha": 0.01}, "groups": {"leaderboard": {"min_effect": 0.03}}}))
    assert parsed.gate_settings("leaderboard") == GateSettings(0.03, 0.01)
    floored = matrix.parse(_with_regression({"groups": {"leaderboard": {"min_abs_effect_s": 4e-6}}}))
    assert floored.gate_settings("leaderboard") == GateSettings(0.05, 0.002, 4e-6)
    with pytest.raises(MatrixError, match="regression.groups.leaderbord: no grid has group"):
        matrix.parse(_with_regression({"groups": {"leaderbord": {"min_effect": 0.03}}}))
    with pytest.raises(MatrixError, match=r"regression.groups.leaderboard: min_effect must be"):
        matrix.parse(_with_regression({"groups": {"leaderboard": {"min_effect": 5}}}))
    with pytest.raises(MatrixError, match="unknown"):
        matrix.parse(_with_regression({"default": {"min_efect": 0.05}}))


def _run_with_samples(samples: list[float] | None) -> dict:
    stats = {"median": float(np.median(samples)) if samples else 1.0}
    if samples is not None:
        stats["data"] = samples
    return {"machine_info": {"system": "Linux", "python_implementation": "CPython", "python_version": "3.12.3",
                             "machine": "x86_64", "cs336_systems": {"gpu_name": "H100", "gpu_count": 1}},
            "commit_info": {"id": "15751cf0123456789abcdef0123456789abcdef0", "dirty": False},
            "benchmarks": [{"fullname": "case", "stats": stats, "extra_info": {"group": "leaderboard"}}]}


def test_a_baseline_keeps_each_cases_samples_to_four_digits(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_with_samples([0.0012345678, 0.0012349999, 0.00123])))
    merged = json.loads(baseline.write_baseline([run], tmp_path / "store").read_text())
    assert merged["benchmarks"][0]["stats"]["data"] == [0.001235, 0.001235, 0.00123]
    run.write_text(json.dumps(_run_with_samples(None)))  # a run saved without its samples stays without
    merged = json.loads(baseline.write_baseline([run], tmp_path / "store2").read_text())
    assert "data" not in merged["benchmarks"][0]["stats"]


@pytest.mark.parametrize("data", [[1.0, float("nan")], [1.0, -2.0], "1.0", [True]])
def test_corrupt_samples_are_refused_naming_the_case(data):
    with pytest.raises(RunFileError, match="run.json: case c: stats.data"):
        check_stats("run.json", "c", {"median": 1.0, "data": data})


# --- the pytest option, end to end ------------------------------------------------------------------------

SLEEPY = '''
import os
import time


def test_sleep(benchmark):
    benchmark.pedantic(time.sleep, args=(float(os.environ["DELAY_S"]),), rounds=12, iterations=1, warmup_rounds=1)
'''


@pytest.fixture
def sleepy(pytester, perf_session, monkeypatch, tmp_path):
    """A project with the real top-level conftest and a baseline (with samples) of a 20 ms sleep; ``run(delay,
    *args)`` compares a run at ``delay`` seconds against it."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_sleepy=SLEEPY)
    monkeypatch.setenv("DELAY_S", "0.02")
    perf_session("-p", "no:cacheprovider", "--benchmark-json=base.json").assert_outcomes(passed=1)
    store = tmp_path / "store"
    baseline.write_baseline([pytester.path / "base.json"], store)

    def run(delay: float, *args):
        monkeypatch.setenv("DELAY_S", str(delay))
        return perf_session("-p", "no:cacheprovider", f"--benchmark-storage=file://{store}",
                            "--benchmark-compare=0001", *args)

    return run


def test_perf_gate_passes_the_same_code_and_fails_a_slowdown_with_its_table(sleepy, monkeypatch, tmp_path):
    summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    same = sleepy(0.02, "--perf-gate")
    output = same.stdout.str()
    assert same.ret == 0 and "--perf-gate: passed" in output and "0 regressed" in output, output[-3000:]
    slower = sleepy(0.04, "--perf-gate")
    output = slower.stdout.str()
    assert slower.ret != 0 and "--perf-gate: FAILED" in output and "**regressed**" in output, output[-3000:]
    written = summary.read_text()
    assert written.count("### --perf-gate") == 2 and "| test_sleepy.py::test_sleep | **regressed**" in written


def test_perf_gate_refuses_a_baseline_without_samples_and_a_run_without_compare(sleepy, pytester, tmp_path):
    stored = next((tmp_path / "store").rglob("0001_baseline.json"))
    data = json.loads(stored.read_text())
    for record in data["benchmarks"]:
        del record["stats"]["data"]
    stored.write_text(json.dumps(data))
    result = sleepy(0.02, "--perf-gate")
    assert result.ret != 0 and "kept no per-round samples for 1 case(s)" in result.stdout.str()
    usage = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--perf-gate")
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    assert "--perf-gate compares against a saved run: give --benchmark-compare" in usage.stderr.str()


def test_report_compare_adds_the_verdicts_where_both_runs_kept_samples(tmp_path):
    from cs336_systems.reporting import compare

    def saved(name, samples_by_case):
        run = _run_with_samples(None)
        run["benchmarks"] = [{"fullname": case, "name": case, "extra_info": {"group": "e2e-hf"},
                              "stats": {"median": float(np.median(data)), **({"data": list(data)} if keep else {})}}
                             for case, (data, keep) in samples_by_case.items()]
        path = tmp_path / name
        path.write_text(json.dumps(run))
        return path

    old = saved("old.json", {"slow": (rounds(1.0, 20, 0.01, 1), True), "plain": (rounds(1.0, 20, 0.01, 2), False)})
    new = saved("new.json", {"slow": (rounds(1.3, 20, 0.01, 3), True), "plain": (rounds(1.0, 20, 0.01, 4), True)})
    text = compare.compare_runs(old, new)
    assert "## Statistical verdicts" in text and "1 case(s) compared: 1 regressed" in text
    assert "| slow | **regressed** |" in text and "10%, 0.002" in text  # e2e-hf's minimum effect
    assert "| plain | **" not in text.split("## Statistical verdicts")[1]  # the old run kept no samples of it
