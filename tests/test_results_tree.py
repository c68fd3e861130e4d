"""results/ holds what a user reads and nothing else: saved runs, reports, plots and baselines.

Per GPU kind (results/<gpu>/): the newest saved pytest-benchmark run of each suite (*.json), the rendered
report and a README (*.md), plots (plots/*.png), the regression baseline (baselines/<machine id>/NNNN_*.json),
and under experiments/ the same-run A/B runs (ab-*.json) that back measured claims in docs/, with an index
(experiments/README.md: file, claim, doc section), and under gate-validation/ the statistical gate's
calibration runs (``<group>--<label>.json`` and their ``calibration.json``).  No scripts, logs or profiler captures; the folder stays
small enough to clone without noticing (8 MiB: the newest suite runs keep their per-round samples, which the
statistical gate tests, at about 2 KB a case of 100 rounds).  The runs the README's
results block shows for a single-GPU kind name a clean commit, so each number traces to code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cs336_systems.reporting import calibration, readme_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
MAX_BYTES = 8 * 2**20
FILES = sorted(p for p in RESULTS.rglob("*") if p.is_file()) if RESULTS.is_dir() else []


def kind(path: Path) -> str | None:
    """'run', 'baseline', 'report' or 'plot'; None for anything else."""
    parts = path.relative_to(RESULTS).parts
    if len(parts) < 2:
        return None  # results/ itself holds only GPU folders
    if parts[1] == "plots":
        return "plot" if len(parts) == 3 and path.suffix == ".png" else None
    if parts[1] == "experiments":
        if len(parts) == 3 and parts[2] == "README.md":
            return "index"
        if len(parts) == 3 and path.suffix == ".json":
            return "run" if parts[2].startswith("ab-") else "probe" if parts[2].startswith("probe-") else None
        return None
    if parts[1] == "gate-validation":  # the statistical gate's calibration (reporting.calibration run)
        if len(parts) == 3 and parts[2] == calibration.MANIFEST:
            return "manifest"
        group, sep, label = path.stem.partition(calibration.SEPARATOR)
        return "run" if len(parts) == 3 and path.suffix == ".json" and group and sep and label else None
    if parts[1] == "baselines":
        return "baseline" if len(parts) == 4 and re.fullmatch(r"\d{4}_\w+\.json", parts[3]) else None
    if len(parts) == 2 and path.suffix == ".md":
        return "report"
    if len(parts) == 2 and path.suffix == ".json" and not parts[1].startswith("ab-"):
        return "run"  # an A/B run belongs under experiments/
    return None


def test_results_exists_and_is_small():
    assert FILES, "results/ is empty"
    total = sum(p.stat().st_size for p in FILES)
    assert total < MAX_BYTES, f"results/ is {total / 2**20:.1f} MiB (limit {MAX_BYTES / 2**20:.0f} MiB)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_file_is_a_run_report_plot_or_baseline(path):
    what = kind(path)
    assert what is not None, (f"{path.relative_to(ROOT)} is not a saved run, report, plot, baseline or indexed "
                              "experiment (A/B runs go under results/<gpu>/experiments/)")
    if what in ("run", "baseline"):
        data = json.loads(path.read_text())
        assert isinstance(data.get("benchmarks"), list) and data["benchmarks"], f"{path}: no benchmarks"
        assert "cs336_systems" in data.get("machine_info", {}), f"{path}: no machine facts"
        assert "commit_info" in data, f"{path}: no commit_info"
    if what == "probe":  # a standalone probe: its GPU, the commit it ran and how it measured
        data = json.loads(path.read_text())
        assert all(data.get(key) for key in ("gpu", "commit", "what")), f"{path}: needs gpu, commit and what"
    if what == "plot":
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"


@pytest.mark.parametrize("folder", sorted({p.parent for p in FILES if p.parent.name == "experiments"}),
                         ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_experiment_is_indexed_with_its_claim_and_where_it_is_cited(folder):
    index = folder / "README.md"
    assert index.is_file(), f"{folder.relative_to(ROOT)} has no README.md index"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `((?:ab|probe)-[^`]+\.json)` \|(.*)\|\s*$",
                                                         index.read_text(), re.M)}
    files = {p.name for p in folder.glob("*.json")}
    assert set(rows) == files, f"index rows without a file: {sorted(set(rows) - files)}; files without a row: " \
                               f"{sorted(files - set(rows))}"
    for name, cells in rows.items():
        *_, claim, cited = [c.strip() for c in cells.split("|")]
        assert claim and cited, f"{index.relative_to(ROOT)}: {name} needs its claim and where it is cited"


def test_kind_rejects_what_does_not_belong():
    for bad in ("h100/run.sh", "h100/probes/x.py", "h100/run-2026/leaderboard.json", "h100/gpu.txt",
                "h100/prof.ncu-rep", "h100/plots/x.svg", "h100/baselines/x.json", "notes.md", "h100/ab-x.json",
                "h100/experiments/x.json", "h100/experiments/sub/ab-x.json"):
        assert kind(RESULTS / bad) is None, bad
    for good, expected in (("h100/leaderboard.json", "run"), ("h100/report.md", "report"),
                           ("h100/plots/a.png", "plot"), ("h100/experiments/ab-x.json", "run"),
                           ("h100/experiments/README.md", "index"), ("h100/experiments/probe-x.json", "probe"),
                           ("h100/baselines/Linux-CPython-3.12-64bit/0001_baseline.json", "baseline")):
        assert kind(RESULTS / good) == expected, good


def test_single_gpu_headline_runs_name_a_clean_commit():
    single_gpu = [run for section in readme_block.README_RESULTS for run in section.runs
                  if re.match(r"results/(h100|h200)/", run)]
    assert single_gpu
    for run in single_gpu:
        info = json.loads((ROOT / run).read_text()).get("commit_info", {})
        assert re.fullmatch(r"[0-9a-f]{40}", str(info.get("id"))), f"{run}: commit {info.get('id')!r}"
        assert info.get("dirty") is False, f"{run} was measured with uncommitted changes"
