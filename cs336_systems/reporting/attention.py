"""Attention tables.

Tables for the attention suites (median ms: the statistic triton.testing.do_bench reports):
  * attention sweep: d x N rows, per implementation forward ms, backward ms and the memory in use
    before backward; OOM cells say OOM;
  * flash sweep: per (dtype, mode) N x d rows, per implementation ms and TFLOP/s, and the speedup of
    flash-triton over each baseline (baseline ms / flash-triton ms, only when both come from the same
    saved run);
  * leaderboard: ms and TFLOP/s per implementation and mode, and the time relative to SDPA's
    FlashAttention-2 and cuDNN kernels measured in the same run.
"""

from __future__ import annotations

from cs336_systems.reporting.tables import (
    ATTENTION_MODE_ORDER,
    IMPL_ORDER,
    MEASURED_BY,
    TIMING_LABEL,
    distinct,
    fmt,
    md_table,
    ok_field,
    same_run_ratio,
    stat_ms,
)

CONTENDER = "flash-triton"  # the implementation the flash sweep's speedup columns are about


LEADERBOARD_BASELINES = ("sdpa-flash", "sdpa-cudnn")


def impl_order(entries: list[dict]) -> list[str]:
    names = {e.get("impl") for e in entries}
    known = [n for n in IMPL_ORDER if n in names]
    return known + sorted(n for n in names if n not in IMPL_ORDER)


def impl_label(impl: str, compiled) -> str:
    return f"{impl} (compiled)" if compiled else impl


def cell_median(entry: dict | None) -> str:
    """Median ms, OOM, or '-' (not run, skipped: no kernel / not available)."""
    if entry is None:
        return "-"
    if entry.get("status") == "oom":
        return "OOM"
    ms = stat_ms(entry)
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}"


def fmt_rate(value: float | None) -> str:
    """TFLOP/s: one decimal on a GPU (312.4), significant digits for the tiny CPU rates (0.00514)."""
    if value is None:
        return "-"
    return format(value, ".1f") if value >= 10 else format(value, ".3g")


def measurement_suffix(flush_l2, timing) -> str:
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
    fields = ("dtype", "causal", "batch_size", "heads", "kv_heads", "compile", *MEASURED_BY)
    for variant in distinct(sweep, fields):
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, causal, batch, heads, kv_heads, compiled, flush, timing = variant
        impls = impl_order(subset)
        cells = {(e["impl"], e["head_dim"], e["seq_len"], e["mode"]): e for e in subset}
        header = ["d", "N"]
        for impl in impls:
            label = impl_label(impl, compiled)
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
                row += [cell_median(cells.get((impl, d, n, "forward"))), cell_median(backward), memory_cell]
            rows.append(row)
        shape = f"B={batch}" + (f", H={heads}" if heads else "") + (f", Hkv={kv_heads}" if kv_heads else "")
        title = (f"### Attention sweep: {dtype}, {'causal' if causal else 'not causal'}, {shape}"
                 + measurement_suffix(flush, timing))
        out.append(title + " (median ms; memory in use after the forward, before backward)\n\n"
                   + md_table(header, rows))
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
    measured = {(impl, run) for (impl, run), e in in_run.items() if stat_ms(e) is not None}
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
    fields = ("dtype", "mode", "causal", "batch_size", "heads", "kv_heads", "compile", *MEASURED_BY)
    variants = sorted(
        distinct(sweep, fields),
        key=lambda v: (str(v[0]), ATTENTION_MODE_ORDER.index(v[1]) if v[1] in ATTENTION_MODE_ORDER else 9, str(v)),
    )
    for variant in variants:
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, mode, causal, batch, heads, kv_heads, compiled, flush, timing = variant
        impls = impl_order(subset)
        baselines = [i for i in impls if i != contender] if contender in impls else []
        rank = {run: i for i, run in enumerate(dict.fromkeys(e["run"] for e in subset))}  # file order
        cells: dict[tuple, dict[str, list[dict]]] = {}
        for e in subset:
            cells.setdefault((e["seq_len"], e["head_dim"]), {}).setdefault(e["impl"], []).append(e)
        header = ["N", "d"]
        for impl in impls:
            header += [f"{impl_label(impl, compiled)} ms", f"{impl_label(impl, compiled)} TFLOP/s"]
        header += [f"{contender} speedup vs {b}" for b in baselines]
        rows, marked = [], False
        for n, d in sorted(cells):
            shown, pairs = _flash_cell(cells[(n, d)], contender, baselines, rank)
            row = [str(n), str(d)]
            for impl in impls:
                entry = shown.get(impl)
                row += [cell_median(entry), fmt_rate(ok_field(entry, "tflops"))]
            for base in baselines:
                if base not in pairs:
                    row.append("-")
                    continue
                pair = pairs[base]
                mark = "" if pair == (shown.get(base), shown.get(contender)) else SEVERAL_RUNS_MARK
                marked = marked or bool(mark)
                row.append(f"{same_run_ratio(*pair):.2f}x{mark}")
            rows.append(row)
        shape = f"B={batch}" + (f", H={heads}" if heads else "") + (f", Hkv={kv_heads}" if kv_heads else "")
        title = (f"### Flash sweep: {dtype}, {mode}, {'causal' if causal else 'not causal'}, {shape}"
                 + measurement_suffix(flush, timing))
        note = (f"\n\n{SEVERAL_RUNS_MARK}: the case was saved in more than one run; this speedup divides the "
                "two times of the run that measured both, not the times shown." if marked else "")
        out.append(title + " (median ms)\n\n" + md_table(header, rows) + note)
    return "\n\n".join(out)


def leaderboard_table(entries: list[dict], baselines: tuple[str, ...] = LEADERBOARD_BASELINES) -> str:
    """Per mode and implementation: median ms, TFLOP/s, and time relative to each baseline, same run."""
    board = [e for e in entries if e.get("test") == "test_leaderboard"]
    if not board:
        return ""
    shape_fields = ("batch_size", "heads", "seq_len", "head_dim", "dtype", "causal", *MEASURED_BY)
    out = []
    for shape in distinct(board, shape_fields):
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
            order = {impl: i for i, impl in enumerate(impl_order(in_mode))}
            for e in sorted(in_mode, key=lambda e: (order[e["impl"]], bool(e.get("compile")))):
                ratios = [same_run_ratio(e, reference[b]) for b in baselines]
                ratios = ["-" if r is None else f"{r:.2f}" for r in ratios]
                rows.append([mode, impl_label(e["impl"], e.get("compile")), cell_median(e),
                             fmt_rate(ok_field(e, "tflops")), fmt(ok_field(e, "accuracy_error"), ".1e"), *ratios])
        batch, heads, n, d, dtype, causal, flush, timing = shape
        title = (f"### Leaderboard: B={batch}, H={heads}, N={n}, d={d}, {dtype}, "
                 f"{'causal' if causal else 'not causal'}" + (", L2 flushed before every round" if flush else "")
                 + f", {TIMING_LABEL.get(timing, timing)}")
        out.append(title + "\n\n" + md_table(header, rows))
    return "\n\n".join(out)
