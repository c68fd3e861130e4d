"""In-run ratio gates: "implementation A is at most r x implementation B", checked on one run's data.

A gate in benchmarks.json::

    {"name": "flash beats SDPA FA2", "suite": "leaderboard",
     "where": {"mode": "forward-backward"},                  # optional: both sides must match these
     "numerator": {"impl": "flash-triton", "compile": true},
     "denominator": {"impl": "sdpa-flash", "compile": false},
     "max_ratio": 0.80, "statistic": "median"}

Every case of ``suite`` matching ``where`` and ``numerator`` is paired with the case that matches
``where`` and ``denominator`` and agrees with it on every other case field (fields named by either side,
and bookkeeping fields like group, warm-up and rounds, are not compared).  Each pair's time ratio must be
<= max_ratio.  If two denominator cases agree on every compared field (they differ only in a field one
side names, or in a bookkeeping field), the pairing is ambiguous and evaluation raises ValueError naming
the fields, rather than dividing by whichever came last.  Ratios measured in the same run hold across
machines where absolute times do not, which is why gates compare cases of one run and never a saved
baseline.

A gate none of whose pairs ran (another profile, a skipped or OOM case) is reported as "not measured",
not as a pass or a failure.

    python -m cs336_systems.gates RUN.json [--matrix benchmarks.json]   # exit 1 if a gate is violated
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cs336_systems.bench import matrix
from cs336_systems.reporting.run_files import read_run

# Case fields that describe how a case was measured, not what: never used to pair cases.
BOOKKEEPING = {"group", "warmup", "rounds", "suite", "device", "status"}


@dataclass(frozen=True)
class Check:
    gate: str
    case: str  # the fields the pair shares, as text
    ratio: float | None  # None: the gate had no measured pair
    max_ratio: float

    @property
    def ok(self) -> bool:
        return self.ratio is None or self.ratio <= self.max_ratio


def _matches(case: dict, fields: dict) -> bool:
    return all(case.get(k) == v for k, v in fields.items())


def evaluate(gates: list[dict], entries: list[dict], case_fields: set[str]) -> list[Check]:
    """Check ``gates`` against ``entries``: dicts with "suite", the case fields and "stats" (seconds).

    ``case_fields`` are the fields that identify a case (everything else in an entry is a result).
    """
    checks = []
    for gate in gates:
        where = gate.get("where", {})
        named = set(gate["numerator"]) | set(gate["denominator"]) | set(where)
        shared = sorted(case_fields - named - BOOKKEEPING)
        statistic = gate.get("statistic", "median")
        suite = [e for e in entries if e.get("suite") == gate["suite"] and _matches(e, where)]
        denominators: dict[tuple, dict] = {}
        for e in suite:
            if not _matches(e, gate["denominator"]):
                continue
            key = tuple(e.get(f) for f in shared)
            if key in denominators:  # pairing would depend on file order: make the gate say which one
                other = denominators[key]
                differ = sorted(f for f in case_fields if e.get(f) != other.get(f))
                raise ValueError(
                    f"gate {gate['name']!r}: several denominator cases share the pairing fields and differ only "
                    f"in {differ}; name the one to divide by in the gate's 'denominator' or 'where'")
            denominators[key] = e
        found = False
        for entry in suite:
            if not _matches(entry, gate["numerator"]):
                continue
            key = tuple(entry.get(f) for f in shared)
            base = denominators.get(key)
            if base is None:
                continue
            found = True
            label = ", ".join(f"{f}={v}" for f, v in zip(shared, key) if v is not None)
            num, den = entry["stats"].get(statistic), base["stats"].get(statistic)
            if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or den <= 0:
                raise ValueError(f"gate {gate['name']!r} ({label}): {statistic} is {num!r} / {den!r}; "
                                 "a ratio needs two times and a positive denominator")
            ratio = num / den
            checks.append(Check(gate["name"], label, ratio, gate["max_ratio"]))
        if not found:
            checks.append(Check(gate["name"], "not measured", None, gate["max_ratio"]))
    return checks


def table(checks: list[Check]) -> str:
    """Markdown table: gate, case, observed ratio, allowed ratio, verdict."""
    lines = ["| gate | case | observed | allowed | |", "|---|---|---|---|---|"]
    for c in checks:
        observed = "-" if c.ratio is None else f"{c.ratio:.3f}"
        verdict = "not measured" if c.ratio is None else ("ok" if c.ok else "VIOLATED")
        lines.append(f"| {c.gate} | {c.case} | {observed} | {c.max_ratio:.3f} | {verdict} |")
    return "\n".join(lines)


def entries_from_json(data: dict) -> list[dict]:
    """Timed cases of a saved pytest-benchmark run, as gate entries."""
    return [
        {**b.get("extra_info", {}), "stats": b["stats"]}
        for b in data.get("benchmarks", [])
        if b.get("extra_info", {}).get("status", "ok") == "ok" and "suite" in b.get("extra_info", {})
    ]


def case_fields_of(m: matrix.Matrix) -> set[str]:
    """Every case field any suite of the matrix can produce."""
    return {field for suite in m.suites for field in matrix.case_fields(suite)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a saved pytest-benchmark JSON file")
    parser.add_argument("--matrix", default=str(matrix.DEFAULT_PATH), help="benchmarks.json with the gates")
    args = parser.parse_args(argv)
    try:
        m = matrix.load(args.matrix)
        checks = evaluate(m.gates, entries_from_json(read_run(args.run)), case_fields_of(m))
    except (ValueError, OSError) as exc:  # unreadable run or matrix, an ambiguous gate, a zero statistic
        print(f"gates: {exc}")
        return 2
    print(table(checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
