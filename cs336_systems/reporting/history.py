"""Headline cases across the history of the committed runs: ``cs336-report --history results/<gpu>/``.

A results folder holds the newest run of each suite (A/B runs live in its ``experiments/``, not read here); git
holds the ones before.  For every run file of the folder this reads each version git has of it, oldest first, and for each case
whose test id contains one of ``cases`` (default: the compiled forward+backward leaderboard and end-to-end
cases) lists the median per version with the commit the run measured (its own ``commit_info``), the
change against the version before, and a step mark (`mark_steps`): the median leaves the level of the
versions since the last step by more than ``threshold`` (default 10%) and the next version stays beyond it.
A slow drift shows as a run of small changes in one direction; a step as one mark.

Versions measured on different machines or software (`bench.machine.COMPARABLE_FIELDS`) are kept apart:
each (file, machine) pair is its own series, since absolute times do not transfer.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import textwrap
from pathlib import Path

from cs336_systems.bench.machine import COMPARABLE_FIELDS
from cs336_systems.reporting import plots
from cs336_systems.reporting.run_files import RunFileError

DEFAULT_CASES = ("leaderboard[flash-triton", "end_to_end[")
DEFAULT_THRESHOLD = 10.0


def _git(args: list[str], cwd: Path) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise RunFileError(f"git {' '.join(args)} in {cwd}: {str(detail).strip()}") from None


def file_versions(path: Path) -> list[tuple[str, dict]]:
    """(commit that committed it, decoded run) for each version git holds of ``path``, oldest first; versions
    that are not a saved run are left out."""
    path = path.resolve()
    root = Path(_git(["rev-parse", "--show-toplevel"], path.parent).strip())
    relative = path.relative_to(root).as_posix()
    versions = []
    for commit in _git(["log", "--format=%H", "--reverse", "--", relative], root).split():
        try:
            data = json.loads(_git(["show", f"{commit}:{relative}"], root))
        except (RunFileError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("benchmarks"), list):
            versions.append((commit, data))
    return versions


def _median_ms(record: dict) -> float | None:
    value = (record.get("stats") or {}).get("median")
    return value * 1e3 if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def series(folder: Path, cases: tuple[str, ...] = DEFAULT_CASES) -> dict[tuple[str, str, str], list[dict]]:
    """(file, machine label, case) -> its points in commit order: {commit, date, median_ms}.  A version that
    repeats the measurement before it (same measured commit and time) is left out; a run saved without a
    commit shows the commit that added it, in parentheses."""
    out: dict[tuple[str, str, str], list[dict]] = {}
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise RunFileError(f"{folder}: no saved runs (*.json)")
    for path in files:
        seen = set()
        for commit, run in file_versions(path):
            facts = (run.get("machine_info") or {}).get("cs336_systems") or {}
            machine = ", ".join(str(facts.get(f)) for f in COMPARABLE_FIELDS)
            measured_id = (run.get("commit_info") or {}).get("id")
            identity = (measured_id, run.get("datetime"))
            if identity in seen:  # the same measurement committed again (e.g. with its samples dropped)
                continue
            seen.add(identity)
            # the commit the run measured; a run saved without one: the commit that added it, marked
            measured = measured_id[:7] if measured_id else f"({commit[:7]})"
            for record in run["benchmarks"]:
                name = record.get("name", "")
                median = _median_ms(record)
                if median is None or not any(c in name for c in cases):
                    continue
                out.setdefault((path.name, machine, name), []).append(
                    {"commit": measured, "date": str(run.get("datetime", ""))[:10], "median_ms": median})
    return out


def mark_steps(points: list[dict], threshold: float) -> list[dict]:
    """Each point with "change" (fraction against the point before; None for the first) and "step": the median
    leaves the current level (the median of the points since the last step, spikes left out) by more than
    ``threshold`` percent, and the next point is beyond it on the same side too (or there is no next point).
    A spike that the next point undoes is neither a step nor part of the level."""
    limit = threshold / 100.0
    level_points: list[float] = []
    for i, point in enumerate(points):
        value = point["median_ms"]
        point["change"] = None if i == 0 else value / points[i - 1]["median_ms"] - 1.0
        point["step"] = False
        if not level_points:
            level_points.append(value)
            continue
        level = statistics.median(level_points)
        off = value / level - 1.0
        if abs(off) <= limit:
            level_points.append(value)
            continue
        following = points[i + 1]["median_ms"] / level - 1.0 if i + 1 < len(points) else off
        if abs(following) > limit and (following > 0) == (off > 0):
            point["step"] = True
            level_points = [value]
    return points


def _plot(file: str, name: str, points: list[dict]) -> plots.Plot:
    def draw(fig) -> None:
        fig.set_size_inches(max(4.2, 0.6 * len(points) + 2), 3.4)
        ax = fig.add_subplot()
        xs = list(range(len(points)))
        ax.plot(xs, [p["median_ms"] for p in points], marker="o")
        steps = [i for i, p in enumerate(points) if p["step"]]
        ax.scatter(steps, [points[i]["median_ms"] for i in steps], s=120, facecolors="none", edgecolors="red",
                   label="step", zorder=3)
        ax.set_xticks(xs, [p["commit"] for p in points], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("median ms")
        ax.set_title("\n".join(textwrap.wrap(name, 70)), fontsize=8)
        if steps:
            ax.legend(fontsize=7)

    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"history-{file.removesuffix('.json')}-{name}").strip("-").lower()
    return plots.Plot(slug + ".png", name, draw)


def render_history(folder: Path, cases: tuple[str, ...] = DEFAULT_CASES, threshold: float = DEFAULT_THRESHOLD,
                   plots_dir: str | Path | None = None, link_base: str | Path | None = None) -> str:
    """The Markdown history of ``folder``'s headline cases (module docstring); with ``plots_dir``, one PNG a
    case too, linked under its table (relative to ``link_base``)."""
    lines = [f"# History of {folder}", "",
             f"Median per committed version of each run file, oldest first; step: the median leaves the level "
             f"since the last step by more than {threshold:g}% and the next version stays beyond it.", ""]
    found = series(Path(folder), cases)
    if not found:
        raise RunFileError(f"{folder}: no case whose id contains any of {', '.join(cases)} in any version")
    drawn = []
    for (file, machine, name), points in sorted(found.items()):
        if len(points) < 2:
            continue
        lines += [f"## {name}", "", f"`{file}`; {machine}", "", "| commit | date | median ms | vs before | |",
                  "|---|---|---|---|---|"]
        for p in mark_steps(points, threshold):
            change = "" if p["change"] is None else f"{p['change'] * 100:+.1f}%"
            lines.append(f"| {p['commit']} | {p['date']} | {p['median_ms']:.3f} | {change} | "
                         f"{'**step**' if p['step'] else ''} |")
        lines.append("")
        if plots_dir is not None:
            plot = _plot(file, name, points)
            drawn.append(plot)
            target = Path(plots_dir) / plot.filename
            link = Path(os.path.relpath(target, link_base if link_base is not None else Path.cwd()))
            lines += [f"![{name}]({link.as_posix()})", ""]
    if len(lines) == 4:
        lines.append("No case has more than one committed version.")
    if drawn:
        plots.write_plots(drawn, plots_dir)
    return "\n".join(lines) + "\n"
