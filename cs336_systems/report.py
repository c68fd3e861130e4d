"""Saved pytest-benchmark runs -> Markdown tables (and PNG plots), run comparisons, the README's results.

    python -m cs336_systems.report RUN.json [RUN2.json ...] [-o report.md] [--plots DIR]
    python -m cs336_systems.report --compare OLD.json NEW.json [-o diff.md] [--threshold 10] [--any-machine]
    python -m cs336_systems.report --readme README.md

``--plots DIR`` draws the plots of `cs336_systems.plots` (needs matplotlib, the ``plot`` extra) and links
them at the end of the report, relative to the report's directory.

``--compare`` pairs the cases of two runs by pytest node id (`cs336_systems.run_compare`): old and new
median, delta %, flagged beyond ``--threshold`` percent; runs from different machines are refused (exit
status 2) unless ``--any-machine``.

``--readme`` rewrites the generated block of the README's "## Results" section from the committed runs
(`cs336_systems.readme_results`); everything outside its markers is left as it is.

Reads the JSON written by ``pytest perf/ --benchmark-autosave`` (or ``--benchmark-json``): the timed
benchmarks with their ``extra_info`` (the case and derived rates) plus this project's ``"oom"`` list.
Later files override earlier ones for the same case, so a sweep run in groups can be merged; the flash
sweep's tables alone look at every run of a case, so that a cell measured in two runs can show the
speedup over a baseline that only one of them measured (see `flash_tables`).

Tables for the end-to-end suites:
  * per (precision, eager/compiled, attention): size x context rows, per mode mean +- std ms and MFU,
    tokens/s and peak memory of the train step; OOM cells say OOM;
  * fp32 vs bf16, eager vs compiled and naive vs sdpa attention: same-run medians and speedup;
  * the warm-up study: mean +- std per number of warm-up steps.

Tables for the attention suites (median ms: the statistic triton.testing.do_bench reports):
  * attention sweep: d x N rows, per implementation forward ms, backward ms and the memory in use
    before backward; OOM cells say OOM;
  * flash sweep: per (dtype, mode) N x d rows, per implementation ms and TFLOP/s, and the speedup of
    flash-triton over each baseline (baseline ms / flash-triton ms, only when both come from the same
    saved run);
  * leaderboard: ms and TFLOP/s per implementation and mode, and the time relative to SDPA's
    FlashAttention-2 and cuDNN kernels measured in the same run.

Tables for the distributed suites (cases identified by ``extra_info["suite"]``; every time is the slowest
rank's per-round median):
  * allreduce: per backend, size x world-size rows: time per all-reduce, algbw and busbw (as recorded by
    cs336_systems.parallel.comm), and busbw over the issue's 2xH200 reference (`ALLREDUCE_REFERENCE`);
  * data_parallel: per (size, context, batch, precision, world size, backend) one row per variant
    (bucketed: per bucket size): step ms, ratio to torch DDP and to the no-communication step,
    synchronization time and share, and the part of NaiveDDP's communication time the overlapping
    wrappers hide; the issue's two targets (`DDP_TARGETS`) evaluated on this run's numbers; a summary of
    step times per precision; a memory table per case;
  * the DDP bucket model (only when both suites are present): o and w fitted to the all-reduce times of
    the same backend and world size (cs336_systems.accounting), s = gradient bytes of the model, the
    predicted optimal bucket sqrt(s o w) and overhead curve next to the measured step times.
Ratios are taken within one saved run; where the denominator exists only in another run with the same
machine facts (GPU, count, driver, CUDA, torch, triton) the ratio is shown with a dagger (†), because
times drift between runs even on one machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from cs336_systems import accounting
from cs336_systems.machine import COMPARABLE_FIELDS
from cs336_systems.run_files import RunFileError, read_run

LM_FIELDS = ("size", "context", "batch_size", "mode", "precision", "compile", "attention")
MEASURED_BY = ("flush_l2", "timing")  # how an attention case was timed: sweeps get one table/plot per value
ATTENTION_FIELDS = ("impl", "heads", "seq_len", "head_dim", "dtype", "causal", *MEASURED_BY)
ATTENTION_TESTS = ("test_attention", "test_flash", "test_leaderboard")
# how a round was timed (cs336_systems.benchmarking); runs saved before the "timing" field were "host"
TIMING_LABEL = {"host": "host-synchronized rounds", "device": "device time (CUDA events, as do_bench)",
                "graph": "CUDA-graph replay time (host removed, as do_bench_cudagraph)"}
MODE_ORDER = ("forward", "forward-backward", "train-step")
ATTENTION_MODE_ORDER = ("forward", "backward", "forward-backward")
IMPL_ORDER = ("naive", "naive-compiled", "flash-pytorch", "flash-triton", "sdpa", "sdpa-flash", "sdpa-cudnn",
              "sdpa-efficient")
CONTENDER = "flash-triton"  # the implementation the flash sweep's speedup columns are about
LEADERBOARD_BASELINES = ("sdpa-flash", "sdpa-cudnn")
SIZE_ORDER = ("tiny", "small", "medium", "large", "xl", "2.7B")
# Case fields of the distributed suites (allreduce: backend, size_mb, world_size; data_parallel adds the
# variant and bucket size): part of the key so that their cases do not overwrite each other.
DIST_FIELDS = ("variant", "bucket_size_mb", "world_size", "backend", "size_mb")


def load_entries(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """Every saved measurement (one dict per case and run: extra_info + 'stats' or status 'oom'), in the
    order of ``paths``, and each run's machine facts.  A case saved in several runs appears once per run."""
    entries: list[dict] = []
    machines = []
    for path in paths:
        data = read_run(path)
        machines.append(data["machine_info"]["cs336_systems"] | {"file": str(path)})
        for bench in data.get("benchmarks", []):
            entry = {**bench.get("extra_info", {}), "test": bench.get("name", "").split("[")[0], "run": str(path)}
            entry["status"] = entry.get("status", "ok")
            entry["stats"] = bench.get("stats", {})
            if entry["test"] in ATTENTION_TESTS:
                entry.setdefault("timing", "host")
            entries.append(entry)
        for oom in data.get("oom", []):
            entry = {**oom.get("extra_info", {}), "test": oom.get("name", "").split("[")[0], "run": str(path)}
            entry.update(status="oom", stats={}, error=oom.get("error"))
            if entry["test"] in ATTENTION_TESTS:
                entry.setdefault("timing", "host")
            entries.append(entry)
    return entries, machines


def _latest(entries: list[dict]) -> list[dict]:
    """One entry per case: the last one in ``entries`` (later runs override earlier ones)."""
    by_case: dict[tuple, dict] = {}
    for entry in entries:
        by_case[_key(entry)] = entry
    return list(by_case.values())


def load_runs(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """Entries (one dict per case: extra_info + 'stats' or status 'oom'; where a case was saved in several
    runs, the last run's) and each run's machine facts."""
    entries, machines = load_entries(paths)
    return _latest(entries), machines


def _key(entry: dict) -> tuple:
    # Warm-up identifies a case only in the warm-up study (its axis); elsewhere it is how the case was
    # measured, so a re-run with another warm-up replaces the earlier run's entry instead of sitting beside it.
    warmup = entry.get("warmup") if entry.get("test") == "test_warmup_study" else None
    return (entry.get("test"), warmup) + tuple(
        entry.get(f) for f in (*LM_FIELDS, "checkpoint", *ATTENTION_FIELDS, *DIST_FIELDS)
    )


def _order(entry: dict) -> tuple:
    size = entry.get("size")
    return (
        SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER),
        entry.get("context", 0),
        entry.get("batch_size", 0),
    )


def _ms(entry: dict | None, stat: str = "median") -> float | None:
    if entry is None or entry.get("status") != "ok" or stat not in entry.get("stats", {}):
        return None
    return entry["stats"][stat] * 1e3


def _cell_time(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if entry.get("status") == "oom":
        return "OOM"
    mean, std = _ms(entry, "mean"), _ms(entry, "stddev")
    return f"{mean:.2f} ± {std:.2f}" if mean is not None else "-"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _compile_label(flag) -> str:
    return "compiled" if flag else "eager"


def end_to_end_tables(entries: list[dict]) -> str:
    """One table per (precision, eager/compiled, attention, batch size): size x context rows."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end"]
    out = []
    variants = sorted(
        {(e.get("precision"), bool(e.get("compile")), e.get("attention"), e.get("batch_size")) for e in lm},
        key=str,
    )
    for precision, compiled, attention, batch in variants:
        subset = [
            e for e in lm
            if (e.get("precision"), bool(e.get("compile")), e.get("attention"), e.get("batch_size"))
            == (precision, compiled, attention, batch)
        ]
        modes = [m for m in MODE_ORDER if any(e.get("mode") == m for e in subset)]
        cells = {(e["size"], e["context"], e["mode"]): e for e in subset}
        header = ["size", "context"]
        for mode in modes:
            header += [f"{mode} ms (mean ± std)", f"{mode} MFU"]
        header += ["tokens/s (last mode)", "peak GiB (last mode)"]
        rows = []
        for size, context in sorted({(e["size"], e["context"]) for e in subset},
                                    key=lambda sc: _order({"size": sc[0], "context": sc[1]})):
            row = [size, str(context)]
            for mode in modes:
                entry = cells.get((size, context, mode))
                mfu = entry.get("mfu") if entry and entry.get("status") == "ok" else None
                row += [_cell_time(entry), _fmt(None if mfu is None else 100 * mfu, ".1f") + ("%" if mfu else "")]
            last = cells.get((size, context, modes[-1]))
            ok = last is not None and last.get("status") == "ok"
            row += [
                _fmt(last.get("tokens_per_s") if ok else None, ",.0f"),
                _fmt(last.get("peak_memory_gib") if ok else None, ".1f") if ok else ("OOM" if last else "-"),
            ]
            rows.append(row)
        title = f"### End-to-end: {precision}, {_compile_label(compiled)}, attention={attention}, batch={batch}"
        out.append(title + "\n\n" + _table(header, rows))
    return "\n\n".join(out)


def comparison_table(entries: list[dict], field: str, baseline, variant, title: str) -> str:
    """Pair cases that differ only in ``field`` (baseline vs variant): medians and speedup."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end"]
    others = [f for f in LM_FIELDS if f != field]
    index = {(tuple(e.get(f) for f in others), e.get(field)): e for e in lm}
    rows = []
    for (rest, value), base in sorted(index.items(), key=lambda kv: (_order(kv[1]), str(kv[0]))):
        if value != baseline or (rest, variant) not in index:
            continue
        other = index[(rest, variant)]
        b, v = _ms(base), _ms(other)
        case = dict(zip(others, rest))
        label = [str(case.get(f)) if f != "compile" else _compile_label(case.get(f)) for f in others]
        speedup = f"{b / v:.2f}x" if b and v else "-"
        rows.append(label + [_fmt(b, ".2f") if b else _cell_time(base),
                             _fmt(v, ".2f") if v else _cell_time(other), speedup])
    if not rows:
        return ""
    header = list(others) + [f"{baseline} median ms", f"{variant} median ms", f"speedup {variant}/{baseline}"]
    return f"### {title}\n\n" + _table(header, rows)


def warmup_table(entries: list[dict]) -> str:
    study = [e for e in entries if e.get("test") == "test_warmup_study"]
    if not study:
        return ""
    rows = []
    for e in sorted(study, key=lambda e: (_order(e), e.get("mode", ""), str(e.get("precision")),
                                          bool(e.get("compile")), e.get("warmup", 0))):
        rows.append([e["size"], str(e["context"]), e["mode"], e["precision"], _compile_label(e.get("compile")),
                     str(e.get("warmup")), _cell_time(e), _fmt(_ms(e, "max"), ".2f"), _fmt(_ms(e, "min"), ".2f")])
    header = ["size", "context", "mode", "precision", "compile", "warm-up steps", "ms (mean ± std)", "max ms",
              "min ms"]
    return "### Warm-up study\n\n" + _table(header, rows)


def peak_memory_tables(entries: list[dict]) -> str:
    """End-to-end peak memory (GiB, measured rounds only) per size x context, one column per (mode,
    precision): the seeds' "peak memory of the 2.7B model" table, for every size that ran."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end" and not e.get("compile")
          and e.get("attention") == "sdpa"]
    cells = {(e.get("size"), e.get("context"), e.get("batch_size"), e.get("mode"), e.get("precision")): e for e in lm}
    columns = [(m, p) for m in MODE_ORDER for p in ("fp32", "bf16", "fp16")
               if any(k[3] == m and k[4] == p for k in cells)]
    if not columns or not any(e.get("peak_memory_gib") is not None for e in lm):
        return ""
    rows = []
    for size, context, batch in sorted({k[:3] for k in cells}, key=lambda k: (_order({"size": k[0], "context": k[1]}), k[2])):
        row = [str(size), str(context), str(batch)]
        for mode, precision in columns:
            e = cells.get((size, context, batch, mode, precision))
            if e is None:
                row.append("-")
            elif e.get("status") == "oom":
                row.append("OOM")
            else:
                row.append(_fmt(e.get("peak_memory_gib"), ".2f"))
        rows.append(row)
    header = ["size", "context", "batch"] + [f"{m} {p} GiB" for m, p in columns]
    return "### Peak memory (eager, SDPA attention)\n\n" + _table(header, rows)


def checkpointing_tables(entries: list[dict]) -> str:
    """Per LM case, one row per activation-checkpointing policy: time and peak memory, and both relative
    to the same run's "none" policy (recomputation costs time, saves activation memory)."""
    cases = [e for e in entries if e.get("test") == "test_checkpointing"]
    if not cases:
        return ""
    fields = ("size", "context", "batch_size", "mode", "precision", "compile", "attention")
    out = []
    for key in sorted({tuple(e.get(f) for f in fields) for e in cases}, key=str):
        group = [e for e in cases if tuple(e.get(f) for f in fields) == key]
        none = next((e for e in group if e.get("checkpoint") == "none"), None)
        rows = []
        for e in sorted(group, key=lambda e: (e.get("checkpoint") != "none", str(e.get("checkpoint")))):
            ms, base_ms = _ms(e), _ms(none)
            peak = e.get("peak_memory_gib") if e.get("status") == "ok" else None
            base_peak = none.get("peak_memory_gib") if none and none.get("status") == "ok" else None
            same_run = none is not None and none.get("run") == e.get("run")
            rows.append([
                str(e.get("checkpoint")), _cell_time(e),
                f"{ms / base_ms:.2f}x" if ms and base_ms and same_run else "-",
                _fmt(peak, ".2f"),
                f"{peak / base_peak:.2f}x" if peak and base_peak and same_run else "-",
            ])
        case = dict(zip(fields, key))
        title = (f"### Activation checkpointing: {case['size']}, context {case['context']}, batch "
                 f"{case['batch_size']}, {case['mode']}, {case['precision']}, {_compile_label(case['compile'])}")
        out.append(title + "\n\n" + _table(["policy", "ms (mean ± std)", "time ÷ none", "peak GiB", "peak ÷ none"],
                                            rows))
    return "\n\n".join(out)


# --- attention suites ----------------------------------------------------------------------------------


def _impls(entries: list[dict]) -> list[str]:
    names = {e.get("impl") for e in entries}
    known = [n for n in IMPL_ORDER if n in names]
    return known + sorted(n for n in names if n not in IMPL_ORDER)


def _impl_label(impl: str, compiled) -> str:
    return f"{impl} (compiled)" if compiled else impl


def _cell_median(entry: dict | None) -> str:
    """Median ms, OOM, or '-' (not run, skipped: no kernel / not available)."""
    if entry is None:
        return "-"
    if entry.get("status") == "oom":
        return "OOM"
    ms = _ms(entry)
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}"


def _fmt_rate(value: float | None) -> str:
    """TFLOP/s: one decimal on a GPU (312.4), significant digits for the tiny CPU rates (0.00514)."""
    if value is None:
        return "-"
    return format(value, ".1f") if value >= 10 else format(value, ".3g")


def _ok(entry: dict | None, field: str):
    return entry.get(field) if entry is not None and entry.get("status") == "ok" else None


def _same_run_ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """numerator ms / denominator ms, only when both were measured in the same saved run: absolute times
    from different runs (another boot, clocks, driver) do not divide meaningfully."""
    a, b = _ms(numerator), _ms(denominator)
    if not a or not b or numerator.get("run") != denominator.get("run"):
        return None
    return a / b


def _variants(entries: list[dict], fields: tuple[str, ...]) -> list[tuple]:
    return sorted({tuple(e.get(f) for f in fields) for e in entries}, key=str)


def _measurement_suffix(flush_l2, timing) -> str:
    """Title suffix for how a sweep was measured; empty for the default (host-synchronized, no flush), so a
    run that mixes clocks gets one table per clock instead of host and device times in one row."""
    suffix = ", L2 flushed before every round" if flush_l2 else ""
    if timing not in (None, "host"):
        suffix += f", {TIMING_LABEL.get(timing, timing)}"
    return suffix


def attention_sweep_tables(entries: list[dict]) -> str:
    """The handout's attention sweep: d x N rows; forward ms, backward ms, memory before backward per impl."""
    sweep = [e for e in entries if e.get("test") == "test_attention"]
    out = []
    fields = ("dtype", "causal", "batch_size", "heads", "compile", *MEASURED_BY)
    for variant in _variants(sweep, fields):
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, causal, batch, heads, compiled, flush, timing = variant
        impls = _impls(subset)
        cells = {(e["impl"], e["head_dim"], e["seq_len"], e["mode"]): e for e in subset}
        header = ["d", "N"]
        for impl in impls:
            label = _impl_label(impl, compiled)
            header += [f"{label} forward ms", f"{label} backward ms", f"{label} memory before backward GiB"]
        rows = []
        for d, n in sorted({(e["head_dim"], e["seq_len"]) for e in subset}):
            row = [str(d), str(n)]
            for impl in impls:
                backward = cells.get((impl, d, n, "backward"))
                memory = backward.get("memory_before_backward_gib") if backward is not None else None
                if memory is not None:
                    memory_cell = f"{memory:.2f}"
                else:  # a forward that ran out of memory leaves nothing in use to report
                    memory_cell = "OOM" if backward is not None and backward.get("status") == "oom" else "-"
                row += [_cell_median(cells.get((impl, d, n, "forward"))), _cell_median(backward), memory_cell]
            rows.append(row)
        shape = f"B={batch}" + (f", H={heads}" if heads else "")
        title = (f"### Attention sweep: {dtype}, {'causal' if causal else 'not causal'}, {shape}"
                 + _measurement_suffix(flush, timing))
        out.append(title + " (median ms; memory in use after the forward, before backward)\n\n"
                   + _table(header, rows))
    return "\n\n".join(out)


SEVERAL_RUNS_MARK = "‡"


def _flash_cell(by_impl: dict[str, list[dict]], contender: str, baselines: list[str],
                rank: dict[str, int]) -> tuple[dict, dict]:
    """One flash-sweep cell (N, d) whose entries may come from several saved runs.

    ``by_impl``: impl -> its entries at this cell in run order (later runs last); ``rank``: run -> its
    position on the command line.  Returns (shown, pairs):
    shown[impl] is the entry to display: from the run that measured the contender beside the most
    baselines (ties: the later run), else the impl's latest entry; pairs[baseline] is (baseline entry,
    contender entry) from one run that measured both (that run if it did, else the latest such run), or
    absent when no run did.
    """
    in_run = {(impl, e["run"]): e for impl, entries in by_impl.items() for e in entries}
    measured = {(impl, run) for (impl, run), e in in_run.items() if _ms(e) is not None}
    contender_runs = [e["run"] for e in by_impl.get(contender, [])]
    chosen = max(contender_runs, default=None,
                 key=lambda run: (sum((b, run) in measured for b in baselines), rank[run]))
    shown = {impl: in_run.get((impl, chosen), entries[-1]) for impl, entries in by_impl.items()}
    pairs = {}
    for base in baselines:
        both = [run for (impl, run) in measured if impl == base and (contender, run) in measured]
        if both:
            run = chosen if chosen in both else max(both, key=rank.__getitem__)
            pairs[base] = (in_run[(base, run)], in_run[(contender, run)])
    return shown, pairs


def flash_tables(entries: list[dict], contender: str = CONTENDER) -> str:
    """Per (dtype, mode): N x d rows, ms and TFLOP/s per impl, speedup of ``contender`` over each baseline.

    ``entries`` may hold a case once per saved run (`load_entries`; a sweep cut short and completed by a
    second run): each cell then shows the run that measured the contender beside the most baselines, and
    each speedup divides times from one run (`_flash_cell`), marked ‡ where that is not the shown pair.
    """
    sweep = [e for e in entries if e.get("test") == "test_flash"]
    out = []
    fields = ("dtype", "mode", "causal", "batch_size", "heads", "compile", *MEASURED_BY)
    variants = sorted(
        _variants(sweep, fields),
        key=lambda v: (str(v[0]), ATTENTION_MODE_ORDER.index(v[1]) if v[1] in ATTENTION_MODE_ORDER else 9, str(v)),
    )
    for variant in variants:
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, mode, causal, batch, heads, compiled, flush, timing = variant
        impls = _impls(subset)
        baselines = [i for i in impls if i != contender] if contender in impls else []
        rank = {run: i for i, run in enumerate(dict.fromkeys(e["run"] for e in subset))}  # file order
        cells: dict[tuple, dict[str, list[dict]]] = {}
        for e in subset:
            cells.setdefault((e["seq_len"], e["head_dim"]), {}).setdefault(e["impl"], []).append(e)
        header = ["N", "d"]
        for impl in impls:
            header += [f"{_impl_label(impl, compiled)} ms", f"{_impl_label(impl, compiled)} TFLOP/s"]
        header += [f"{contender} speedup vs {b}" for b in baselines]
        rows, marked = [], False
        for n, d in sorted(cells):
            shown, pairs = _flash_cell(cells[(n, d)], contender, baselines, rank)
            row = [str(n), str(d)]
            for impl in impls:
                entry = shown.get(impl)
                row += [_cell_median(entry), _fmt_rate(_ok(entry, "tflops"))]
            for base in baselines:
                if base not in pairs:
                    row.append("-")
                    continue
                pair = pairs[base]
                mark = "" if pair == (shown.get(base), shown.get(contender)) else SEVERAL_RUNS_MARK
                marked = marked or bool(mark)
                row.append(f"{_same_run_ratio(*pair):.2f}x{mark}")
            rows.append(row)
        shape = f"B={batch}" + (f", H={heads}" if heads else "")
        title = (f"### Flash sweep: {dtype}, {mode}, {'causal' if causal else 'not causal'}, {shape}"
                 + _measurement_suffix(flush, timing))
        note = (f"\n\n{SEVERAL_RUNS_MARK}: the case was saved in more than one run; this speedup divides the "
                "two times of the run that measured both, not the times shown." if marked else "")
        out.append(title + " (median ms)\n\n" + _table(header, rows) + note)
    return "\n\n".join(out)


def leaderboard_table(entries: list[dict], baselines: tuple[str, ...] = LEADERBOARD_BASELINES) -> str:
    """Per mode and implementation: median ms, TFLOP/s, and time relative to each baseline, same run."""
    board = [e for e in entries if e.get("test") == "test_leaderboard"]
    if not board:
        return ""
    shape_fields = ("batch_size", "heads", "seq_len", "head_dim", "dtype", "causal", *MEASURED_BY)
    out = []
    for shape in _variants(board, shape_fields):
        subset = [e for e in board if tuple(e.get(f) for f in shape_fields) == shape]
        header = ["mode", "implementation", "median ms", "TFLOP/s", "max rel. error"]
        header += [f"time ÷ {b}" for b in baselines]
        rows = []
        modes = sorted({e["mode"] for e in subset},
                       key=lambda m: ATTENTION_MODE_ORDER.index(m) if m in ATTENTION_MODE_ORDER else 9)
        for mode in modes:
            in_mode = [e for e in subset if e["mode"] == mode]
            reference = {b: next((e for e in in_mode if e["impl"] == b and not e.get("compile")), None)
                         for b in baselines}
            order = {impl: i for i, impl in enumerate(_impls(in_mode))}
            for e in sorted(in_mode, key=lambda e: (order[e["impl"]], bool(e.get("compile")))):
                ratios = [_same_run_ratio(e, reference[b]) for b in baselines]
                ratios = ["-" if r is None else f"{r:.2f}" for r in ratios]
                rows.append([mode, _impl_label(e["impl"], e.get("compile")), _cell_median(e),
                             _fmt_rate(_ok(e, "tflops")), _fmt(_ok(e, "accuracy_error"), ".1e"), *ratios])
        batch, heads, n, d, dtype, causal, flush, timing = shape
        title = (f"### Leaderboard: B={batch}, H={heads}, N={n}, d={d}, {dtype}, "
                 f"{'causal' if causal else 'not causal'}" + (", L2 flushed before every round" if flush else "")
                 + f", {TIMING_LABEL.get(timing, timing)}")
        out.append(title + "\n\n" + _table(header, rows))
    return "\n\n".join(out)


# --- distributed suites (allreduce, data_parallel) --------------------------------------------------------

MiB = 2**20
GiB = 2**30
# Reference all-reduce bus bandwidths from the distributed-benchmarks issue (also quoted in
# benchmarks.json's allreduce description and DESIGN.md): 2xH200 with NVLink, 2 ranks.  NCCL: busbw in
# GB/s per message size in MiB; gloo (tensors on the CPU): a range, whatever the size.
ALLREDUCE_REFERENCE = {
    "gpu": "H200",  # applies to runs whose GPU name contains this ...
    "world_size": 2,  # ... at this world size
    "nccl": {1: 32.0, 10: 150.0, 100: 258.0, 1024: 322.0},
    "gloo": (1.0, 2.7),
}
VARIANT_ORDER = ("none", "torch-ddp", "naive", "flat", "individual", "bucketed", "zero-broadcast", "zero1",
                 "fsdp", "torch-zero", "torch-fsdp2")
BASELINE_VARIANT = "torch-ddp"
NO_COMM_VARIANT = "none"
HIDING_VARIANTS = ("individual", "bucketed")  # overlap communication with backward
# The targets: DDPBucketed's best bucket size at most 0.98x torch DDP's step time, and
# DDPIndividualParameters hiding at least 80% of NaiveDDP's communication time (1 - sync / naive sync).
DDP_TARGETS = {"bucketed_max_ratio": 0.98, "individual_min_hidden": 0.80}
DP_GROUP_FIELDS = ("size", "context", "batch_size", "precision", "world_size", "backend")
MEMORY_FIELDS = (
    ("after_construction", "after construction"),
    ("peak_before_step", "peak before step"),
    ("peak_step", "peak during step"),
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations_other", "activations + other"),
)
GRAD_BYTES_PER_PARAM = 4  # fp32 gradients of the fp32 master weights (bf16 autocast keeps them fp32)
CROSS_RUN_MARK = "†"


def _suite(entries: list[dict], name: str) -> list[dict]:
    return [e for e in entries if e.get("suite") == name]


def _machines_by_run(machines: list[dict] | None) -> dict[str, dict]:
    return {m.get("file"): m for m in machines or ()}


def _same_machine(run_a: str, run_b: str, by_run: dict[str, dict]) -> bool:
    """Both runs recorded identical, known machine facts (GPU name and count, driver, CUDA, torch, triton)."""
    a, b = by_run.get(run_a), by_run.get(run_b)
    fields = (*COMPARABLE_FIELDS, "driver")
    return a is not None and b is not None and a.get("gpu_name") is not None and all(
        a.get(f) == b.get(f) for f in fields
    )


def _ratio(num: float | None, den: float | None, num_entry: dict | None, den_entry: dict | None,
           by_run: dict[str, dict]) -> tuple[float | None, bool]:
    """(num / den, taken across runs?): same run, else another run of the same machine facts, else None."""
    if num is None or not den or num_entry is None or den_entry is None:  # num 0: a fully hidden sync
        return None, False
    if num_entry.get("run") == den_entry.get("run"):
        return num / den, False
    if _same_machine(num_entry.get("run"), den_entry.get("run"), by_run):
        return num / den, True
    return None, False


def _fmt_ratio(value: tuple[float | None, bool], spec: str = ".3f", suffix: str = "x") -> str:
    ratio, cross = value
    return "-" if ratio is None else format(ratio, spec) + suffix + (CROSS_RUN_MARK if cross else "")


def _fmt_percent(value: tuple[float | None, bool]) -> str:
    fraction, cross = value
    return "-" if fraction is None else f"{100 * fraction:.1f}%" + (CROSS_RUN_MARK if cross else "")


def _fmt_duration(seconds: float | None) -> str:
    """Microseconds below 1 ms (18.2 µs), else milliseconds (3.30 ms)."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _fmt_mib(value) -> str:
    return format(value, "g")


def allreduce_reference(backend: str, size_mb, world_size, gpu_name: str | None):
    """The issue's reference busbw (GB/s) for this case: a number (NCCL), a (low, high) range (gloo), or
    None where the reference does not apply (another world size, another GPU, an unlisted size)."""
    ref = ALLREDUCE_REFERENCE
    if world_size != ref["world_size"] or ref["gpu"] not in (gpu_name or ""):
        return None
    table = ref.get(backend)
    if isinstance(table, dict):
        return table.get(size_mb)
    return table


def _reference_cells(busbw: float | None, reference) -> list[str]:
    if reference is None:
        return ["-", "-"]
    if isinstance(reference, tuple):
        low, high = reference
        if busbw is None:
            return [f"{low:g}–{high:g}", "-"]
        verdict = "below range" if busbw < low else "above range" if busbw > high else "in range"
        return [f"{low:g}–{high:g}", verdict]
    return [f"{reference:g}", "-" if busbw is None else f"{busbw / reference:.2f}x"]


def allreduce_tables(entries: list[dict], machines: list[dict] | None = None) -> str:
    """Per backend: (size MiB, world size) rows: time per all-reduce, algbw, busbw, reference, ratio."""
    cases = _suite(entries, "allreduce")
    by_run = _machines_by_run(machines)
    out = []
    for backend in sorted({str(e.get("backend")) for e in cases}):
        subset = sorted((e for e in cases if str(e.get("backend")) == backend),
                        key=lambda e: (e.get("size_mb") or 0, e.get("world_size") or 0))
        rows = []
        for e in subset:
            ok = e.get("status") == "ok"
            median = e["stats"].get("median") if ok else None
            busbw = _ok(e, "busbw_gbps")
            gpu = by_run.get(e.get("run"), {}).get("gpu_name")
            reference = allreduce_reference(backend, e.get("size_mb"), e.get("world_size"), gpu)
            time_cell = _fmt_duration(median) if ok else ("OOM" if e.get("status") == "oom" else "-")
            rows.append([_fmt_mib(e.get("size_mb")), str(e.get("world_size")), time_cell,
                         _fmt(_ok(e, "algbw_gbps"), ".1f"), _fmt(busbw, ".1f"),
                         *_reference_cells(busbw, reference)])
        header = ["size MiB", "ranks", "median time per all-reduce", "algbw GB/s", "busbw GB/s",
                  "reference busbw GB/s", "busbw ÷ reference"]
        out.append(f"### All-reduce: {backend} (float32; slowest rank's median per all-reduce)\n\n"
                   + _table(header, rows))
    if not out:
        return ""
    ref = ALLREDUCE_REFERENCE
    nccl = ", ".join(f"{_fmt_mib(k)} MiB {v:g}" for k, v in ref["nccl"].items())
    note = (f"busbw = algbw · 2(n−1)/n (nccl-tests). Reference: the issue's {ref['world_size']}×{ref['gpu']} "
            f"(NVLink) numbers, applied to {ref['world_size']}-rank runs on that GPU only: NCCL busbw {nccl} "
            f"GB/s; gloo {ref['gloo'][0]:g}–{ref['gloo'][1]:g} GB/s.")
    return "\n\n".join(out) + "\n\n" + note


def _dp_groups(entries: list[dict]) -> list[tuple[tuple, list[dict]]]:
    cases = _suite(entries, "data_parallel")
    keys = sorted({tuple(e.get(f) for f in DP_GROUP_FIELDS) for e in cases},
                  key=lambda k: (_order({"size": k[0], "context": k[1] or 0, "batch_size": k[2] or 0}), str(k)))
    return [(k, [e for e in cases if tuple(e.get(f) for f in DP_GROUP_FIELDS) == k]) for k in keys]


def _variant_order(entry: dict) -> tuple:
    variant = entry.get("variant")
    bucket = entry.get("bucket_size_mb")
    return (VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER), str(variant),
            math.inf if bucket is None else bucket)


def _variant_label(entry: dict) -> str:
    variant, bucket = entry.get("variant"), entry.get("bucket_size_mb")
    if variant == "bucketed":
        return f"bucketed {_fmt_mib(bucket)} MiB" if bucket is not None else "bucketed (one bucket)"
    if bucket is not None:
        return f"{variant} ({_fmt_mib(bucket)} MiB buckets)"
    return str(variant)


def _group_title(key: tuple) -> str:
    size, context, batch, precision, world, backend = key
    return f"{size}, context {context}, per-rank batch {batch}, {precision}, {world} ranks ({backend})"


def _only(entries: list[dict], variant: str) -> dict | None:
    found = [e for e in entries if e.get("variant") == variant]
    return found[0] if found else None


def _sync_ms(entry: dict | None) -> float | None:
    value = _ok(entry, "sync_ms")
    return float(value) if value is not None else None


def hidden_fraction(entry: dict | None, naive: dict | None, by_run: dict[str, dict] | None = None
                    ) -> tuple[float | None, bool]:
    """1 - sync_ms(entry) / sync_ms(naive): the share of NaiveDDP's communication time that overlapping
    with backward hid (same run; across runs of identical machine facts marked as such)."""
    ratio, cross = _ratio(_sync_ms(entry), _sync_ms(naive), entry, naive, by_run or {})
    return (None, False) if ratio is None else (1 - ratio, cross)


def ddp_targets(group: list[dict]) -> dict:
    """The issue's targets on one data_parallel case, from same-run numbers only.

    Returns {"bucketed": (best bucketed entry or None, its step / torch DDP's step or None, met or None),
             "individual": (hidden fraction or None, met or None)}; None = not measured in one run.
    """
    base = _only(group, BASELINE_VARIANT)
    candidates = [e for e in group if e.get("variant") == "bucketed" and _ms(e) is not None
                  and base is not None and e.get("run") == base.get("run")]
    best = min(candidates, key=_ms) if candidates and _ms(base) else None
    ratio = _ms(best) / _ms(base) if best is not None else None
    bucketed_met = None if ratio is None else ratio <= DDP_TARGETS["bucketed_max_ratio"]
    hidden, _ = hidden_fraction(_only(group, "individual"), _only(group, "naive"))  # no machines: same run
    individual_met = None if hidden is None else hidden >= DDP_TARGETS["individual_min_hidden"]
    return {"bucketed": (best, ratio, bucketed_met), "individual": (hidden, individual_met)}


def _verdict(met: bool | None) -> str:
    return "not measured in one run" if met is None else ("**met**" if met else "**not met**")


def _targets_text(group: list[dict]) -> str:
    targets = ddp_targets(group)
    best, ratio, met = targets["bucketed"]
    limit = DDP_TARGETS["bucketed_max_ratio"]
    if best is not None:
        bucketed = (f"best is {_variant_label(best)} at {_ms(best):.2f} ms = {ratio:.3f}x torch DDP "
                    f"-> {_verdict(met)}")
    else:
        bucketed = _verdict(None)
    hidden, met_hidden = targets["individual"]
    floor = DDP_TARGETS["individual_min_hidden"]
    individual = (f"{100 * hidden:.1f}% -> {_verdict(met_hidden)}" if hidden is not None else _verdict(None))
    return (f"Targets (issue): DDPBucketed's best bucket size ≤ {limit:g}x torch DDP's step: {bucketed}. "
            f"DDPIndividualParameters hides ≥ {100 * floor:.0f}% of NaiveDDP's communication time "
            f"(1 − sync ms ÷ naive sync ms): {individual}.")


def data_parallel_tables(entries: list[dict], machines: list[dict] | None = None) -> str:
    """Per data_parallel case: one row per variant (bucketed: per bucket size) and the issue's targets."""
    by_run = _machines_by_run(machines)
    out = []
    for key, group in _dp_groups(entries):
        base, none, naive = (_only(group, v) for v in (BASELINE_VARIANT, NO_COMM_VARIANT, "naive"))
        rows = []
        for e in sorted(group, key=_variant_order):
            step = _ms(e)
            hidden = hidden_fraction(e, naive, by_run) if e.get("variant") in HIDING_VARIANTS else (None, False)
            share = _ok(e, "sync_share")
            rows.append([
                _variant_label(e), _cell_median(e),
                _fmt_ratio(_ratio(step, _ms(base), e, base, by_run)),
                _fmt_ratio(_ratio(step, _ms(none), e, none, by_run)),
                _fmt(_sync_ms(e), ".2f"), _fmt(None if share is None else 100 * share, ".1f"),
                _fmt_percent(hidden), _fmt(_ok(e, "num_buckets"), "d"),
            ])
        header = ["variant", "median step ms", "÷ torch-ddp", "÷ none", "sync ms", "sync % of step",
                  "naive comm hidden", "buckets"]
        out.append(f"### Data parallel: {_group_title(key)}\n\n" + _table(header, rows) + "\n\n"
                   + _targets_text(group))
    if not out:
        return ""
    note = ("sync ms: time inside finish_gradient_synchronization() after backward (median over the measured "
            "rounds of the slowest rank; for naive/flat all of the communication, for the overlapping wrappers "
            "what backward did not hide). naive comm hidden = 1 − sync ms ÷ naive's sync ms. "
            f"{CROSS_RUN_MARK}: the denominator comes from another saved run with the same machine facts.")
    return "\n\n".join(out) + "\n\n" + note


def data_parallel_summary(entries: list[dict], machines: list[dict] | None = None) -> str:
    """One row per variant (bucketed: its fastest bucket size), one column pair per precision: step ms
    and the ratio to torch DDP's step.  Only for cases that share size, context, batch, world size and
    backend apart from the precision (otherwise the per-case tables say it all)."""
    by_run = _machines_by_run(machines)
    groups = _dp_groups(entries)
    shapes = {tuple(v for f, v in zip(DP_GROUP_FIELDS, k) if f != "precision") for k, _ in groups}
    if len(shapes) != 1:
        return ""
    precisions = [k[DP_GROUP_FIELDS.index("precision")] for k, _ in groups]
    columns = {}
    for key, group in groups:
        base = _only(group, BASELINE_VARIANT)
        best = {}
        for e in group:
            label = "bucketed (best)" if e.get("variant") == "bucketed" else _variant_label(e)
            if e.get("variant") == "bucketed" and label in best and (
                    _ms(e) is None or (_ms(best[label]) is not None and _ms(best[label]) <= _ms(e))):
                continue
            best[label] = e
        columns[key[DP_GROUP_FIELDS.index("precision")]] = (best, base)
    labels = sorted({label for best, _ in columns.values() for label in best},
                    key=lambda lab: _variant_order(next(b[lab] for b, _ in columns.values() if lab in b)))
    rows = []
    for label in labels:
        row = [label]
        for precision in precisions:
            best, base = columns[precision]
            e = best.get(label)
            cell = _cell_median(e)
            if e is not None and e.get("variant") == "bucketed" and _ms(e) is not None:
                bucket = e.get("bucket_size_mb")
                cell += " (one bucket)" if bucket is None else f" ({_fmt_mib(bucket)} MiB)"
            row += [cell, _fmt_ratio(_ratio(_ms(e), _ms(base), e, base, by_run), ".2f")]
        rows.append(row)
    header = ["variant"] + [h for p in precisions for h in (f"{p} step ms", f"{p} ÷ torch-ddp")]
    size, context, batch, world, backend = next(iter(shapes))
    return (f"### Data parallel summary: {size}, context {context}, per-rank batch {batch}, {world} ranks "
            f"({backend})\n\n" + _table(header, rows) + "\n\nMedian step ms (slowest rank); bucketed: its "
            f"fastest bucket size. {CROSS_RUN_MARK}: torch-ddp was measured in another saved run with the same "
            "machine facts (a cross-run ratio; times drift between runs).")


def data_parallel_memory_tables(entries: list[dict]) -> str:
    """Per data_parallel case: variant -> memory after construction, peaks, breakdown before the step."""
    out = []
    for key, group in _dp_groups(entries):
        rows = []
        for e in sorted(group, key=_variant_order):
            memory = _ok(e, "memory_gib") or {}
            if e.get("status") == "oom":
                cells = ["OOM"] * len(MEMORY_FIELDS)
            else:
                cells = [_fmt(memory.get(field), ".2f") for field, _ in MEMORY_FIELDS]
            rows.append([_variant_label(e), *cells])
        if all(cell == "-" for row in rows for cell in row[1:]):
            continue  # a CPU run records no CUDA memory
        header = ["variant"] + [f"{label} GiB" for _, label in MEMORY_FIELDS]
        out.append(f"### Data parallel memory per rank: {_group_title(key)}\n\n" + _table(header, rows))
    if not out:
        return ""
    return "\n\n".join(out) + ("\n\nThe breakdown is taken at the peak before optimizer.step(): parameters, "
                               "gradients and optimizer state local to the rank; activations + other is the "
                               "rest of that peak. Peak during step includes the optimizer step.")


@functools.lru_cache(maxsize=None)
def gradient_bytes(size: str, context: int, vocab_size: int | None = None) -> int:
    """Bytes of fp32 gradients of the LM of ``size`` (parameter count x 4), built on the meta device."""
    import torch  # deferred: the rest of the report needs no torch

    from cs336_systems.model import build, count_parameters

    overrides = {"context_length": context} | ({"vocab_size": vocab_size} if vocab_size else {})
    with torch.device("meta"):
        model = build(size, **overrides)
    return count_parameters(model) * GRAD_BYTES_PER_PARAM


def _bucket_model_section(key: tuple, group: list[dict], allreduce: list[dict]) -> str:
    """One data_parallel case's bucket model.

    o, w: least squares t = o + bytes / w over the all-reduce medians of the case's backend and world size;
    s: fp32 gradient bytes of the model; prediction sqrt(s o w) (accounting.optimal_bucket_bytes) and
    overhead(n_b) = n_b o + s / (n_b w) at each measured bucket size, with n_b = s / bucket (the model's
    assumption) and with the bucket count the wrapper actually formed (it never splits a parameter).
    """
    size, context, _batch, _precision, world, backend = key
    points = sorted((e for e in allreduce if e.get("backend") == backend and e.get("world_size") == world
                     and e.get("status") == "ok" and e.get("bytes") and e["stats"].get("median")),
                    key=lambda e: e["bytes"])
    bucketed = sorted((e for e in group if e.get("variant") == "bucketed"), key=_variant_order)
    if not bucketed or not points:
        return ""
    title = f"### DDP bucket model: {_group_title(key)}"
    sizes = ", ".join(_fmt_mib(e["bytes"] / MiB) for e in points)
    try:
        fit = accounting.fit_allreduce_model([e["bytes"] for e in points], [e["stats"]["median"] for e in points])
    except ValueError as err:
        return f"{title}\n\nNo fit from the {backend} all-reduce times ({sizes} MiB, {world} ranks): {err}"
    o, w = fit.per_call_overhead_s, fit.bandwidth_Bps
    s = gradient_bytes(size, context, group[0].get("vocab_size"))
    bullets = [
        f"all-reduce fit t = o + bytes ÷ w over the {backend} medians at {world} ranks ({sizes} MiB): "
        f"o = {o * 1e6:.1f} µs per call, w = {w / 1e9:.1f} GB/s",
        f"s = gradient bytes = {s // GRAD_BYTES_PER_PARAM:,} parameters × {GRAD_BYTES_PER_PARAM} B (fp32 "
        f"gradients) = {s / GiB:.3f} GiB",
    ]
    if o > 0:
        n_star = accounting.optimal_n_buckets(s, w, o)
        bullets.append(
            f"predicted optimal bucket size sqrt(s·o·w) = {accounting.optimal_bucket_bytes(s, w, o) / MiB:.1f} MiB "
            f"(n_b* = {n_star:.1f} buckets), minimum overhead 2·sqrt(s·o÷w) = "
            f"{accounting.ddp_overhead_s(s, w, o, n_star) * 1e3:.2f} ms")
    else:
        bullets.append(f"the fitted o ({o * 1e6:.1f} µs) is not positive: the model has no optimal bucket size")

    def overhead_ms(n_buckets) -> float | None:
        return accounting.ddp_overhead_s(s, w, o, n_buckets) * 1e3 if o > 0 and n_buckets else None

    none = _only(group, NO_COMM_VARIANT)
    rows, predicted = [], []
    for e in bucketed:
        bucket = e.get("bucket_size_mb")
        n_model = 1.0 if bucket is None else max(1.0, s / (bucket * MiB))
        n_formed = _ok(e, "num_buckets")
        model_ms, formed_ms = overhead_ms(n_model), overhead_ms(n_formed)
        predicted.append((e, formed_ms if formed_ms is not None else model_ms))
        same_run = none is not None and _ms(none) and _ms(e) and e.get("run") == none.get("run")
        rows.append([
            "one bucket" if bucket is None else _fmt_mib(bucket), f"{n_model:.1f}", _fmt(n_formed, "d"),
            _fmt(model_ms, ".2f"), _fmt(formed_ms, ".2f"), _cell_median(e),
            _fmt(_ms(e) - _ms(none) if same_run else None, ".2f"), _fmt(_sync_ms(e), ".2f"),
        ])
    measured = [e for e in bucketed if _ms(e) is not None]
    if measured:
        best = min(measured, key=_ms)
        bullets.append(f"measured best bucket size: {_variant_label(best)} ({_ms(best):.2f} ms per step)")
    modelled = [(e, p) for e, p in predicted if p is not None]
    if modelled:
        e, p = min(modelled, key=lambda pair: pair[1])
        bullets.append(f"among the measured bucket sizes the model predicts the least overhead for "
                       f"{_variant_label(e)} ({p:.2f} ms)")
    header = ["bucket MiB", "n_b = s ÷ bucket", "buckets formed", "predicted overhead ms (n_b = s ÷ bucket)",
              "predicted overhead ms (buckets formed)", "measured step ms", "step − none ms (same run)",
              "sync ms"]
    return (title + "\n\n" + "\n".join(f"- {b}" for b in bullets) + "\n\n" + _table(header, rows) + "\n\n"
            "overhead(n_b) = n_b·o + s ÷ (n_b·w) (cs336_systems.accounting). The wrapper never splits a "
            "parameter, so small bucket sizes form fewer buckets than s ÷ bucket.")


def bucket_model_sections(entries: list[dict]) -> str:
    """The DDP bucket model next to the measurements; empty unless both distributed suites are present."""
    allreduce = _suite(entries, "allreduce")
    if not allreduce:
        return ""
    sections = [_bucket_model_section(key, group, allreduce) for key, group in _dp_groups(entries)]
    return "\n\n".join(s for s in sections if s)


def machine_section(machines: list[dict]) -> str:
    rows = [[m.get("file", "")] + [str(m.get(f)) for f in (*COMPARABLE_FIELDS, "driver", "cudnn")] for m in machines]
    return _table(["run", *COMPARABLE_FIELDS, "driver", "cudnn"], rows)


def plots_section(entries: list[dict], machines: list[dict], plots_dir: str | Path,
                  link_base: str | Path) -> str:
    """Draw every plot the entries have data for into ``plots_dir``; Markdown image links relative to
    ``link_base`` (the directory the report is written to)."""
    from cs336_systems import plots  # deferred: matplotlib is an optional extra

    specs = plots.all_plots(entries, machines)
    if not specs:
        return ""
    paths = plots.write_plots(specs, plots_dir)
    links = [f"![{spec.title}]({_link(path, link_base)})" for spec, path in zip(specs, paths)]
    return "## Plots\n\n" + "\n\n".join(links)


def _link(path: Path, base: str | Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(base).resolve())).as_posix()


def render(paths: list[str | Path], plots_dir: str | Path | None = None,
           link_base: str | Path | None = None) -> str:
    """The Markdown report of the runs; with ``plots_dir``, also the PNG plots, linked at the end."""
    every, machines = load_entries(paths)
    entries = _latest(every)
    sections = [
        "# Benchmark report",
        machine_section(machines),
        "Times are per step; MFU uses model FLOPs (cs336_systems.flops) over the datasheet dense peak "
        "(cs336_systems.machine) unless the run passed --peak-tflops."
        if any(e.get("test") in ("test_end_to_end", "test_warmup_study") for e in entries) else "",
        end_to_end_tables(entries),
        comparison_table(entries, "precision", "fp32", "bf16", "fp32 vs bf16 autocast"),
        comparison_table(entries, "compile", False, True, "eager vs torch.compile"),
        comparison_table(entries, "attention", "naive", "sdpa", "naive vs SDPA attention"),
        warmup_table(entries),
        peak_memory_tables(entries),
        checkpointing_tables(entries),
        attention_sweep_tables(entries),
        flash_tables(every),
        leaderboard_table(entries),
        allreduce_tables(entries, machines),
        data_parallel_summary(entries, machines),
        data_parallel_tables(entries, machines),
        data_parallel_memory_tables(entries),
        bucket_model_sections(entries),
        plots_section(entries, machines, plots_dir, link_base if link_base is not None else Path.cwd())
        if plots_dir is not None else "",
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s RUN.json [RUN.json ...] [-o report.md] [--plots DIR]\n"
              "       %(prog)s --compare OLD.json NEW.json [-o diff.md] [--threshold PCT] [--any-machine]\n"
              "       %(prog)s --readme README.md")
    parser.add_argument("runs", nargs="*", help="saved pytest-benchmark JSON files")
    parser.add_argument("-o", "--output", help="write Markdown here instead of stdout")
    parser.add_argument("--plots", metavar="DIR", help="also draw PNG plots into DIR and link them (needs the "
                                                       "`plot` extra: matplotlib)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two saved runs case by case")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="--compare: flag deltas beyond this many percent (default %(default)g)")
    parser.add_argument("--any-machine", action="store_true",
                        help="--compare: compare runs from different machines (with a warning)")
    parser.add_argument("--readme", metavar="README", help="regenerate the Results block of this README from "
                                                           "the committed runs, and its plots")
    args = parser.parse_args(argv)
    modes = [bool(args.runs), args.compare is not None, args.readme is not None]
    if sum(modes) != 1:
        parser.error("give either RUN.json files, or --compare OLD NEW, or --readme README")
    if args.threshold <= 0 or not math.isfinite(args.threshold):
        parser.error(f"--threshold must be a positive percentage, got {args.threshold:g}")
    if args.plots is not None and not args.runs:
        parser.error("--plots goes with RUN.json files")
    from cs336_systems.plots import MissingPlotExtra  # the module itself needs no matplotlib
    from cs336_systems.readme_results import ReadmeMarkersError, update_readme
    from cs336_systems.run_compare import IncomparableRuns, compare_runs

    try:
        if args.readme is not None:
            changed = update_readme(args.readme)
            print(f"{args.readme}: results block {'updated' if changed else 'already up to date'}")
            return 0
        if args.compare is not None:
            text = compare_runs(*args.compare, threshold=args.threshold, any_machine=args.any_machine)
        else:
            base = Path(args.output).parent if args.output else Path.cwd()
            text = render(args.runs, plots_dir=args.plots, link_base=base)
    except (IncomparableRuns, MissingPlotExtra, ReadmeMarkersError, RunFileError, OSError,
            UnicodeDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as err:
            print(f"error: cannot write {args.output}: {err}", file=sys.stderr)
            return 2
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
