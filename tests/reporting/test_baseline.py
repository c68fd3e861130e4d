"""Saved-run comparison end to end, and the committed per-GPU baselines (cs336_systems.reporting.baseline).

A baseline must never make a comparison pass by comparing nothing: empty runs, runs of dirty work trees and
refreshes that lose cases are refused, and a comparison that compared nothing, or a group the baseline
does not cover, fails the session."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cs336_systems.reporting import baseline

ROOT = Path(__file__).resolve().parents[2]

SLEEPY = '''
import os
import time


def test_sleep(benchmark):
    benchmark.pedantic(time.sleep, args=(float(os.environ["DELAY_S"]),), rounds=5, iterations=1, warmup_rounds=1)
'''


@pytest.fixture
def sleepy(pytester, perf_session):
    """A project with the real top-level conftest; ``run(*args)`` runs pytest there, in this process
    (tests/conftest.py's `perf_session`)."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())  # the project's machine facts + refusal hook
    pytester.makepyfile(test_sleepy=SLEEPY)
    return SimpleNamespace(path=pytester.path, run=perf_session, makepyfile=pytester.makepyfile)


def _run(project, monkeypatch, delay_s, *args):
    monkeypatch.setenv("DELAY_S", str(delay_s))
    return project.run("-p", "no:cacheprovider", f"--benchmark-storage=file://{project.path / 'store'}", *args)


def test_compare_fail_catches_a_slowdown_and_passes_noise(sleepy, monkeypatch):
    _run(sleepy, monkeypatch, 0.02, "--benchmark-save=base").assert_outcomes(passed=1)
    compare = ("--benchmark-compare=0001", "--benchmark-compare-fail=median:25%")
    same = _run(sleepy, monkeypatch, 0.02, *compare)
    assert same.ret == 0, same.stdout.str()[-2000:]
    slower = _run(sleepy, monkeypatch, 0.06, *compare)  # 3x the median: a real regression
    assert slower.ret != 0
    assert "Performance has regressed" in slower.stdout.str() + slower.stderr.str()


def test_committed_style_baseline_is_found_by_compare(sleepy, monkeypatch, tmp_path):
    monkeypatch.setenv("DELAY_S", "0.01")
    sleepy.run("-p", "no:cacheprovider", "--benchmark-json=run.json").assert_outcomes(passed=1)
    target = baseline.write_baseline([sleepy.path / "run.json"], tmp_path / "baselines")
    from pytest_benchmark.utils import get_machine_id

    assert target.parent.name == get_machine_id() and target.name == "0001_baseline.json"
    result = sleepy.run("-p", "no:cacheprovider", f"--benchmark-storage=file://{tmp_path / 'baselines'}",
                        "--benchmark-compare=0001", "--benchmark-compare-fail=median:400%")
    assert result.ret == 0
    output = result.stdout.str() + result.stderr.str()
    assert f"Comparing against benchmarks from: {get_machine_id()}/0001_baseline.json" in output


def _run_json(gpu: str, benches: list[tuple[str, float]], group: str | None = None, dirty: bool = False) -> dict:
    return {
        "machine_info": {"system": "Linux", "python_implementation": "CPython", "python_version": "3.12.3",
                         "machine": "x86_64", "cs336_systems": {"gpu_name": gpu, "gpu_count": 1, "cuda": "13.0",
                                                                "torch": "2.11", "triton": "3.6"}},
        "commit_info": {"id": "15751cf0123456789abcdef0123456789abcdef0", "dirty": dirty}, "datetime": "2026-11-21",
        "version": "5.2.3",
        "benchmarks": [{"fullname": name, "stats": {"median": t}, "extra_info": {"group": group} if group else {}}
                       for name, t in benches],
    }


def _cli(*args) -> subprocess.CompletedProcess:
    """``python -m cs336_systems.baseline *args``, in this process (no second torch import): that module only
    exits with `baseline.main`'s status, which test_cli_lists_groups_and_reports_bad_input checks as a process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = baseline.main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return subprocess.CompletedProcess(["cs336_systems.baseline", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def _save(path, data):
    path.write_text(json.dumps(data))
    return path


def test_merge_refuses_a_case_of_two_runs_unless_later_wins_and_records_each_cases_run():
    runs = [_run_json("H100", [("a", 1.0), ("b", 2.0)]), _run_json("H100", [("b", 3.0)])]
    with pytest.raises(ValueError, match=r"1 case\(s\) appear in more than one run:\n    b \(x.json and y.json\)"):
        baseline.merge_runs(runs, ["x.json", "y.json"])
    merged = baseline.merge_runs(runs, ["x.json", "y.json"], later_wins=True)
    assert {b["fullname"]: b["stats"]["median"] for b in merged["benchmarks"]} == {"a": 1.0, "b": 3.0}
    assert merged["cs336_case_sources"] == {"a": "x.json", "b": "y.json"}
    distinct = baseline.merge_runs([_run_json("H100", [("a", 1.0)]), _run_json("H100", [("b", 3.0)])],
                                   ["x.json", "y.json"])
    assert distinct["cs336_case_sources"] == {"a": "x.json", "b": "y.json"}


@pytest.mark.parametrize("stats, match", [
    (None, "has no statistics"), ({"mean": 1.0}, "has no statistics"),
    ({"median": "1.0"}, r"stats.median is '1.0'"), ({"median": float("nan")}, "stats.median is nan"),
    ({"median": 1.0, "max": float("inf")}, "stats.max is inf"), ({"median": -1.0}, "stats.median is -1.0"),
])
def test_a_run_with_missing_or_corrupt_statistics_is_refused(stats, match):
    run = _run_json("H100", [("a", 1.0)])
    run["benchmarks"][0]["stats"] = stats
    with pytest.raises(ValueError, match=f"x.json: case a.*{match}"):
        baseline.check_run(run, "x.json")


def test_an_interrupted_run_is_refused():
    run = _run_json("H100", [("a", 1.0)])
    run["perf_not_timed"] = [{"name": "b", "reason": "not run (the session ended first)"}]
    with pytest.raises(ValueError, match=r"x.json: 1 selected case\(s\) were not timed .*: b\); re-run"):
        baseline.check_run(run, "x.json")
    run["perf_not_timed"] = [{"name": "c", "reason": "failed: AssertionError: o is off"}]
    with pytest.raises(ValueError, match=r"1 selected case\(s\) were not timed .*: c\)"):
        baseline.check_run(run, "x.json")


def test_a_case_skipped_as_unsupported_does_not_make_a_run_incomplete():
    run = _run_json("H100", [("a", 1.0)])
    run["perf_not_timed"] = [{"name": "b", "reason": "skipped: SDPA on nested tensors refuses is_causal"}]
    baseline.check_run(run, "x.json")
    run["perf_not_timed"].append({"name": "c", "reason": "not run (the session ended first)"})
    with pytest.raises(ValueError, match=r"1 selected case\(s\) were not timed .*: c\)"):
        baseline.check_run(run, "x.json")


def test_merge_keeps_each_cases_latest_outcome_timed_or_oom():
    def run(timed, ooms):
        data = _run_json("H100", timed)
        data["oom"] = [{"fullname": name, "name": name, "error": "CUDA out of memory"} for name in ooms]
        return data

    # x OOMed, then a re-run timed it; y was timed, then OOMed; z OOMed twice
    merged = baseline.merge_runs([run([("y", 2.0)], ["x", "z"]), run([("x", 1.0)], ["y", "z"])], later_wins=True)
    assert {b["fullname"]: b["stats"]["median"] for b in merged["benchmarks"]} == {"x": 1.0}
    assert sorted(o["fullname"] for o in merged["oom"]) == ["y", "z"]


def test_merge_refuses_runs_from_different_gpus():
    with pytest.raises(ValueError, match="gpu_name: 'H100' vs 'H200'"):
        baseline.merge_runs([_run_json("H100", [("a", 1.0)]), _run_json("H200", [("a", 1.0)])], ["x.json", "y.json"])


def test_storage_machine_id_matches_pytest_benchmark():
    assert baseline.storage_machine_id(_run_json("H100", [])["machine_info"]) == "Linux-CPython-3.12-64bit"


def test_committed_baselines_are_valid_and_complete():
    for gpu, must_have in (("h100", "test_leaderboard"), ("h200x2", "test_data_parallel")):
        files = list((ROOT / "results" / gpu / "baselines").glob("*/0001_baseline.json"))
        assert len(files) == 1, files
        data = json.loads(files[0].read_text())
        names = [b["fullname"] for b in data["benchmarks"]]
        assert len(names) == len(set(names)) and any(must_have in n for n in names)
        assert data["machine_info"]["cs336_systems"]["gpu_name"].startswith("NVIDIA H")


@pytest.mark.slow  # a CLI subprocess per bad input, each importing torch (~5 s)
def test_cli_lists_groups_and_reports_bad_input(tmp_path):
    groups = subprocess.run([sys.executable, "-m", "cs336_systems.baseline", "--groups", "gpu"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert "leaderboard" in groups and "ddp-bf16" in groups
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = subprocess.run([sys.executable, "-m", "cs336_systems.baseline", str(bad), "--storage", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not a readable pytest-benchmark JSON" in result.stderr


# --- what a baseline refuses ------------------------------------------------------------------------------

def test_cli_refuses_an_empty_run_and_writes_nothing(tmp_path):
    empty = _save(tmp_path / "empty.json", _run_json("H100", []))
    result = _cli(empty, "--storage", tmp_path / "store")
    assert result.returncode == 2, result.stdout
    assert f"{empty}: no benchmarks; a baseline made from it would make later comparisons pass" in result.stderr
    assert not (tmp_path / "store").exists()


def test_a_refresh_that_drops_cases_or_groups_is_refused_unless_allow_partial(tmp_path):
    first = _save(tmp_path / "g1.json", _run_json("H100", [("a", 1.0), ("b", 2.0)], group="g1"))
    second = _save(tmp_path / "g2.json", _run_json("H100", [("c", 3.0)], group="g2"))
    store = tmp_path / "store"
    assert _cli(first, second, "--storage", store).returncode == 0
    target = next(store.rglob("0001_baseline.json"))
    before = target.read_text()
    lost = _cli(first, "--storage", store)  # the g2 run went missing
    assert lost.returncode == 2
    assert "drops 1 case(s) and group(s) g2 that" in lost.stderr and "\n    c\n" in lost.stderr
    assert "--allow-partial" in lost.stderr and target.read_text() == before
    forced = _cli(first, "--storage", store, "--allow-partial")
    assert forced.returncode == 0 and "warning: the new baseline drops 1 case(s)" in forced.stderr
    assert json.loads(target.read_text())["cs336_groups"] == ["g1"]
    # a refresh that keeps every case (timed again or now OOM) replaces the baseline without a word
    assert _cli(first, second, "--storage", store).returncode == 0


def test_dirty_runs_are_refused_unless_allow_dirty(tmp_path):
    dirty = _save(tmp_path / "dirty.json", _run_json("H100", [("a", 1.0)], group="g1", dirty=True))
    refused = _cli(dirty, "--storage", tmp_path / "store")
    assert refused.returncode == 2
    assert "saved from a work tree with uncommitted changes (commit 15751cf012 (dirty))" in refused.stderr
    assert "--allow-dirty" in refused.stderr and not (tmp_path / "store").exists()
    assert _cli(dirty, "--storage", tmp_path / "store", "--allow-dirty").returncode == 0
    data = json.loads(next((tmp_path / "store").rglob("0001_baseline.json")).read_text())
    assert data["cs336_sources"] == [{"file": "dirty.json", "commit": "15751cf0123456789abcdef0123456789abcdef0",
                                      "dirty": True, "groups": ["g1"]}]


def test_the_committed_dirty_multi_gpu_baseline_could_not_be_rebuilt_without_allow_dirty():
    """results/h200x2 was merged from runs of a dirty work tree: kept as measured, but the tool now refuses
    such runs unless told to accept them."""
    (path,) = (ROOT / "results" / "h200x2" / "baselines").glob("*/0001_baseline.json")
    data = json.loads(path.read_text())
    assert data["commit_info"]["dirty"] is True
    with pytest.raises(ValueError, match="uncommitted changes"):
        baseline.check_run(data, str(path))
    baseline.check_run(data, str(path), allow_dirty=True)


def test_a_baseline_records_the_groups_it_covers():
    merged = baseline.merge_runs([_run_json("H100", [("a", 1.0)], group="leaderboard"),
                                  _run_json("H100", [("b", 1.0)], group="e2e-xl")], ["lb.json", "xl.json"])
    assert merged["cs336_groups"] == ["e2e-xl", "leaderboard"]
    assert [s["file"] for s in merged["cs336_sources"]] == ["lb.json", "xl.json"]
    assert baseline.run_groups(merged) == ["e2e-xl", "leaderboard"]


def test_the_committed_h100_baseline_covers_the_headline_groups_at_a_clean_commit():
    (path,) = (ROOT / "results" / "h100" / "baselines").glob("*/0001_baseline.json")
    data = json.loads(path.read_text())
    headline = {"leaderboard", "flash-bf16-graph", "e2e-2.7B", "e2e-xl", "e2e-compiled", "e2e-hf"}
    assert headline <= set(data["cs336_groups"]), data["cs336_groups"]
    assert data["commit_info"]["dirty"] is False
    assert {f"{g}.json" for g in headline} <= {s["file"] for s in data["cs336_sources"]}
    assert all(not s["dirty"] for s in data["cs336_sources"]), data["cs336_sources"]
    # each source is the committed run of that name, at the commit it records
    for source in data["cs336_sources"]:
        run = json.loads((ROOT / "results" / "h100" / source["file"]).read_text())
        assert run["commit_info"]["id"].startswith(source["commit"][:7]) and not run["commit_info"]["dirty"]
    groups = {b["extra_info"]["group"] for b in data["benchmarks"]}
    assert groups == set(data["cs336_groups"])


# --- what a comparison against a baseline must have compared ----------------------------------------------

def test_coverage_fails_a_comparison_of_nothing_and_a_group_the_baseline_lacks():
    base = baseline.merge_runs([_run_json("H100", [("a", 1.0), ("b", 1.0)], group="g1")])
    both = baseline.coverage({"a": "g1", "b": "g1"}, [base])
    assert (both.compared, both.problems(), both.missing) == (2, [], [])
    none = baseline.coverage({"x": None}, [base])
    assert none.compared == 0 and "compared none of the 1 case(s) this run timed" in none.problems()[0]
    assert "compared none" in baseline.coverage({}, []).problems()[0]  # nothing timed, or no baseline loaded
    other = baseline.coverage({"a": "g1", "c": "g2", "d": "g2"}, [base], deselected={"b"})
    assert other.compared == 1
    assert other.problems() == ["the baseline does not cover group(s) g2 (2 case(s)); it covers g1. Refresh it "
                                "with those groups"]
    new_case = baseline.coverage({"a": "g1", "b": "g1", "e": "g1"}, [base])  # a case the baseline lacks
    assert new_case.missing == ["e"] and "1 case(s) of group(s) the baseline covers are not in it" in (
        new_case.problems()[0])


def test_a_baseline_case_that_did_not_run_fails_unless_deselected():
    """b is in the baseline's g1, which this run timed: a run that did not time it (skipped, OOM, or gone from
    benchmarks.json) fails the comparison, unless b was deselected on purpose (-k); a group the run did not
    time at all is not asked for."""
    base = baseline.merge_runs([_run_json("H100", [("a", 1.0), ("b", 1.0)], group="g1"),
                                _run_json("H100", [("c", 1.0)], group="g2")], ["x.json", "y.json"])
    missed = baseline.coverage({"a": "g1"}, [base])
    assert missed.not_run == ["b"] and "1 baseline case(s) of the group(s) this run timed did not run" in (
        missed.problems()[0])
    assert baseline.coverage({"a": "g1"}, [base], deselected={"b"}).problems() == []


def test_a_compare_that_matches_no_case_of_the_run_fails_the_session(sleepy, monkeypatch):
    _run(sleepy, monkeypatch, 0.001, "--benchmark-save=base").assert_outcomes(passed=1)
    sleepy.makepyfile(test_sleepy=SLEEPY.replace("def test_sleep(", "def test_renamed("))
    result = _run(sleepy, monkeypatch, 0.001, "--benchmark-compare=0001")
    result.assert_outcomes(passed=1)
    assert result.ret == 1
    assert "--benchmark-compare compared none of the 1 case(s) this run timed" in result.stdout.str()
    missing = _run(sleepy, monkeypatch, 0.001, "--benchmark-compare=0042")  # no such saved run at all
    assert missing.ret == 1 and "compared none" in missing.stdout.str()


def test_a_benchmark_json_that_cannot_be_written_is_a_usage_error_before_any_case(sleepy, monkeypatch, tmp_path):
    (tmp_path / "a_file").write_text("")
    for bad in (tmp_path / "no_such_dir" / "run.json", tmp_path / "a_file" / "run.json", tmp_path):
        result = _run(sleepy, monkeypatch, 0.001, f"--benchmark-json={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, bad
        assert f"--benchmark-json={bad}: cannot write there" in result.stderr.str()
        assert "passed" not in result.stdout.str()  # refused before the first case ran
    good = tmp_path / "run.json"
    _run(sleepy, monkeypatch, 0.001, f"--benchmark-json={good}").assert_outcomes(passed=1)
    assert json.loads(good.read_text())["benchmarks"]
