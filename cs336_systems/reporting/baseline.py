"""Committed per-GPU baselines for pytest-benchmark's saved-run comparison.

A baseline is the merge of one machine's saved runs (``--benchmark-json`` files, one per perf group) into a
single file in pytest-benchmark's storage layout, ``<storage>/<machine_id>/0001_baseline.json``, so that

    pytest perf/ --perf-profile=gpu --perf-group=leaderboard \
        --benchmark-storage=file://results/h100/baselines --benchmark-compare=0001 \
        --benchmark-compare-fail=median:10%

compares any group against it (pytest-benchmark pairs benchmarks by full name and ignores the rest) and
fails on a slowdown beyond the threshold.

What a baseline guarantees.  Merging refuses:

* runs from different GPUs or software versions (absolute times do not transfer; the comparison itself
  refuses them too, see the root conftest.py);
* a run with no benchmarks (later comparisons would pass with nothing compared);
* a run saved from a work tree with uncommitted changes (``commit_info.dirty``: its times cannot be traced
  to code), unless ``--allow-dirty``;
* a refresh that would drop cases or groups the baseline it replaces had (a group whose run was lost),
  unless ``--allow-partial``;
* a case that two of the runs measured (which one is the baseline would depend on the files' order), unless
  ``--later-wins``;
* an interrupted run (selected cases it did not time: ``perf_not_timed``, other than those skipped on purpose
  as unsupported), a case without statistics, and statistics that are not finite numbers >= 0.

Each case keeps its per-round times (``stats.data``, rounded to four significant digits) where its run kept
them: the statistical gate (``--perf-gate``, `reporting.significance`) tests them.  The baseline records the
groups it covers (``cs336_groups``: the groups its runs' timed and OOM cases
name), the runs it was merged from (``cs336_sources``: file, commit, dirty, groups) and each case's run
(``cs336_case_sources``).  A comparison then fails when it compared no case, when the run has cases of a
group the baseline does not cover, or when it timed cases of a covered group that the baseline lacks (the
root conftest.py, `coverage`; deselect them with -k to compare the rest): comparing against nothing is not a
pass; and so does a baseline case of a group the run timed that did not run, unless it was deselected
(-k, -m).  What it does not guarantee: that the threshold is above the cases' run-to-run spread (README,
"Regression gating").

Refresh, one command on one machine of the kind (each group in its own pytest session, ``a+b`` for groups
that share one; stops at the first pytest run that fails or saves nothing, then merges)::

    cs336-baseline --refresh leaderboard,flash-bf16-graph,e2e-2.7B,e2e-xl,e2e-compiled \
        --profile gpu --runs results/h100 --storage results/h100/baselines

or merge runs made another way: ``cs336-baseline results/h100/a.json results/h100/b.json --storage DIR``.

Threshold: pick it above the run-to-run spread of the cases you gate; cases that are launch-bound or
shared-host-bound vary far more between runs than GPU-bound ones, so gate those with in-run ratios
(benchmarks.json "gates") instead.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems.bench import machine, matrix
from cs336_systems.reporting.run_files import check_stats, read_run, rounded_samples
from cs336_systems.reporting.tables import commit_label

BASELINE_NAME = "0001_baseline.json"


def _name(record: dict) -> str:
    return record.get("fullname") or record.get("name", "")


def run_groups(run: dict) -> list[str]:
    """The perf groups a baseline covers (its ``cs336_groups``) or a saved run covers: the groups its timed and
    OOM cases name.  Not the run's ``perf_groups``: a selected group whose cases were all skipped (say, for
    want of GPUs) has nothing to compare against."""
    if "cs336_groups" in run:
        return sorted(run["cs336_groups"])
    cases = run.get("benchmarks", []) + run.get("oom", [])
    return sorted({g for r in cases if (g := (r.get("extra_info") or {}).get("group"))})


def check_run(run: dict, source: str, allow_dirty: bool = False) -> None:
    """ValueError unless ``run`` can go into a baseline: timed cases, each with statistics that are finite
    numbers >= 0, no selected case left untimed (an interrupted run: ``perf_not_timed``; a case skipped as
    unsupported is not one), and a clean commit
    unless ``allow_dirty``."""
    if not run.get("benchmarks"):
        raise ValueError(f"{source}: no benchmarks; a baseline made from it would make later comparisons pass "
                         "with nothing compared")
    for record in run["benchmarks"]:
        check_stats(source, _name(record), record.get("stats"))
    # A case skipped on purpose (an implementation that cannot take it: "skipped: <why>") is not timed on any
    # run of its code, so no comparison misses it; one that failed or never ran makes the run incomplete.
    not_timed = [r for r in run.get("perf_not_timed") or []
                 if not (isinstance(r, dict) and str(r.get("reason", "")).startswith("skipped: "))]
    if not_timed:
        listed = ", ".join(str(r.get("name", r)) if isinstance(r, dict) else str(r) for r in not_timed[:3])
        raise ValueError(f"{source}: {len(not_timed)} selected case(s) were not timed (an interrupted or failing "
                         f"run: {listed}{', ...' if len(not_timed) > 3 else ''}); re-run the group")
    if (run.get("commit_info") or {}).get("dirty") and not allow_dirty:
        raise ValueError(f"{source}: saved from a work tree with uncommitted changes (commit {commit_label(run)}), "
                         "so its times cannot be traced to code; re-run at a clean commit, or pass --allow-dirty")


def merge_runs(runs: list[dict], sources: list[str] | None = None, later_wins: bool = False) -> dict:
    """One pytest-benchmark run from several of the same machine.  A case (fullname) in two runs is refused
    (ValueError listing them: which measurement is the baseline would depend on the order of the files)
    unless ``later_wins``.  ``cs336_case_sources`` records each case's run file."""
    if not runs:
        raise ValueError("merge_runs needs at least one run")
    sources = sources or [f"run {i}" for i in range(len(runs))]
    first = runs[0]
    facts = first.get("machine_info", {}).get("cs336_systems")
    if facts is None:
        raise ValueError(f"{sources[0]}: no machine_info.cs336_systems (not saved by this project's perf suite)")
    # fullname -> ("benchmarks" | "oom", record): a case's latest outcome, timed or out of memory, wins
    merged: dict[str, tuple[str, dict]] = {}
    origin: dict[str, str] = {}
    conflicts: list[str] = []
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
                name = _name(record)
                if name in origin and origin[name] != source:
                    conflicts.append(f"{name} ({origin[name]} and {source})")
                merged[name] = (kind, record)
                origin[name] = source
    if conflicts and not later_wins:
        shown = "".join(f"\n    {c}" for c in conflicts[:10]) + (f"\n    ... and {len(conflicts) - 10} more"
                                                                  if len(conflicts) > 10 else "")
        raise ValueError(f"{len(conflicts)} case(s) appear in more than one run:{shown}\nmerge runs of different "
                         "groups, or pass --later-wins to keep each case from the last file that has it")
    skip = ("benchmarks", "oom", "perf_groups", "perf_not_timed")
    out = {key: value for key, value in first.items() if key not in skip}
    out["benchmarks"] = [rounded_samples(record) for kind, record in merged.values() if kind == "benchmarks"]
    out["oom"] = [record for kind, record in merged.values() if kind == "oom"]
    out["cs336_groups"] = sorted({g for run in runs for g in run_groups(run)})
    out["cs336_case_sources"] = {name: Path(origin[name]).name for name in merged}
    out["cs336_sources"] = [
        {"file": Path(source).name, "commit": (run.get("commit_info") or {}).get("id"),
         "dirty": bool((run.get("commit_info") or {}).get("dirty")), "groups": run_groups(run)}
        for run, source in zip(runs, sources)]
    return out


def dropped(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(cases, groups) the baseline ``old`` had and ``new`` lacks."""
    names = {_name(r) for r in new.get("benchmarks", []) + new.get("oom", [])}
    cases = sorted(_name(r) for r in old.get("benchmarks", []) + old.get("oom", []) if _name(r) not in names)
    groups = sorted(set(run_groups(old)) - set(run_groups(new)))
    return cases, groups


def storage_machine_id(machine_info: dict) -> str:
    """pytest-benchmark's storage folder name for the machine that saved a run (its get_machine_id():
    system-implementation-major.minor-bits), rebuilt from the run's machine_info."""
    try:
        version = ".".join(machine_info["python_version"].split(".")[:2])
        bits = "64bit" if machine_info["machine"] in ("x86_64", "aarch64", "arm64", "AMD64") else "32bit"
        return f"{machine_info['system']}-{machine_info['python_implementation']}-{version}-{bits}"
    except KeyError as exc:
        raise ValueError(f"machine_info lacks {exc}: cannot name the storage folder") from None


def write_baseline(runs_paths: list[Path], storage: Path, *, allow_partial: bool = False,
                   allow_dirty: bool = False, later_wins: bool = False, log=print) -> Path:
    """Merge the saved runs into ``storage/<machine_id>/0001_baseline.json`` (replacing it); return the path.

    ValueError (nothing written) for a run `check_run` refuses, runs of different machines, or a refresh
    that drops cases or groups of the baseline it replaces unless ``allow_partial``.
    """
    runs = [read_run(path) for path in runs_paths]
    for run, path in zip(runs, runs_paths):
        check_run(run, str(path), allow_dirty)
    merged = merge_runs(runs, [str(p) for p in runs_paths], later_wins=later_wins)
    target = Path(storage) / storage_machine_id(merged["machine_info"]) / BASELINE_NAME
    if target.exists():
        cases, groups = dropped(read_run(target), merged)
        if cases or groups:
            shown = "".join(f"\n    {c}" for c in cases[:10]) + (f"\n    ... and {len(cases) - 10} more"
                                                                 if len(cases) > 10 else "")
            message = (f"the new baseline drops {len(cases)} case(s)"
                       + (f" and group(s) {', '.join(groups)}" if groups else "")
                       + f" that {target} has:{shown}")
            if not allow_partial:
                raise ValueError(message + "\nadd the runs of those groups, or pass --allow-partial to drop them")
            log(f"warning: {message}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # compact: a baseline is read by pytest-benchmark, not by people, and is committed to the repository
        target.write_text(json.dumps(merged, separators=(",", ":")) + "\n")
    except OSError as exc:
        raise ValueError(f"cannot write the baseline under --storage {storage}: {exc}") from None
    return target


# --- comparing a run against a baseline (used by the root conftest.py) ------------------------------------

@dataclass
class Coverage:
    """How much of one run a ``--benchmark-compare`` baseline covered."""

    timed: int  # cases this run timed
    compared: int  # of them, found in the baseline
    baseline_groups: list[str]
    uncovered_groups: dict[str, int] = field(default_factory=dict)  # group -> cases, not in the baseline's groups
    missing: list[str] = field(default_factory=list)  # timed cases of covered groups the baseline lacks
    not_run: list[str] = field(default_factory=list)  # baseline cases of this run's groups it did not time

    def problems(self) -> list[str]:
        """What fails the session: a comparison that compared nothing, or a group the baseline lacks."""
        out = []
        if self.compared == 0:
            out.append(f"--benchmark-compare compared none of the {self.timed} case(s) this run timed: the baseline "
                       "has none of them (or none was loaded), so nothing was checked")
        if self.uncovered_groups:
            listed = ", ".join(f"{g} ({n} case(s))" for g, n in sorted(self.uncovered_groups.items()))
            out.append(f"the baseline does not cover group(s) {listed}; it covers "
                       f"{', '.join(self.baseline_groups) or 'no named group'}. Refresh it with those groups")
        if self.missing:
            out.append(f"{len(self.missing)} case(s) of group(s) the baseline covers are not in it (listed below), "
                       "so they were not compared; refresh the baseline with them, or deselect them (-k)")
        if self.not_run:
            out.append(f"{len(self.not_run)} baseline case(s) of the group(s) this run timed did not run (skipped, "
                       "out of memory, or gone from benchmarks.json; listed below): deselect them (-k) if that is "
                       "on purpose, or refresh the baseline")
        return out


def coverage(timed: dict[str, str | None], baselines: list[dict], deselected: frozenset[str] | set[str] = frozenset(),
             ) -> Coverage:
    """``timed``: fullname -> group of each case this run timed; ``baselines``: the saved runs compared with;
    ``deselected``: node ids deselected on purpose (-k, -m), whose baseline cases are not missed."""
    names = {_name(r) for b in baselines for r in b.get("benchmarks", [])}
    groups = sorted({g for b in baselines for g in run_groups(b)})
    uncovered: dict[str, int] = {}
    missing = []
    for name, group in timed.items():
        if group and group not in groups:
            uncovered[group] = uncovered.get(group, 0) + 1
        elif name not in names:
            missing.append(name)
    compared = sum(name in names for name in timed)
    run_groups_timed = {g for g in timed.values() if g}
    not_run = sorted({_name(r) for b in baselines for r in b.get("benchmarks", [])
                      if (r.get("extra_info") or {}).get("group") in run_groups_timed
                      and _name(r) not in timed and _name(r) not in deselected})
    return Coverage(len(timed), compared, groups, uncovered, missing, not_run)


# --- CLI -----------------------------------------------------------------------------------------------

def refresh(specs: list[str], profile: str, runs_dir: Path, pytest_command: str) -> list[Path]:
    """Run ``pytest perf/`` once per group spec (``a`` or ``a+b``: groups sharing one session) from the current
    directory, saving ``runs_dir/<spec>.json``; ValueError at the first pytest run that fails or saves nothing."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        out = runs_dir / f"{spec}.json"
        out.unlink(missing_ok=True)  # a stale file must not stand in for a run that saved nothing
        command = [*shlex.split(pytest_command), "perf/", f"--perf-profile={profile}",
                   f"--perf-group={spec.replace('+', ',')}", f"--benchmark-json={out}"]
        print("$ " + shlex.join(command), flush=True)
        code = subprocess.run(command).returncode
        if code != 0:
            raise ValueError(f"group {spec}: pytest exited with status {code}; nothing merged")
        if not out.is_file():
            raise ValueError(f"group {spec}: pytest saved no {out} (no case was timed); nothing merged")
        paths.append(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="saved runs (--benchmark-json files) of one machine")
    parser.add_argument("--storage", type=Path, help="pytest-benchmark storage folder, e.g. results/h100/baselines")
    parser.add_argument("--groups", choices=matrix.PROFILES, help="print the perf groups of this profile and exit")
    parser.add_argument("--refresh", metavar="GROUPS",
                        help="comma-separated groups to run (a+b: one session), then merge their runs")
    parser.add_argument("--profile", choices=matrix.PROFILES, default="gpu", help="--refresh: the perf profile")
    parser.add_argument("--runs", dest="runs_dir", type=Path, help="--refresh: where to save each group's run")
    parser.add_argument("--pytest-command", default=f"{sys.executable} -m pytest",
                        help="--refresh: how to start pytest (e.g. 'torchrun --standalone --nproc-per-node=2 -m "
                             "pytest' for the multi-GPU groups); default %(default)s")
    parser.add_argument("--allow-partial", action="store_true",
                        help="replace a baseline even if cases or groups it had are missing from the new runs")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="accept runs saved from a work tree with uncommitted changes")
    parser.add_argument("--later-wins", action="store_true",
                        help="a case in several runs: keep the last file's (refused by default)")
    args = parser.parse_args(argv)
    if args.groups:
        print("\n".join(matrix.load(matrix.DEFAULT_PATH).groups(args.groups)))
        return 0
    if args.storage is None or bool(args.runs) == bool(args.refresh):
        parser.error("give --storage and either the saved runs or --refresh GROUPS (or --groups PROFILE)")
    if args.refresh and args.runs_dir is None:
        parser.error("--refresh needs --runs DIR, where each group's run is saved")
    try:
        paths = args.runs
        if args.refresh:
            specs = [s.strip() for s in args.refresh.split(",") if s.strip()]
            if not specs:
                parser.error(f"--refresh {args.refresh!r}: no group named")
            paths = refresh(specs, args.profile, args.runs_dir, args.pytest_command)
        target = write_baseline(paths, args.storage, allow_partial=args.allow_partial,
                                allow_dirty=args.allow_dirty, later_wins=args.later_wins,
                                log=lambda m: print(m, file=sys.stderr))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = json.loads(target.read_text())
    print(f"baseline written: {target} ({len(data['benchmarks'])} cases, {len(data['oom'])} OOM; "
          f"groups {', '.join(data['cs336_groups'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
