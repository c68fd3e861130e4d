"""Reading saved pytest-benchmark runs of this project's perf suite, with errors a CLI can print as is."""

from __future__ import annotations

import json
import math
from pathlib import Path


class RunFileError(ValueError):
    """A file that cannot be read as a saved run of this project's perf suite; the message names it."""


def read_run(path: str | Path) -> dict:
    """The decoded JSON of a saved run: an object with a "benchmarks" list and ``machine_info.cs336_systems``
    (what ``perf/conftest.py`` records), else RunFileError saying which file and why."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: not a readable pytest-benchmark JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise RunFileError(f"{path}: not a pytest-benchmark run (expected an object with a 'benchmarks' list)")
    facts = data.get("machine_info")
    if not isinstance(facts, dict) or not isinstance(facts.get("cs336_systems"), dict):
        raise RunFileError(f"{path}: no machine_info.cs336_systems (not saved by this project's perf suite)")
    return data


# The statistics the reports, gates and baselines read: each a finite number >= 0 where a case has it.
STAT_FIELDS = ("min", "max", "mean", "median", "stddev", "iqr", "q1", "q3")


def check_stats(source: str | Path, name: str, stats: object) -> None:
    """A timed case's statistics: an object with a median, every statistic it has a finite number >= 0 and its
    per-round times (``data``), where kept, a list of such numbers; else RunFileError naming the file and the case (a table would show nan, a comparison crash or pass)."""
    if not isinstance(stats, dict) or "median" not in stats:
        raise RunFileError(f"{source}: case {name} has no statistics (expected stats.median)")
    for field in STAT_FIELDS:
        value = stats.get(field, 0.0)
        if not _time(value):
            raise RunFileError(f"{source}: case {name}: stats.{field} is {value!r}, not a finite number >= 0")
    samples = stats.get("data")
    if samples is not None and not (isinstance(samples, list) and all(map(_time, samples))):
        raise RunFileError(f"{source}: case {name}: stats.data (the per-round times) is not a list of finite "
                           "numbers >= 0")


def _time(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def rounded_samples(record: dict) -> dict:
    """The benchmark record with its per-round times (``stats.data``, what the statistical gate tests) kept to
    four significant digits (`significance.rounded`), or as it is when the run dropped them."""
    from cs336_systems.reporting import significance  # (numpy: only when asked)

    stats = record.get("stats") or {}
    if not isinstance(stats.get("data"), list):
        return record
    return {**record, "stats": {**stats, "data": significance.rounded(stats["data"])}}


def compact(path: str | Path) -> tuple[int, int]:
    """Rewrite a saved run in place as the results tree keeps it: JSON without indentation, each case's
    per-round times (``stats.data``) to four significant digits (what baselines keep and the statistical
    gate tests; the statistics pytest-benchmark computed from the full-precision times stay as they are).
    Returns the sizes in bytes before and after."""
    path = Path(path)
    before = path.stat().st_size
    data = read_run(path)
    for bench in data["benchmarks"]:
        if isinstance(bench.get("stats"), dict):
            check_stats(path, bench.get("name", "?"), bench["stats"])
    data["benchmarks"] = [rounded_samples(bench) for bench in data["benchmarks"]]
    text = json.dumps(data, separators=(",", ":")) + "\n"
    path.write_text(text)
    return before, len(text.encode())


def main(argv: list[str] | None = None) -> int:
    """``python -m cs336_systems.reporting.run_files --compact RUN.json ...``: `compact` each run."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cs336_systems.reporting.run_files", description=main.__doc__)
    parser.add_argument("--compact", nargs="+", required=True, metavar="RUN", help="saved runs to rewrite")
    args = parser.parse_args(argv)
    for path in args.compact:
        try:
            before, after = compact(path)
        except RunFileError as exc:
            print(f"error: {exc}")
            return 2
        print(f"{path}: {before} -> {after} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
