"""The repository speaks of the project only: no wording about how or where the work was done.

Code, comments, docstrings, docs, READMEs, benchmarks.json and the workflow state engineering facts (what
was measured, on which GPU and date, with which versions), never the development process around them:
numbered work sessions, tickets and their numbered requirements
("issue 7's target", "Must 2"), machine loans and their budgets, or notes and scratch folders that are not
part of the repository.  A number that came from elsewhere is named by what it is ("the 2xH200 NVLink
reference bandwidths", "target: bucketed <= 0.98x torch DDP").

pytest's and torch.distributed's own sessions are fine: "pytest session", ``scope="session"``,
``pytest_sessionstart``, "this pytest session", a torchrun job's session.

Scanned: the files git tracks (``git ls-files``; a walk of the tree where git is unavailable), except
binary files and the saved runs under results/ (their ``machine_info`` is recorded data), and except this
file, whose examples below are forbidden text on purpose.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".ico", ".gz", ".zip", ".whl", ".pt",
                   ".pth", ".bin", ".npy", ".npz", ".so", ".pyc", ".nsys-rep", ".ncu-rep", ".pickle", ".pkl"}
SKIP_DIRS = {".git", ".venv", ".venv-ci", ".ci-out", ".work", "__pycache__", ".pytest_cache", ".hypothesis",
             ".ruff_cache", ".benchmarks", "build", "dist", "node_modules"}

I, CASE = re.IGNORECASE, 0
ORDINALS = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            r"\d+(?:st|nd|rd|th)")
COLLECTIVE_WORDS = (r"all-|collectives?\b|reduces?\b|reduce-|gathers?\b|broadcasts?\b|kernels?\b|launch|"
                    r"copies\b|requests?\b|instructions?\b|loads?\b|stores?\b|times\b")


class Rule(NamedTuple):
    name: str
    pattern: re.Pattern
    forbidden: tuple[str, ...]  # each must match (self-check)


RULES = (
    Rule("numbered work session", re.compile(rf"\b(?:{ORDINALS})[ -]session\b(?![-_])", I),
         ("measured in the ninth sess" "ion", "the seventh sess" "ion's table", "Tenth sess" "ion, first round",
          "a 3rd-sess" "ion result")),
    Rule("work session by position",
         re.compile(r"\b(?:this|next|previous|later|earlier|last|prior)\s+session\b(?![-_])", I),
         ("left for the next sess" "ion", "in a later sess" "ion", "this sess" "ion's kernels", "the previous sess" "ion")),
    Rule("session number", re.compile(r"\bsession\s+#?\d+\b", I), ("measured in session 9", "Session 3:")),
    Rule("development session", re.compile(r"\b(?:development|dev|work|working)\s+sessions?\b", I),
         ("over three work sess" "ions", "a development sess" "ion")),
    Rule("numbered run or script of the history",
         re.compile(r"\b(?:[Rr]un\s+[b-h]|[Ss]cript\s+[A-D])\b(?![-'])", CASE),
         ("fp32: run f, the variants", "script B timed it", "(run d)")),
    Rule("machine loan", re.compile(r"\b(?:lent|loans?|leas(?:e|ed|es|ing))\b", I),
         ("on a lent H100", "the lease ran out", "a leased machine", "the loan ended")),
    Rule("device-time budget", re.compile(r"\btime budget\b|\bbudget_left", I),
         ("within the device time budget", "budget_left_s was 300")),
    # the words are split in the source so that this file does not spell what it forbids
    Rule("device tool output", re.compile(r"\$" r"OUT\b|\boutput" r"_tail\b|\bfiles" r"_at\b|\bdevice"
                                          r" (?:tool|machine)\b|\bprobe scripts?\b", CASE),
         ("copied to $" "OUT/trace.json", "see output" "_tail", "on the device" " machine", "ran the probe" " script")),
    Rule("numbered issue",  # not the verb: "ranks issue 2 all-reduces"
         re.compile(rf"(?<![A-Za-z])issues?[\s_]+#?\d+(?!\d)(?!\s*(?:x\s*)?(?:{COLLECTIVE_WORDS}))", I),
         ("repeats issue 7's sweep", "Issue 9: world 4", "(issue 7 tightens to 0.80)", "see issue #12",
          "def test_groups_cover_issue_7s_sweep():")),
    Rule("the issue as a source",
         re.compile(r"\bissue's\b|[(,]\s*issue\s*\)|(?<![A-Za-z])the_issue(?![A-Za-z])", I),
         ("the issue's 2xH200 numbers", "reference (issue) GB/s", "reference (2xH200, issue)",
          "Targets (issue): best", "def test_profiles_cover_the_issue_grid(data):")),
    Rule("numbered requirement", re.compile(r"\b(?:Must|MUST|Goal|GOAL|Should|SHOULD)\s+\d+\b", CASE),
         ("issue 7's Must 2", "meets Goal 3", "SHOULD 1")),
    Rule("the seeds' documents", re.compile(r"\bthe seeds'", CASE), ("the seeds' peak-memory table",)),
    Rule("notes outside the repository", re.compile(r"DEVELOPERS\.md|shared/DESIGN|\bDESIGN\.md\b|\bCEO\b", CASE),
         ("see DEVELOPERS.md", "shared/DESIGN.md says", "(DESIGN.md convention)", "asked by the CEO")),
    Rule("scratch folders and logs", re.compile(r"\bresults/[\w.-]+/(?:probes/|run-\d{4}-)|flash-attention-log\.md"),
         ("results/h100/probes/run-tune.sh", "results/h100/run-2026-11-22-tma/", "see flash-attention-log.md")),
)

# Legitimate text that no rule may match: pytest's and torch.distributed's vocabulary, and words that
# contain a forbidden one.
ALLOWED = (
    "the pytest session", 'scope="session"', "def pytest_sessionstart(session):", "session.config.stash",
    "this pytest session's timed cases", "the benchmark session", "a torchrun session", "the test session",
    "every rank runs the same session", "groups run in one session", "in isolated sessions", "benchmarksession",
    "ranks issue the same collectives in the same order", "every rank issues 2 all-reduces", "issue order",
    "issue active, % of cycles", "half the issue slots are idle", "tissue 7", "by_issue_order",
    "the memory is released", "released once packed",
    "please", "excellent", "silently", "a run on a quiet host", "run a ddp group", "run e2e cases", "run-time",
    "Run 2 ranks", "the 95 GB budget", "a recompile budget", "mixed-precision probes", "amp_probe.probe_dtypes",
    "the second round of warm-up", "must be one of", "the first sess" "ion-scoped fixture", "$" "OUT" "PUT_DIR",
    "docs/flash-attention.md", "results/h100/leaderboard.json", "random seeds", "the assignment's leaderboard",
)


def _git_files() -> list[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    return names or None


def _walked_files() -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in filenames:
            names.append((Path(dirpath) / name).relative_to(ROOT).as_posix())
    return sorted(names)


def _is_saved_run(name: str) -> bool:
    return name.startswith("results/") and name.endswith(".json")


def scanned_files() -> list[Path]:
    """Text files to check, as paths under ROOT (tracked files that exist in the working tree)."""
    names = _git_files() or _walked_files()
    out = []
    for name in names:
        path = ROOT / name
        if name == THIS or _is_saved_run(name) or Path(name).suffix.lower() in BINARY_SUFFIXES:
            continue
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        out.append(path)
    return out


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", "replace")


def find_hits(files: list[Path]) -> list[str]:
    hits = []
    for path in files:
        text = _read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for rule in RULES:
                match = rule.pattern.search(line)
                if match:
                    where = path.relative_to(ROOT).as_posix()
                    hits.append(f"{where}:{number}: {rule.name}: {match.group(0)!r} in {line.strip()[:160]!r}")
    return hits


def test_no_development_process_wording_in_the_repository():
    files = scanned_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # the listing itself works: a broken one would pass vacuously
    assert {"README.md", "benchmarks.json", "cs336_systems/__init__.py"} <= names, sorted(names)[:20]
    assert THIS not in names
    hits = find_hits(files)
    assert not hits, ("wording about the development process or its environment; state the engineering fact "
                      "instead (what was measured, where, when):\n" + "\n".join(hits))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_catches_its_examples(rule):
    for example in rule.forbidden:
        assert rule.pattern.search(example), (rule.name, example)


@pytest.mark.parametrize("text", ALLOWED)
def test_legitimate_wording_passes_every_rule(text):
    assert [r.name for r in RULES if r.pattern.search(text)] == [], text


def test_saved_runs_and_binaries_are_skipped_and_the_walk_matches_git(tmp_path):
    assert _is_saved_run("results/h100/leaderboard.json")
    assert _is_saved_run("results/h100/baselines/Linux-CPython-3.12-64bit/0001_baseline.json")
    assert not _is_saved_run("results/h100/README.md") and not _is_saved_run("benchmarks.json")
    binary = tmp_path / "x.dat"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\0\0 the ninth sess" b"ion")
    assert _read_text(binary) is None
    walked = set(_walked_files())
    assert "README.md" in walked and not any(n.startswith((".git/", ".venv/")) for n in walked)
    tracked = _git_files()
    if tracked is not None:  # every tracked text file still on disk is also found by the fallback walk
        missing = {n for n in tracked if (ROOT / n).is_file()} - walked
        assert not missing, sorted(missing)[:20]
