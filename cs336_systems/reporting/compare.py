"""Two saved runs side by side: ``python -m cs336_systems.report --compare OLD.json NEW.json``.

Cases are paired by pytest node id (``fullname``): old and new median, delta % = (new - old) / old,
flagged beyond the threshold, and the cases found in one run only.  Where both runs kept a case's per-round
times (``stats.data``), the statistical gate's verdict follows (`significance`: regressed, improved,
unchanged or inconclusive, with the ratio's interval and the p-values).  Runs whose machine facts differ in
machine.COMPARABLE_FIELDS are refused (`IncomparableRuns`) unless ``any_machine``: absolute times do not
transfer between machines.  The report names each run's commit, marked "(dirty)" (with a warning) for a
run saved from a work tree with uncommitted changes, whose times cannot be traced to code.
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.bench.machine import COMPARABLE_FIELDS
from cs336_systems.reporting.run_files import read_run
from cs336_systems.reporting.tables import commit_label, fmt_duration, md_table

COMPARE_THRESHOLD_PERCENT = 10.0


class IncomparableRuns(ValueError):
    """Two runs whose machine facts differ in COMPARABLE_FIELDS (absolute times do not transfer)."""


def load_cases(path: str | Path) -> tuple[dict, dict[str, dict]]:
    """(machine facts plus "commit", {fullname: {"name", "status", "median_s"}}) of one saved run; OOM cases
    included.  "commit" is `tables.commit_label`: the short id, "(dirty)" for uncommitted changes.

    Cases are keyed by pytest's node id (``fullname``), which names the test file, function and
    parameters, so the same case pairs up across runs; a later duplicate replaces an earlier one.
    """
    data = read_run(path)
    cases: dict[str, dict] = {}
    for bench in data.get("benchmarks", []):
        key = bench.get("fullname") or bench.get("name", "")
        cases[key] = {"name": bench.get("name", key), "status": bench.get("extra_info", {}).get("status", "ok"),
                      "median_s": bench.get("stats", {}).get("median"), "samples": bench.get("stats", {}).get("data"),
                      "fields": bench.get("extra_info", {})}
    for oom in data.get("oom", []):
        key = oom.get("fullname") or oom.get("name", "")
        cases[key] = {"name": oom.get("name", key), "status": "oom", "median_s": None}
    return {**data.get("machine_info", {}).get("cs336_systems", {}), "commit": commit_label(data)}, cases


def _fmt_case_time(case: dict) -> str:
    if case["status"] == "oom":
        return "OOM"
    return fmt_duration(case["median_s"])


def compare_runs(old: str | Path, new: str | Path, threshold: float = COMPARE_THRESHOLD_PERCENT,
                 any_machine: bool = False) -> str:
    """Markdown: per case present in both runs, old and new median, delta % = (new - old) / old x 100,
    flagged "slower" / "faster" when |delta| > ``threshold``; then the cases only in one run.

    Raises IncomparableRuns when the runs' machine facts differ in COMPARABLE_FIELDS, unless
    ``any_machine`` (then the differences head the report).
    """
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not threshold > 0:
        raise ValueError(f"threshold must be a positive percentage, got {threshold!r}")
    old_facts, old_cases = load_cases(old)
    new_facts, new_cases = load_cases(new)
    differences = [(f, old_facts.get(f), new_facts.get(f)) for f in COMPARABLE_FIELDS
                   if old_facts.get(f) != new_facts.get(f)]
    listed = "; ".join(f"{f}: {a!r} vs {b!r}" for f, a, b in differences)
    if differences and not any_machine:
        raise IncomparableRuns(f"runs {old} and {new} were measured on different machines ({listed}); "
                               "absolute times do not transfer. Pass --any-machine to compare anyway.")
    lines = [f"# Comparison: {old} -> {new}", "",
             md_table(["run", "file", "commit"], [["old", str(old), old_facts["commit"]],
                                                   ["new", str(new), new_facts["commit"]]]), ""]
    dirty = [f"{which} ({path})" for which, path, facts in (("old", old, old_facts), ("new", new, new_facts))
             if facts["commit"].endswith("(dirty)")]
    if dirty:
        lines += [f"**Warning: {' and '.join(dirty)} saved from a work tree with uncommitted changes: "
                  "its times cannot be traced to code.**", ""]
    if differences:
        lines += [f"**Warning: different machines ({listed}); absolute times do not transfer.**", ""]
    rows, flagged = [], {"slower": 0, "faster": 0}
    paired = [key for key in old_cases if key in new_cases]
    names = [old_cases[key]["name"] for key in paired]
    for key in paired:
        before, after = old_cases[key], new_cases[key]
        a, b = before["median_s"], after["median_s"]
        delta = 100 * (b - a) / a if a and b is not None and before["status"] == after["status"] == "ok" else None
        flag = ""
        if delta is not None and abs(delta) > threshold:
            flag = "slower" if delta > 0 else "faster"
            flagged[flag] += 1
        elif before["status"] != after["status"]:
            flag = f"{before['status']} -> {after['status']}"
        label = before["name"] if names.count(before["name"]) == 1 else key  # same test name in two files
        rows.append([label, _fmt_case_time(before), _fmt_case_time(after),
                     "-" if delta is None else f"{delta:+.1f}%", flag])
    lines += [f"{len(rows)} cases in both runs; beyond ±{threshold:g}%: {flagged['slower']} slower, "
              f"{flagged['faster']} faster. Delta = (new − old) ÷ old median.", ""]
    if rows:
        lines += [md_table(["case", "old median", "new median", "delta", f"beyond ±{threshold:g}%"], rows), ""]
    sampled = [key for key in paired if old_cases[key]["samples"] and new_cases[key]["samples"]
               and old_cases[key]["status"] == new_cases[key]["status"] == "ok"]
    if sampled:  # both runs kept their per-round times: the statistical gate's verdicts too
        from cs336_systems.bench import matrix
        from cs336_systems.reporting import significance

        verdicts = significance.compare({k: old_cases[k]["samples"] for k in sampled},
                                        {k: new_cases[k]["samples"] for k in sampled},
                                        {k: new_cases[k]["fields"] for k in sampled},
                                        matrix.load(matrix.DEFAULT_PATH).gate_settings)
        lines += ["## Statistical verdicts (per-round samples; benchmarks.json \"regression\")", "",
                  significance.summary(verdicts), "", significance.table(verdicts), ""]
    for title, only in (("Only in the old run", [k for k in old_cases if k not in new_cases]),
                        ("Only in the new run", [k for k in new_cases if k not in old_cases])):
        if only:
            lines += [f"## {title}", ""] + [f"- `{k}`" for k in only] + [""]
    return "\n".join(lines)
