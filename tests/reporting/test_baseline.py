"""Saved-run comparison end to end, and the committed per-GPU baselines (cs336_systems.reporting.baseline)."""

import json
import subprocess
import sys
from pathlib import Path

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
def sleepy(pytester, monkeypatch):
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest((ROOT / "conftest.py").read_text())  # the project's machine facts + refusal hook
    pytester.makepyfile(test_sleepy=SLEEPY)
    return pytester


def _run(project, monkeypatch, delay_s, *args):
    monkeypatch.setenv("DELAY_S", str(delay_s))
    return project.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-storage=file://{project.path / 'store'}",
                                        *args)


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
    sleepy.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-json=run.json").assert_outcomes(passed=1)
    target = baseline.write_baseline([sleepy.path / "run.json"], tmp_path / "baselines")
    from pytest_benchmark.utils import get_machine_id

    assert target.parent.name == get_machine_id() and target.name == "0001_baseline.json"
    result = sleepy.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-storage=file://{tmp_path / 'baselines'}",
                                         "--benchmark-compare=0001", "--benchmark-compare-fail=median:400%")
    assert result.ret == 0
    output = result.stdout.str() + result.stderr.str()
    assert f"Comparing against benchmarks from: {get_machine_id()}/0001_baseline.json" in output


def _run_json(gpu: str, benches: list[tuple[str, float]]) -> dict:
    return {
        "machine_info": {"system": "Linux", "python_implementation": "CPython", "python_version": "3.12.3",
                         "machine": "x86_64", "cs336_systems": {"gpu_name": gpu, "gpu_count": 1, "cuda": "13.0",
                                                                "torch": "2.11", "triton": "3.6"}},
        "commit_info": {}, "datetime": "2026-11-21", "version": "5.2.3",
        "benchmarks": [{"fullname": name, "stats": {"median": t}} for name, t in benches],
    }


def test_merge_keeps_every_case_and_later_runs_win():
    merged = baseline.merge_runs([_run_json("H100", [("a", 1.0), ("b", 2.0)]), _run_json("H100", [("b", 3.0)])])
    assert {b["fullname"]: b["stats"]["median"] for b in merged["benchmarks"]} == {"a": 1.0, "b": 3.0}


def test_merge_keeps_each_cases_latest_outcome_timed_or_oom():
    def run(timed, ooms):
        data = _run_json("H100", timed)
        data["oom"] = [{"fullname": name, "name": name, "error": "CUDA out of memory"} for name in ooms]
        return data

    # x OOMed, then a re-run timed it; y was timed, then OOMed; z OOMed twice
    merged = baseline.merge_runs([run([("y", 2.0)], ["x", "z"]), run([("x", 1.0)], ["y", "z"])])
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


def test_cli_lists_groups_and_reports_bad_input(tmp_path):
    groups = subprocess.run([sys.executable, "-m", "cs336_systems.baseline", "--groups", "gpu"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert "leaderboard" in groups and "ddp-bf16" in groups
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = subprocess.run([sys.executable, "-m", "cs336_systems.baseline", str(bad), "--storage", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not a readable pytest-benchmark JSON" in result.stderr
