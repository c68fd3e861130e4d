"""Committed per-GPU baselines for pytest-benchmark's saved-run comparison.

A baseline is the merge of one machine's saved runs (``--benchmark-json`` files, one per perf group) into a
single file in pytest-benchmark's storage layout, ``<storage>/<machine_id>/0001_baseline.json``, so that

    pytest perf/ --perf-profile=gpu --perf-group=leaderboard \
        --benchmark-storage=file://results/h100/baselines --benchmark-compare=0001 \
        --benchmark-compare-fail=median:10%

compares any group against it (pytest-benchmark pairs benchmarks by full name and ignores the rest) and
fails on a slowdown beyond the threshold.  Runs from different GPUs or software versions are refused when
merging, as the comparison itself refuses them (see the root conftest.py): absolute times do not transfer.

Refresh (one machine of the kind, e.g. an H100)::

    for g in $(python -m cs336_systems.baseline --groups gpu); do
        pytest perf/ --perf-profile=gpu --perf-group=$g --benchmark-json=results/h100/$g.json
    done
    python -m cs336_systems.baseline results/h100/*.json --storage results/h100/baselines

Threshold: pick it above the run-to-run spread of the cases you gate (README, "Regression gating"); cases
that are launch-bound or shared-host-bound vary far more between runs than GPU-bound ones, so gate those with
in-run ratios (benchmarks.json "gates") instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cs336_systems.bench import machine, matrix
from cs336_systems.reporting.run_files import read_run

BASELINE_NAME = "0001_baseline.json"


def merge_runs(runs: list[dict], sources: list[str] | None = None) -> dict:
    """One pytest-benchmark run from several of the same machine: later runs win for the same fullname."""
    if not runs:
        raise ValueError("merge_runs needs at least one run")
    sources = sources or [f"run {i}" for i in range(len(runs))]
    first = runs[0]
    facts = first.get("machine_info", {}).get("cs336_systems")
    if facts is None:
        raise ValueError(f"{sources[0]}: no machine_info.cs336_systems (not saved by this project's perf suite)")
    # fullname -> ("benchmarks" | "oom", record): a case's latest outcome, timed or out of memory, wins
    merged: dict[str, tuple[str, dict]] = {}
    for run, source in zip(runs, sources):
        other = run.get("machine_info", {}).get("cs336_systems")
        if other is None:
            raise ValueError(f"{source}: no machine_info.cs336_systems (not saved by this project's perf suite)")
        differences = machine.incomparable_fields(facts, other)
        if differences:
            listed = ", ".join(f"{f}: {a!r} vs {b!r}" for f, a, b in differences)
            raise ValueError(f"{source} comes from another machine or software than {sources[0]} ({listed})")
        for kind in ("benchmarks", "oom"):
            for record in run.get(kind, []):
                merged[record.get("fullname") or record.get("name", "")] = (kind, record)
    out = {key: value for key, value in first.items() if key not in ("benchmarks", "oom")}
    out["benchmarks"] = [record for kind, record in merged.values() if kind == "benchmarks"]
    out["oom"] = [record for kind, record in merged.values() if kind == "oom"]
    return out


def storage_machine_id(machine_info: dict) -> str:
    """pytest-benchmark's storage folder name for the machine that saved a run (its get_machine_id():
    system-implementation-major.minor-bits), rebuilt from the run's machine_info."""
    try:
        version = ".".join(machine_info["python_version"].split(".")[:2])
        bits = "64bit" if machine_info["machine"] in ("x86_64", "aarch64", "arm64", "AMD64") else "32bit"
        return f"{machine_info['system']}-{machine_info['python_implementation']}-{version}-{bits}"
    except KeyError as exc:
        raise ValueError(f"machine_info lacks {exc}: cannot name the storage folder") from exc


def write_baseline(runs_paths: list[Path], storage: Path) -> Path:
    """Merge the saved runs into ``storage/<machine_id>/0001_baseline.json`` (replacing it); return the path."""
    runs = [read_run(path) for path in runs_paths]
    merged = merge_runs(runs, [str(p) for p in runs_paths])
    machine_id = storage_machine_id(merged["machine_info"])
    target = Path(storage) / machine_id / BASELINE_NAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # compact: a baseline is read by pytest-benchmark, not by people, and is committed to the repository
        target.write_text(json.dumps(merged, separators=(",", ":")) + "\n")
    except OSError as exc:
        raise ValueError(f"cannot write the baseline under --storage {storage}: {exc}") from None
    return target


def gpu_groups(profile: str = "gpu") -> list[str]:
    """The perf groups of a profile, in benchmarks.json order (what a refresh runs)."""
    m = matrix.load(matrix.DEFAULT_PATH)
    groups: list[str] = []
    for suite in m.suites:
        for grid in m.suites[suite].get(profile, []):  # grids, not cases: a group may only repeat others' cases
            if grid.get("group") is not None and grid["group"] not in groups:
                groups.append(grid["group"])
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="saved runs (--benchmark-json files) of one machine")
    parser.add_argument("--storage", type=Path, help="pytest-benchmark storage folder, e.g. results/h100/baselines")
    parser.add_argument("--groups", choices=matrix.PROFILES, help="print the perf groups of this profile and exit")
    args = parser.parse_args(argv)
    if args.groups:
        print("\n".join(gpu_groups(args.groups)))
        return 0
    if not args.runs or args.storage is None:
        parser.error("give the saved runs and --storage (or --groups PROFILE)")
    try:
        target = write_baseline(args.runs, args.storage)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"baseline written: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
