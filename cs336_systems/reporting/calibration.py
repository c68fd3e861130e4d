"""Measure the statistical gate on your runner: false alarms over A/A repeats, detections of known slower paths.

    python -m cs336_systems.reporting.calibration run --groups leaderboard --repeats 3 \\
        --variant fused-bwd-off:CS336_FLASH_FUSED_BWD=0 --variant portable-fwd:CS336_FLASH_HOPPER_FWD=0 \\
        --out results/h200/gate-validation
    python -m cs336_systems.reporting.calibration analyze results/h200/gate-validation [--markdown FILE]

``run``: for each perf group, the code as it is ("a", ``--repeats`` times) and each variant once (its
``CS336_*`` switches set: a known slower path), each one pytest session of the perf suite saved with
``--benchmark-json`` (every round kept) as ``<out>/<group>--a<i>.json`` and ``<out>/<group>--<variant>.json``.
The sessions interleave (a1, variant 1, a2, variant 2, ..., the remaining a runs), so a drift over the
sessions lands on both sides.  ``<out>/calibration.json`` records each session's command and switches.

``analyze``: per group, with the group's gate settings (benchmarks.json "regression"), the gate's decision
(`reporting.significance.decide`) on

* A/A: every pair of a runs (the earlier as the baseline), every case they share: any verdict but
  "unchanged" or "inconclusive" is a false alarm ("regressed" fails a merge; "improved" claims a change
  that is not there either);
* A/B: each variant run against each a run, every case: its median ratio and in how many of the
  comparisons the gate declared it regressed.

It reports per group the false alarms (and the undecided, "inconclusive", comparisons) over the comparisons
made, per variant and case the ratios and detections, and per group the smallest mean slowdown detected in every comparison and the largest missed
in any (what the gate's ``min_effect`` lets through on this runner).  A variant that does not slow a case
down (a switch that only changes other head dims) reads as ratio ~1 there: the detections that count are
those of the cases the slower path runs in.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from cs336_systems import switches
from cs336_systems.bench import matrix
from cs336_systems.reporting import significance
from cs336_systems.reporting.run_files import read_run

MANIFEST = "calibration.json"
SEPARATOR = "--"  # <group>--<label>.json; group names may hold "-" but not "--" (a label may)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"label:NAME=VALUE[,NAME=VALUE...]" -> (label, switches), each switch registered and its value valid."""
    label, sep, assignments = text.partition(":")
    if not sep or not label or not assignments:
        raise ValueError(f"--variant: expected label:NAME=VALUE[,NAME=VALUE], got {text!r}")
    if not label.replace("-", "").replace("_", "").isalnum() or label[0] == "a" and label[1:].isdigit():
        raise ValueError(f"--variant: label {label!r} must be letters, digits, '-' or '_', and not a<number>")
    env = {}
    for item in assignments.split(","):
        name, eq, value = item.partition("=")
        if not eq or name not in switches.REGISTRY:
            raise ValueError(f"--variant {label}: {item!r} is not NAME=VALUE of a registered switch "
                             "(cs336_systems.switches.REGISTRY)")
        env[name] = switches.REGISTRY[name].check(value)
    return label, env


def schedule(groups: Sequence[str], repeats: int, variants: Sequence[tuple[str, dict[str, str]]]) -> list[tuple]:
    """(group, label, switches) per session, in run order: per group a1, v1, a2, v2, ..., the rest."""
    if repeats < 2:
        raise ValueError(f"--repeats must be >= 2 (an A/A comparison needs two runs), got {repeats}")
    order = []
    for group in groups:
        a_runs = [(group, f"a{i + 1}", {}) for i in range(repeats)]
        b_runs = [(group, label, env) for label, env in variants]
        for a, b in itertools.zip_longest(a_runs, b_runs):
            order += [run for run in (a, b) if run is not None]
    return order


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    m = matrix.load(args.matrix)
    known = set(m.groups(args.profile))
    groups = [g for g in args.groups.split(",") if g]
    for group in groups:
        if group not in known:
            raise SystemExit(f"error: --groups: {group!r} is not a group of the {args.profile} profile; "
                             f"groups: {', '.join(sorted(known))}")
    try:
        variants = [parse_variant(v) for v in args.variant]
        sessions = schedule(groups, args.repeats, variants)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    # the A runs see none of the variants' switches (else they would measure a variant too)
    varied = {name for _, env in variants for name in env}
    base_env = {name: value for name, value in os.environ.items() if name not in varied}
    manifest = {"profile": args.profile, "groups": groups, "repeats": args.repeats,
                "variants": {label: env for label, env in variants}, "sessions": []}
    for group, label, env in sessions:
        path = out / f"{group}{SEPARATOR}{label}.json"
        command = [*shlex.split(args.pytest_command), "perf/", f"--perf-profile={args.profile}",
                   f"--perf-group={group}", f"--benchmark-json={path}", "-q", "-p", "no:cacheprovider",
                   *args.pytest_args]
        print(f"[{group} {label}] {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(command)}",
              flush=True)
        code = subprocess.call(command, env={**base_env, **env})
        manifest["sessions"].append({"group": group, "label": label, "switches": env, "command": shlex.join(command),
                                     "exit": code, "file": path.name})
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if code not in (0, 1) or not path.is_file():  # 1: a gate or a case failed; the run is still saved
            print(f"error: the {group} {label} session exited {code} without a saved run; stopping", file=sys.stderr)
            return 2
    return 0


def _rounds(data: dict) -> dict[str, tuple[str, list[float], dict]]:
    """case name -> (its group, its per-round times, its extra_info) of a saved run's timed cases that kept
    them."""
    out = {}
    for bench in data["benchmarks"]:
        rounds = (bench.get("stats") or {}).get("data")
        if rounds:
            info = bench.get("extra_info") or {}
            out[bench["name"]] = (info.get("group", ""), rounds, info)
    return out


def _runs_by_group(folder: Path) -> dict[str, dict[str, dict]]:
    """group -> label -> that session's cases (`_rounds`), from ``<group>--<label>.json`` files."""
    found: dict[str, dict[str, dict]] = {}
    for path in sorted(folder.glob(f"*{SEPARATOR}*.json")):
        group, _, label = path.stem.rpartition(SEPARATOR)
        found.setdefault(group, {})[label] = _rounds(read_run(path))
    return found


def _is_a(label: str) -> bool:
    return label[:1] == "a" and label[1:].isdigit()


def analyze(folder: Path, m: matrix.Matrix) -> dict:
    """The A/A and A/B tallies of a calibration folder (module docstring)."""
    result = {}
    for group, runs in sorted(_runs_by_group(folder).items()):
        settings = m.gate_settings(group)
        a_labels = sorted((label for label in runs if _is_a(label)), key=lambda s: int(s[1:]))
        if len(a_labels) < 2:
            raise ValueError(f"{folder}: group {group} has {len(a_labels)} A run(s); A/A needs two or more")
        alarms, compared, undecided, aa_ratios = [], 0, 0, []
        for old, new in itertools.combinations(a_labels, 2):
            for case in runs[old].keys() & runs[new].keys():
                v = significance.decide(runs[old][case][1], runs[new][case][1],
                                        m.gate_settings(group, runs[new][case][2]), case, group)
                compared += 1
                undecided += v.verdict == "inconclusive"
                aa_ratios.append(v.ratio)
                if v.verdict in ("regressed", "improved"):
                    alarms.append({"case": case, "old": old, "new": new, "verdict": v.verdict, "ratio": v.ratio})
        variants = {}
        for label in sorted(label for label in runs if not _is_a(label)):
            cases = {}
            for case in sorted(runs[label]):
                case_settings = m.gate_settings(group, runs[label][case][2])
                verdicts = [significance.decide(runs[a][case][1], runs[label][case][1], case_settings, case, group)
                            for a in a_labels if case in runs[a]]
                if verdicts:
                    ratios = [v.ratio for v in verdicts]
                    cases[case] = {"mean_ratio": sum(ratios) / len(ratios), "ratios": ratios,
                                   "regressed": sum(v.verdict == "regressed" for v in verdicts),
                                   "inconclusive": sum(v.verdict == "inconclusive" for v in verdicts),
                                   "comparisons": len(verdicts)}
            variants[label] = cases
        slowed = [c for cases in variants.values() for c in cases.values() if c["mean_ratio"] > 1]
        always = [c["mean_ratio"] for c in slowed if c["regressed"] == c["comparisons"]]
        missed = [c["mean_ratio"] for c in slowed if c["regressed"] < c["comparisons"]]
        finite = [r for r in aa_ratios if not math.isnan(r)]
        result[group] = {
            "settings": {"min_effect": settings.min_effect, "alpha": settings.alpha,
                         "min_abs_effect_s": settings.min_abs_effect_s},
            "case_overrides": [{"match": match, "settings": dataclasses.asdict(over)}
                               for case_group, match, over in m.regression_cases if case_group == group],
            "a_runs": a_labels, "aa_comparisons": compared, "aa_false_alarms": alarms, "aa_inconclusive": undecided,
            "aa_largest_change": max((abs(r - 1) for r in finite), default=None),
            "variants": variants,
            "smallest_slowdown_always_detected": min(always, default=None),
            "largest_slowdown_missed": max(missed, default=None),
        }
    if not result:
        raise ValueError(f"{folder}: no <group>{SEPARATOR}<label>.json runs")
    return result


def markdown(result: dict) -> str:
    """Two tables: per group A/A false alarms and the detection bounds; per variant case, ratio and detections."""

    def pct(x):
        return "-" if x is None else f"{(x - 1) * 100:+.1f}%"

    lines = ["| group | min effect, alpha | A runs | A/A comparisons | false alarms | inconclusive | largest A/A change | "
             "smallest slowdown detected every time | largest slowdown missed |", "|---|---|---|---|---|---|---|---|---|"]
    for group, g in result.items():
        largest = "-" if g["aa_largest_change"] is None else f"{g['aa_largest_change'] * 100:.1f}%"
        overrides = "".join(f"; {', '.join(f'{k} {v}' for k, v in o['match'].items())}: "
                            f"{matrix.GateSettings(**o['settings']).label()}" for o in g.get("case_overrides", []))
        lines.append(f"| {group} | {matrix.GateSettings(**g['settings']).label()}{overrides} | {len(g['a_runs'])} | "
                     f"{g['aa_comparisons']} | {len(g['aa_false_alarms'])} | {g['aa_inconclusive']} | {largest} | "
                     f"{pct(g['smallest_slowdown_always_detected'])} | {pct(g['largest_slowdown_missed'])} |")
    lines += ["", "| group | variant | case | mean new / A (median) | regressed in | inconclusive in |",
              "|---|---|---|---|---|---|"]
    for group, g in result.items():
        for label, cases in g["variants"].items():
            for case, c in cases.items():
                lines.append(f"| {group} | {label} | {case} | {c['mean_ratio']:.3f} | "
                             f"{c['regressed']} / {c['comparisons']} | {c['inconclusive']} / {c['comparisons']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.reporting.calibration", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the A and variant sessions of each group")
    r.add_argument("--groups", required=True, help="comma-separated perf groups")
    r.add_argument("--repeats", type=int, default=3, help="A runs per group (>= 2)")
    r.add_argument("--variant", action="append", default=[], help="label:NAME=VALUE[,NAME=VALUE] (repeatable)")
    r.add_argument("--out", required=True, help="folder for the runs and calibration.json")
    r.add_argument("--profile", default="gpu", choices=matrix.PROFILES)
    r.add_argument("--matrix", default=str(matrix.DEFAULT_PATH))
    r.add_argument("--pytest-command", default=f"{sys.executable} -m pytest")
    r.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (e.g. -k ...)")
    a = sub.add_parser("analyze", help="false alarms and detections of a calibration folder")
    a.add_argument("folder")
    a.add_argument("--matrix", default=str(matrix.DEFAULT_PATH))
    a.add_argument("--json", help="write the tallies here")
    a.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    try:
        result = analyze(Path(args.folder), matrix.load(args.matrix))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = markdown(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
