"""What every report table shares: saved runs -> entries, case identity, ordering, formatting.

An *entry* is one case of one saved run: its ``extra_info`` plus ``test``, ``run`` (the file), ``status``
(ok / oom) and ``stats`` (pytest-benchmark's, in seconds).

Ratios are taken within one saved run; where the denominator exists only in another run with the same
machine facts (GPU, count, driver, CUDA, torch, triton) the ratio is shown with a dagger (†), because
times drift between runs even on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from cs336_systems.bench.machine import COMPARABLE_FIELDS
from cs336_systems.bench.workloads.lm import DEFAULT_OPTIMIZER
from cs336_systems.reporting.run_files import check_stats, read_run

LM_FIELDS = ("size", "context", "batch_size", "mode", "precision", "compile", "attention")
# End-to-end axes added after runs were saved (the Linear layers' GEMM precision, packed documents): an entry
# saved before one existed measured its default.  Tables key and split on them; columns show them only where
# the entries vary.
LM_AXIS_DEFAULTS = {"linear_precision": "bf16", "packing": "none"}


MEASURED_BY = ("flush_l2", "timing")  # how an attention case was timed: sweeps get one table/plot per value


ATTENTION_FIELDS = ("impl", "heads", "seq_len", "head_dim", "dtype", "causal", *MEASURED_BY)


ATTENTION_TESTS = ("test_attention", "test_flash", "test_leaderboard")


# how a round was timed (cs336_systems.bench.harness); runs saved before the "timing" field were "host"
TIMING_LABEL = {"host": "host-synchronized rounds", "device": "device time (CUDA events, as do_bench)",
                "graph": "CUDA-graph replay time (host removed, as do_bench_cudagraph)"}


MODE_ORDER = ("forward", "forward-backward", "train-step")


ATTENTION_MODE_ORDER = ("forward", "backward", "forward-backward")


IMPL_ORDER = ("naive", "naive-compiled", "flash-pytorch", "flash-triton", "sdpa", "sdpa-flash", "sdpa-cudnn",
              "sdpa-efficient")


SIZE_ORDER = ("tiny", "small", "medium", "large", "xl", "2.7B")


# Case fields of the distributed suites (allreduce: backend, size_mb, world_size; data_parallel adds the
# variant and bucket size): part of the key so that their cases do not overwrite each other.
DIST_FIELDS = ("variant", "bucket_size_mb", "world_size", "backend", "size_mb")


CROSS_RUN_MARK = "†"


MiB = 2**20


GiB = 2**30


def machines_differ(machines: list[dict]) -> list[str]:
    """One line per run whose machine facts (`COMPARABLE_FIELDS`) differ from the first run's; empty when
    every run comes from one kind of machine and software."""
    first = machines[0] if machines else {}
    return [f"{m['file']}: " + ", ".join(f"{f} {m.get(f)!r} (first run: {first.get(f)!r})" for f in COMPARABLE_FIELDS
                                        if m.get(f) != first.get(f))
            for m in machines[1:] if any(m.get(f) != first.get(f) for f in COMPARABLE_FIELDS)]


def load_entries(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """Every saved measurement (one dict per case and run: extra_info + 'stats' or status 'oom'), in the
    order of ``paths``, and each run's machine facts.  A case saved in several runs appears once per run."""
    entries: list[dict] = []
    machines = []
    for path in paths:
        data = read_run(path)
        machines.append(data["machine_info"]["cs336_systems"] | {"file": str(path), "commit": commit_label(data)})
        for bench in data.get("benchmarks", []):
            entry = {**bench.get("extra_info", {}), "test": bench.get("name", "").split("[")[0], "run": str(path),
                     "measured": str(data.get("datetime") or "")}
            _compile_mode(entry)
            _lm_axis_defaults(entry)
            entry["status"] = entry.get("status", "ok")
            entry["stats"] = bench.get("stats", {})
            check_stats(path, bench.get("name", "?"), entry["stats"])
            if entry["test"] in ATTENTION_TESTS:
                entry.setdefault("timing", "host")
            entries.append(entry)
        for oom in data.get("oom", []):
            entry = {**oom.get("extra_info", {}), "test": oom.get("name", "").split("[")[0], "run": str(path),
                     "measured": str(data.get("datetime") or "")}
            _compile_mode(entry)
            _lm_axis_defaults(entry)
            entry.update(status="oom", stats={}, error=oom.get("error"))
            if entry["test"] in ATTENTION_TESTS:
                entry.setdefault("timing", "host")
            entries.append(entry)
    return entries, machines


CUDA_GRAPHS = "cuda-graphs"


def _compile_mode(entry: dict) -> None:
    """An end-to-end case replayed as CUDA graphs (``cuda_graphs``) is its own compile mode in every table:
    its "compile" becomes CUDA_GRAPHS, so it never pairs with or replaces the plain compiled case."""
    if entry.get("cuda_graphs"):
        entry["compile"] = CUDA_GRAPHS


def _lm_axis_defaults(entry: dict) -> None:
    """An end-to-end entry without a later axis measured its default (LM_AXIS_DEFAULTS)."""
    if entry.get("test") == "test_end_to_end":
        for axis, default in LM_AXIS_DEFAULTS.items():
            if entry.get(axis) is None:
                entry[axis] = default


def latest_entries(entries: list[dict]) -> list[dict]:
    """One entry per case: the newest run's (its saved ``datetime``; between runs measured at the same time, or
    without one, the later in ``entries``), whatever order the files were named in."""
    by_case: dict[tuple, dict] = {}
    for entry in entries:
        key = case_key(entry)
        if key not in by_case or entry.get("measured", "") >= by_case[key].get("measured", ""):
            by_case[key] = entry
    return list(by_case.values())


def load_runs(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """Entries (one dict per case: extra_info + 'stats' or status 'oom'; where a case was saved in several
    runs, the last run's) and each run's machine facts."""
    entries, machines = load_entries(paths)
    return latest_entries(entries), machines


def case_key(entry: dict) -> tuple:
    # Warm-up identifies a case only in the warm-up study (its axis); elsewhere it is how the case was
    # measured, so a re-run with another warm-up replaces the earlier run's entry instead of sitting beside it.
    warmup = entry.get("warmup") if entry.get("test") == "test_warmup_study" else None
    # An LM entry saved before the optimizer axis ran torch's AdamW: the same case as "adamw" now.
    optimizer = (entry.get("optimizer") or DEFAULT_OPTIMIZER) if "size" in entry else None
    return (entry.get("test"), warmup, optimizer) + tuple(
        entry.get(f) for f in (*LM_FIELDS, *LM_AXIS_DEFAULTS, "checkpoint", *ATTENTION_FIELDS, *DIST_FIELDS)
    )


def size_order(entry: dict) -> tuple:
    size = entry.get("size")
    return (
        SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER),
        entry.get("context", 0),
        entry.get("batch_size", 0),
    )


def stat_ms(entry: dict | None, stat: str = "median") -> float | None:
    if entry is None or entry.get("status") != "ok" or stat not in entry.get("stats", {}):
        return None
    return entry["stats"][stat] * 1e3


def cell_time(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if entry.get("status") == "oom":
        return "OOM"
    mean, std = stat_ms(entry, "mean"), stat_ms(entry, "stddev")
    return f"{mean:.2f} ± {std:.2f}" if mean is not None else "-"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def compile_label(flag) -> str:
    """eager / compiled, or "compiled + CUDA graphs" for an end-to-end case replayed as CUDA graphs."""
    if flag == CUDA_GRAPHS:
        return "compiled + CUDA graphs"
    return "compiled" if flag else "eager"


def ok_field(entry: dict | None, field: str):
    return entry.get(field) if entry is not None and entry.get("status") == "ok" else None


def same_run_ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """numerator ms / denominator ms, only when both were measured in the same saved run: absolute times
    from different runs (another boot, clocks, driver) do not divide meaningfully."""
    a, b = stat_ms(numerator), stat_ms(denominator)
    if not a or not b or numerator.get("run") != denominator.get("run"):
        return None
    return a / b


def distinct(entries: list[dict], fields: tuple[str, ...]) -> list[tuple]:
    return sorted({tuple(e.get(f) for f in fields) for e in entries}, key=str)


def machines_by_run(machines: list[dict] | None) -> dict[str, dict]:
    return {m.get("file"): m for m in machines or ()}


def same_machine(run_a: str, run_b: str, by_run: dict[str, dict]) -> bool:
    """Both runs recorded identical, known machine facts (GPU name and count, driver, CUDA, torch, triton)."""
    a, b = by_run.get(run_a), by_run.get(run_b)
    fields = (*COMPARABLE_FIELDS, "driver")
    return a is not None and b is not None and a.get("gpu_name") is not None and all(
        a.get(f) == b.get(f) for f in fields
    )


def run_ratio(num: float | None, den: float | None, num_entry: dict | None, den_entry: dict | None,
           by_run: dict[str, dict]) -> tuple[float | None, bool]:
    """(num / den, taken across runs?): same run, else another run of the same machine facts, else None."""
    if num is None or not den or num_entry is None or den_entry is None:  # num 0: a fully hidden sync
        return None, False
    if num_entry.get("run") == den_entry.get("run"):
        return num / den, False
    if same_machine(num_entry.get("run"), den_entry.get("run"), by_run):
        return num / den, True
    return None, False


def fmt_ratio(value: tuple[float | None, bool], spec: str = ".3f", suffix: str = "x") -> str:
    ratio, cross = value
    return "-" if ratio is None else format(ratio, spec) + suffix + (CROSS_RUN_MARK if cross else "")


def fmt_percent(value: tuple[float | None, bool]) -> str:
    fraction, cross = value
    return "-" if fraction is None else f"{100 * fraction:.1f}%" + (CROSS_RUN_MARK if cross else "")


def fmt_duration(seconds: float | None) -> str:
    """Microseconds below 1 ms (18.2 µs), else milliseconds (3.30 ms)."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def fmt_mib(value) -> str:
    return format(value, "g")


def relative_link(path: Path, base: str | Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(base).resolve())).as_posix()


def commit_label(run: dict) -> str:
    """The commit a saved run measured: its short id, marked "(dirty)" when the work tree had uncommitted
    changes (such a run cannot be traced to code), "unknown" when the run recorded none."""
    info = run.get("commit_info") or {}
    commit = str(info.get("id") or "unknown")
    commit = commit[:10] if commit != "unknown" else commit
    return commit + (" (dirty)" if info.get("dirty") else "")


def machine_section(machines: list[dict]) -> str:
    """One row per run: file, commit, the machine facts, and the ``CS336_*`` switches it ran with ("-": none,
    or a run saved before they were recorded)."""
    rows = [[m.get("file", ""), m.get("commit", "unknown")]
            + [str(m.get(f)) for f in (*COMPARABLE_FIELDS, "driver", "cudnn")] + [switches_text(m.get("switches"))]
            for m in machines]
    return md_table(["run", "commit", *COMPARABLE_FIELDS, "driver", "cudnn", "switches"], rows)


def switches_text(switches: dict | None) -> str:
    return ", ".join(f"{name}={value}" for name, value in sorted(switches.items())) if switches else "-"



def suite_entries(entries: list[dict], name: str) -> list[dict]:
    return [e for e in entries if e.get("suite") == name]
