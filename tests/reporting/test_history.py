"""cs336-report --history: a results folder's headline cases across the committed versions of its runs."""

import json
import subprocess

import pytest

from cs336_systems.reporting import history, render
from cs336_systems.reporting.run_files import RunFileError

CASE = "test_leaderboard[flash-triton-b1-h16-n16384-d64-forward-backward-bf16-causal-compiled-w10-l2flush]"
FACTS = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "cuda": "13.0", "torch": "2.11", "triton": "3.6"}


def _run(median_s: float, commit: str, when: str, facts=FACTS) -> dict:
    return {"machine_info": {"cs336_systems": facts}, "commit_info": {"id": commit * 8, "dirty": False},
            "datetime": when, "benchmarks": [{"name": CASE, "stats": {"median": median_s}},
                                              {"name": "test_leaderboard[sdpa-cudnn-x]", "stats": {"median": 1.0}}]}


def _commit(repo, rel, data, message):
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo, check=True)


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    medians = [5.26e-3, 5.20e-3, 5.12e-3, 4.36e-3, 4.40e-3, 4.38e-3]
    for i, m in enumerate(medians):
        _commit(tmp_path, "results/h100/leaderboard.json", _run(m, f"{i:05d}", f"2026-11-2{i}T10:00"), f"run {i}")
    # the same measurement committed again (samples dropped): not a new point
    again = _run(medians[-1], "00005", "2026-11-25T10:00") | {"note": "samples dropped"}
    _commit(tmp_path, "results/h100/leaderboard.json", again, "again")
    _commit(tmp_path, "results/h100/experiments/ab-other.json", _run(9.0, "99999", "2026-11-26T10:00"), "an A/B run")
    return tmp_path


def test_history_marks_a_confirmed_step_and_skips_experiments_and_repeats(repo):
    found = history.series(repo / "results/h100")
    ((key, points),) = found.items()
    assert key[0] == "leaderboard.json" and key[2] == CASE
    assert [p["median_ms"] for p in points] == pytest.approx([5.26, 5.20, 5.12, 4.36, 4.40, 4.38])
    marked = history.mark_steps(points, 10.0)
    assert [p["step"] for p in marked] == [False, False, False, True, False, False]
    assert marked[3]["change"] == pytest.approx(4.36 / 5.12 - 1)
    text = history.render_history(repo / "results/h100")
    assert "| 0000300 | 2026-11-23 | 4.360 | -14.8% | **step** |" in text


def test_a_move_that_the_next_version_undoes_is_not_a_step():
    points = [{"median_ms": m} for m in (5.0, 6.0, 5.0, 5.1)]
    assert not any(p["step"] for p in history.mark_steps(points, 10.0))
    last = [{"median_ms": m} for m in (5.0, 5.0, 6.0)]  # the last version's move has no next one to confirm it
    assert [p["step"] for p in history.mark_steps(last, 10.0)] == [False, False, True]


def test_other_machines_are_separate_series(repo):
    other = FACTS | {"gpu_name": "NVIDIA H200"}
    _commit(repo, "results/h100/leaderboard.json", _run(3.0e-3, "00007", "2026-11-27T10:00", other), "moved")
    found = history.series(repo / "results/h100")
    assert len(found) == 2 and sorted(len(p) for p in found.values()) == [1, 6]


def test_cli_and_its_errors(repo, tmp_path, capsys):
    assert render.main(["--history", str(repo / "results/h100"), "-o", str(tmp_path / "h.md")]) == 0
    assert "**step**" in (tmp_path / "h.md").read_text()
    assert render.main(["--history", str(repo / "results/h100"), "--case", "no-such-case"]) == 2
    assert "no case whose id contains any of no-such-case" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFileError, match="no saved runs"):
        history.series(tmp_path / "empty")


def test_history_plots_one_png_per_case_and_links_it(repo, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert render.main(["--history", str(repo / "results/h100"), "-o", str(out / "history.md"),
                        "--plots", str(out / "plots")]) == 0
    (png,) = (out / "plots").glob("*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"](plots/{png.name})" in (out / "history.md").read_text()
