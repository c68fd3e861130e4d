"""cs336_systems.reporting.isolated: each perf case in its own process, the runs merged into one saved run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.reporting import isolated
from cs336_systems.reporting.baseline import check_run

ROOT = Path(__file__).resolve().parents[2]
# The cpu profile's leaderboard group, eager: naive attention forward, backward and forward+backward.
SELECTION = ["perf/", "--perf-profile=cpu", "--perf-group=leaderboard-cpu", "-k", "eager"]


@pytest.mark.slow
def test_each_case_runs_in_its_own_process_and_the_runs_merge(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    collected = isolated.collect(SELECTION)
    assert len(collected) == 3 and all("eager" in node for node in collected)
    out = tmp_path / "merged.json"
    assert isolated.main([str(out), "--order", "reversed", "--", *SELECTION]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("] ")[1].split(": exit")[0] for line in lines] == collected[::-1]  # one process each
    merged = json.loads(out.read_text())
    check_run(merged, str(out), allow_dirty=True)  # a run the reports and baselines take
    assert sorted(merged["cs336_case_sources"]) == sorted(collected)
    assert len(set(merged["cs336_case_sources"].values())) == 3  # three runs, one case each
    assert merged["cs336_isolated"]["order"] == "reversed" and merged["cs336_isolated"]["node_ids"] == collected[::-1]
    assert merged["cs336_groups"] == ["leaderboard-cpu"] and len(merged["benchmarks"]) == 3


def test_perf_only_keeps_one_item_and_refuses_an_unknown_id():
    base = [sys.executable, "-m", "pytest", *SELECTION, "--collect-only", "-q", "-p", "no:cacheprovider"]
    listed = subprocess.run(base, cwd=ROOT, capture_output=True, text=True)
    node = next(line for line in listed.stdout.splitlines() if "::" in line)
    one = subprocess.run([*base, f"--perf-only={node}"], cwd=ROOT, capture_output=True, text=True)
    assert one.returncode == 0 and [line for line in one.stdout.splitlines() if "::" in line] == [node]
    bad = subprocess.run([*base, "--perf-only=perf/test_attention.py::nope"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == pytest.ExitCode.USAGE_ERROR and "no collected item has this node id" in bad.stderr


@pytest.mark.parametrize("arg", ["--benchmark-json=x.json", "--perf-only=a::b", "-n", "-n4", "-nauto",
                                 "--numprocesses=2", "--collect-only"])
def test_arguments_the_tool_sets_itself_are_refused(arg, tmp_path, capsys):
    assert isolated.main([str(tmp_path / "o.json"), "--", "perf/", arg]) == 2
    assert repr(arg) in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_an_empty_selection_and_bad_options_are_usage_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert isolated.main([str(tmp_path / "o.json"), "--", *SELECTION, "-k", "no_such_case"]) == 2
    assert "selects no case" in capsys.readouterr().err
    assert isolated.main([str(tmp_path / "missing" / "o.json"), "--", *SELECTION]) == 2
    assert "folder does not exist" in capsys.readouterr().err
    assert isolated.main([str(tmp_path / "o.json"), "--timeout-s", "0", "--", *SELECTION]) == 2
    assert "--timeout-s must be positive" in capsys.readouterr().err
    with pytest.raises(isolated.UsageError, match="order must be one of"):
        isolated.ordered(["a"], "shuffled")
    assert isolated.ordered(["a", "b"], "reversed") == ["b", "a"]


def test_a_failing_case_is_reported_and_the_others_are_kept(tmp_path, monkeypatch):
    """A case whose process fails (or times out) is listed with its transcript's tail; the exit status is 1
    and the merged run holds the cases whose processes wrote one."""
    calls = []

    def fake_run(command, stdout, stderr, timeout, env):
        assert not any(name.startswith("PYTEST_XDIST_") for name in env)
        node = next(a for a in command if a.startswith("--perf-only=")).split("=", 1)[1]
        calls.append(node)
        assert command[:4] == ["torchrun", "-m", "pytest", "perf/"]  # --pytest-command starts each process
        if node == "b":
            raise subprocess.TimeoutExpired(command, timeout)
        stdout.write("the case's output\n")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(isolated.subprocess, "run", fake_run)
    runs, failures = isolated.run_each(["a", "b"], ["perf/"], tmp_path, 5.0, ("torchrun", "-m", "pytest"),
                                       log=lambda *_: None)
    assert calls == ["a", "b"] and runs == []  # the fake wrote no run files: "a" passed but saved nothing
    assert [f.split("\n")[0] for f in failures] == ["a: exit status 0 but no run written (pytest-benchmark off?)",
                                                    "b: timed out"]
    assert "the case's output" in failures[0]  # the transcript's tail
