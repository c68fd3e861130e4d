"""Saved runs as the results tree keeps them (cs336_systems.reporting.run_files.compact): smaller, the same
statistics, the per-round times to four significant digits, a bad run refused untouched."""

import json

import pytest

from cs336_systems.reporting import run_files


def _run(tmp_path, stats):
    path = tmp_path / "run.json"
    run = {"machine_info": {"cs336_systems": {"gpu_name": "X"}}, "commit_info": {"id": "abc", "dirty": False},
           "benchmarks": [{"name": "case", "group": "g", "extra_info": {"group": "g"}, "stats": stats}]}
    path.write_text(json.dumps(run, indent=4))
    return path, run


def test_compact_rounds_the_rounds_and_keeps_everything_else(tmp_path):
    stats = {"median": 0.0012345678901, "mean": 0.00123456789, "min": 0.001, "max": 0.002,
             "data": [0.0012345678901, 0.0019876543210, 0.001]}
    path, run = _run(tmp_path, stats)
    before, after = run_files.compact(path)
    assert after < before == len(json.dumps(run, indent=4).encode())
    saved = json.loads(path.read_text())
    assert saved["benchmarks"][0]["stats"]["data"] == [0.001235, 0.001988, 0.001]
    assert {k: v for k, v in saved["benchmarks"][0]["stats"].items() if k != "data"} == {
        k: v for k, v in stats.items() if k != "data"}
    assert {k: v for k, v in saved.items() if k != "benchmarks"} == {k: v for k, v in run.items() if k != "benchmarks"}
    assert "\n" not in path.read_text().rstrip("\n")
    assert run_files.compact(path)[1] == after  # idempotent


def test_compact_refuses_bad_stats_and_leaves_the_file(tmp_path, capsys):
    path, _ = _run(tmp_path, {"median": 1e-3, "data": [1e-3, float("nan")]})
    text = path.read_text()
    with pytest.raises(run_files.RunFileError, match="case case: stats.data"):
        run_files.compact(path)
    assert path.read_text() == text
    assert run_files.main(["--compact", str(path)]) == 2
    assert "stats.data" in capsys.readouterr().out
