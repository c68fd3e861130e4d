"""In-run ratio gates: "implementation A is at most r x implementation B", checked on one run's data.

A gate in benchmarks.json::

    {"name": "flash beats SDPA FA2", "suite": "leaderboard",
     "where": {"mode": "forward-backward"},                  # optional: both sides must match these
     "numerator": {"impl": "flash-triton", "compile": true},
     "denominator": {"impl": "sdpa-flash", "compile": false},
     "max_ratio": 0.80, "statistic": "median"}

``statistic``: a time statistic of the cases ("median", the default; "mean"; "min"), or "peak_memory_gib",
the peak memory of the measured rounds (a gate such as "our peak memory <= 1.00x the baseline's").

Pairing.  Every case of ``suite`` matching ``where`` and ``numerator`` is paired with the case that matches
``where`` and ``denominator`` and agrees with it on every other case field (fields named by either side,
and bookkeeping fields like group, warm-up and rounds, are not compared).  If two denominator cases agree
on every compared field, the pairing is ambiguous and evaluation raises ValueError naming the fields,
rather than dividing by whichever came last.  Ratios measured in the same run hold across machines where
absolute times do not, which is why gates compare cases of one run and never a saved baseline.

Which pairs a run owes.  Pairs are formed from the cases the run *selected* (the profile's grids, less
what ``--perf-group``, ``-k`` or the test files given left out), not from the cases that happened to
produce a time.  So a gate needs the perf groups whose grids hold its pairs (`needed_groups`), and:

* every selected pair must be timed, and its ratio must be <= max_ratio;
* a selected pair with a side that has no time (OOM, skipped as unavailable, failed, not run) fails the
  gate as NOT MEASURED, with the reason;
* a gate with no selected pair (its groups not selected, or no such case in the profile) is listed as
  "not applicable": neither passed nor failed.

What a gate does not guarantee: that the cases are fast in absolute terms (that is the baseline
comparison's job), that a ratio is stable beyond the run-to-run spread of its two cases, or anything
about groups the run did not select.

    python -m cs336_systems.gates RUN.json [--matrix benchmarks.json] [--allow-empty]
        exit 0: every applicable pair measured and within its bound; 1: a pair violated or not measured, or
        no gate applies to the run (nothing was checked; --allow-empty makes that exit 0);
        2: unreadable or empty run, a case without statistics, an ambiguous gate
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from cs336_systems.bench import matrix
from cs336_systems.reporting.run_files import read_run

# Case fields that describe how a case was measured, not what: never used to pair cases.
BOOKKEEPING = {"group", "warmup", "rounds", "suite", "device", "status"}
STATISTICS = ("median", "mean", "min")
# Gates may also bound a measured quantity other than time: a field of the case's results (extra_info).
RESULT_STATISTICS = ("peak_memory_gib",)


@dataclass(frozen=True)
class Check:
    """One pair of one gate (or one line for a gate with no selected pair)."""

    gate: str
    case: str  # the fields the pair shares, as text; for a gate without pairs, why
    ratio: float | None  # None: no ratio (see problem / applicable)
    max_ratio: float
    problem: str | None = None  # why a pair the run selected has no ratio: fails the gate
    applicable: bool = True  # False: the run selected none of the gate's cases

    @property
    def verdict(self) -> str:
        if not self.applicable:
            return "not applicable"
        if self.ratio is None:
            return "NOT MEASURED"
        return "ok" if self.ratio <= self.max_ratio else "VIOLATED"

    @property
    def ok(self) -> bool:
        """Passed or not applicable; a violated or unmeasured pair is not ok."""
        return self.verdict in ("ok", "not applicable")


@dataclass
class RunCases:
    """What one run set out to measure and what became of it.

    ``selected``: the cases the run selected (case fields plus "suite"); ``timed``: the cases with a time
    (case fields, "suite" and "stats" in seconds); ``reasons``: `case_key` -> why a selected case has no
    time ("OOM: ...", "skipped: ...", "failed: ..."); ``groups``: the perf groups the run selected, if known.
    """

    selected: list[dict]
    timed: list[dict]
    reasons: dict[tuple, str] = field(default_factory=dict)
    groups: list[str] | None = None


def case_key(case: dict) -> tuple[str, str]:
    """(suite, test id): a case's identity, the same in the matrix, a session and a saved run."""
    return case.get("suite", ""), matrix.case_id(case)


def _matches(case: dict, fields: dict) -> bool:
    return all(case.get(k) == v for k, v in fields.items())


def pairs(gate: dict, cases: list[dict], case_fields: set[str]) -> list[tuple[dict, dict, str]]:
    """(numerator case, denominator case, shared fields as text) for every numerator case of ``gate`` among
    ``cases`` that has a denominator twin; ValueError if a twin is ambiguous."""
    where = gate.get("where", {})
    named = set(gate["numerator"]) | set(gate["denominator"]) | set(where)
    shared = sorted(case_fields - named - BOOKKEEPING)
    suite = [c for c in cases if c.get("suite") == gate["suite"] and _matches(c, where)]
    denominators: dict[tuple, dict] = {}
    for case in suite:
        if not _matches(case, gate["denominator"]):
            continue
        key = tuple(case.get(f) for f in shared)
        if key in denominators and case_key(denominators[key]) != case_key(case):
            other = denominators[key]
            differ = sorted(f for f in case_fields if case.get(f) != other.get(f))
            raise ValueError(
                f"gate {gate['name']!r}: several denominator cases share the pairing fields and differ only "
                f"in {differ}; name the one to divide by in the gate's 'denominator' or 'where'")
        denominators[key] = case
    found = []
    for case in suite:
        if not _matches(case, gate["numerator"]):
            continue
        key = tuple(case.get(f) for f in shared)
        if key in denominators:
            label = ", ".join(f"{f}={v}" for f, v in zip(shared, key) if v is not None)
            found.append((case, denominators[key], label))
    return found


def needed_groups(gate: dict, profile_cases: list[dict], case_fields: set[str]) -> list[str]:
    """The perf groups whose grids hold the gate's pairs among a profile's cases (``profile_cases``)."""
    groups = {c.get("group") for num, den, _ in pairs(gate, profile_cases, case_fields) for c in (num, den)}
    return sorted(g for g in groups if g)


def evaluate(gates: list[dict], run: RunCases | list[dict], case_fields: set[str],
             profile_cases: list[dict] | None = None) -> list[Check]:
    """Check ``gates`` against one run (see the module docstring for the rules).

    ``run``: a RunCases, or a plain list of timed entries, which is then also the whole selection.
    ``case_fields``: the fields that identify a case (everything else in an entry is a result).
    ``profile_cases``: every case of the run's profile, only to name the groups a not-applicable gate needs.
    """
    if not isinstance(run, RunCases):
        run = RunCases(list(run), list(run))
    timed = {case_key(e): e for e in run.timed}
    checks = []
    for gate in gates:
        statistic, bound = gate.get("statistic", "median"), gate["max_ratio"]
        selected = pairs(gate, list({case_key(c): c for c in run.selected}.values()), case_fields)
        if not selected:
            checks.append(Check(gate["name"], _why_not_applicable(gate, run, case_fields, profile_cases), None,
                                bound, applicable=False))
            continue
        for num, den, label in selected:
            sides = (("numerator", num, timed.get(case_key(num))), ("denominator", den, timed.get(case_key(den))))
            missing = [f"{side} {matrix.case_id(case)}: {run.reasons.get(case_key(case), 'not run')}"
                       for side, case, entry in sides if entry is None]
            if missing:
                checks.append(Check(gate["name"], label, None, bound, problem="; ".join(missing)))
                continue
            a, b = (_statistic(entry, statistic) for _, _, entry in sides)
            unrecorded = [f"{side} {matrix.case_id(case)}: no {statistic} recorded" for (side, case, _), value
                          in zip(sides, (a, b)) if statistic in RESULT_STATISTICS and value is None]
            if unrecorded:  # e.g. peak memory on a device that reports none: this pair cannot be judged
                checks.append(Check(gate["name"], label, None, bound, problem="; ".join(unrecorded)))
                continue
            if not _is_time(a) or not _is_time(b) or b <= 0:
                raise ValueError(f"gate {gate['name']!r} ({label}): {statistic} is {a!r} / {b!r}; "
                                 "a ratio needs two non-negative values and a positive denominator")
            checks.append(Check(gate["name"], label, a / b, bound))
    return checks


def _statistic(entry: dict, statistic: str) -> object:
    """A time statistic from the entry's stats, or a result field (`RESULT_STATISTICS`) from the entry."""
    return entry.get(statistic) if statistic in RESULT_STATISTICS else entry["stats"].get(statistic)


def _why_not_applicable(gate: dict, run: RunCases, case_fields: set[str], profile_cases: list[dict] | None) -> str:
    needed = needed_groups(gate, profile_cases, case_fields) if profile_cases else []
    if not needed:
        return "no case of this run's selection"
    chosen = [g for g in needed if g in (run.groups or ())]
    if chosen:
        return f"group {', '.join(chosen)} selected, but the gate's cases deselected (-k, -m or the files given)"
    return f"needs group {' or '.join(needed)}, not selected"


def _is_time(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def summary(checks: list[Check]) -> str:
    """One line: how many pairs hold, failed, or gates do not apply."""
    bad = [c for c in checks if not c.ok]
    held = sum(c.verdict == "ok" for c in checks)
    idle = sum(not c.applicable for c in checks)
    if bad:
        violated = sum(c.verdict == "VIOLATED" for c in bad)
        parts = [f"{n} {what}" for n, what in ((violated, "violated"), (len(bad) - violated, "not measured")) if n]
        return "ratio gates: " + ", ".join(parts)
    if held:
        return f"ratio gates: all {held} measured pairs hold" + (f" ({idle} gate(s) not applicable)" if idle else "")
    return "ratio gates: none applies to this run"


def table(checks: list[Check]) -> str:
    """Markdown table: gate, case, observed ratio, allowed ratio, verdict (with the reason when not measured)."""
    lines = ["| gate | case | observed | allowed | |", "|---|---|---|---|---|"]
    for c in checks:
        observed = "-" if c.ratio is None else f"{c.ratio:.3f}"
        verdict = c.verdict if c.problem is None else f"{c.verdict}: {_cell(c.problem)}"
        lines.append(f"| {c.gate} | {c.case} | {observed} | {c.max_ratio:.3f} | {verdict} |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + "..."


def case_fields_of(m: matrix.Matrix) -> set[str]:
    """Every case field any suite of the matrix can produce."""
    return {f for suite in m.suites for f in matrix.case_fields(suite)}


# --- saved runs --------------------------------------------------------------------------------------

def run_cases_from_json(data: dict, m: matrix.Matrix, source: str = "run") -> tuple[RunCases, str, list[str]]:
    """(RunCases, profile, groups) of a saved run; ValueError for a run gates cannot judge.

    The selection is the run's own record when it has one (its timed cases, ``oom`` and ``perf_not_timed``,
    written by perf/conftest.py); for runs saved before that record, the cases of its ``perf_profile`` in
    its ``perf_groups`` (or, lacking those, the groups its cases name), as benchmarks.json lists them now.
    """
    benchmarks = data.get("benchmarks", [])
    if not benchmarks:
        raise ValueError(f"{source}: no benchmarks; an empty run cannot pass or fail a gate")
    timed = []
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        stats = bench.get("stats")
        if not isinstance(stats, dict) or not any(_is_time(stats.get(s)) for s in STATISTICS):
            raise ValueError(f"{source}: benchmark {bench.get('fullname') or bench.get('name')!r} has no statistics "
                             "(stats with median / mean / min)")
        if "suite" in info and info.get("status", "ok") == "ok":
            timed.append({**info, "stats": stats})
    profile = data.get("perf_profile")
    if profile not in matrix.PROFILES:
        raise ValueError(f"{source}: perf_profile is {profile!r}, not one of {', '.join(matrix.PROFILES)}")
    ooms = [o.get("extra_info") or {} for o in data.get("oom", [])]
    reasons = {case_key(info): f"OOM: {o.get('error')}" for o, info in zip(data.get("oom", []), ooms)}
    present = sorted({c.get("group") for c in timed + ooms if c.get("group")})
    groups = data.get("perf_groups") or present
    if "perf_not_timed" in data:
        rest = data["perf_not_timed"]
        reasons.update({case_key(r.get("extra_info") or {}): r.get("reason", "not timed") for r in rest})
        selected = timed + [c for c in ooms if "suite" in c] + [r.get("extra_info") or {} for r in rest]
    else:
        selected = [{**c, "suite": s} for s in m.suites for c in m.cases(s, profile, set(groups))]
    return RunCases(selected, timed, reasons, list(groups)), profile, list(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a saved pytest-benchmark JSON file")
    parser.add_argument("--matrix", default=str(matrix.DEFAULT_PATH), help="benchmarks.json with the gates")
    parser.add_argument("--allow-empty", action="store_true",
                        help="exit 0 when no gate applies to the run (by default that fails: nothing was checked)")
    args = parser.parse_args(argv)
    try:
        m = matrix.load(args.matrix)
        run, profile, groups = run_cases_from_json(read_run(args.run), m, args.run)
        profile_cases = [{**c, "suite": s} for s in m.suites for c in m.cases(s, profile)]
        checks = evaluate(m.gates, run, case_fields_of(m), profile_cases)
    except (ValueError, OSError) as exc:  # unreadable or empty run or matrix, an ambiguous gate, a zero time
        print(f"gates: {exc}")
        return 2
    unknown = sorted(set(groups) - set(m.groups(profile)))
    print(f"{args.run}: profile {profile}, groups {', '.join(groups) or 'none'}")
    if unknown:
        print(f"note: groups not in the {profile} profile of {args.matrix}: {', '.join(unknown)}")
    print(summary(checks))
    print(table(checks))
    if not any(c.applicable for c in checks) and not args.allow_empty:
        print("gates: no gate applies to this run, so nothing was checked (exit 1); --allow-empty accepts that")
        return 1
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
