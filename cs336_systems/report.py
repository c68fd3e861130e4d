"""Saved pytest-benchmark runs -> Markdown tables.

    python -m cs336_systems.report RUN.json [RUN2.json ...] [-o report.md]

Reads the JSON written by ``pytest perf/ --benchmark-autosave`` (or ``--benchmark-json``): the timed
benchmarks with their ``extra_info`` (the case and derived rates) plus this project's ``"oom"`` list.
Later files override earlier ones for the same case, so a sweep run in groups can be merged.

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
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from cs336_systems.machine import COMPARABLE_FIELDS

LM_FIELDS = ("size", "context", "batch_size", "mode", "precision", "compile", "attention")
ATTENTION_FIELDS = ("impl", "heads", "seq_len", "head_dim", "dtype", "causal", "flush_l2")
MODE_ORDER = ("forward", "forward-backward", "train-step")
ATTENTION_MODE_ORDER = ("forward", "backward", "forward-backward")
IMPL_ORDER = ("naive", "naive-compiled", "flash-pytorch", "flash-triton", "sdpa", "sdpa-flash", "sdpa-cudnn",
              "sdpa-efficient")
CONTENDER = "flash-triton"  # the implementation the flash sweep's speedup columns are about
LEADERBOARD_BASELINES = ("sdpa-flash", "sdpa-cudnn")
SIZE_ORDER = ("tiny", "small", "medium", "large", "xl", "2.7B")


def load_runs(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """Entries (one dict per case: extra_info + 'stats' or status 'oom') and each run's machine facts."""
    by_case: dict[tuple, dict] = {}
    machines = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        machines.append(data.get("machine_info", {}).get("cs336_systems", {}) | {"file": str(path)})
        for bench in data.get("benchmarks", []):
            entry = {**bench.get("extra_info", {}), "test": bench.get("name", "").split("[")[0], "run": str(path)}
            entry["status"] = entry.get("status", "ok")
            entry["stats"] = bench.get("stats", {})
            by_case[_key(entry)] = entry
        for oom in data.get("oom", []):
            entry = {**oom.get("extra_info", {}), "test": oom.get("name", "").split("[")[0], "run": str(path)}
            entry.update(status="oom", stats={}, error=oom.get("error"))
            by_case[_key(entry)] = entry
    return list(by_case.values()), machines


def _key(entry: dict) -> tuple:
    return (entry.get("test"),) + tuple(entry.get(f) for f in (*LM_FIELDS, "warmup", *ATTENTION_FIELDS))


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


def attention_sweep_tables(entries: list[dict]) -> str:
    """The handout's attention sweep: d x N rows; forward ms, backward ms, memory before backward per impl."""
    sweep = [e for e in entries if e.get("test") == "test_attention"]
    out = []
    fields = ("dtype", "causal", "batch_size", "heads", "compile")
    for variant in _variants(sweep, fields):
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, causal, batch, heads, compiled = variant
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
        title = f"### Attention sweep: {dtype}, {'causal' if causal else 'not causal'}, {shape}"
        out.append(title + " (median ms; memory in use after the forward, before backward)\n\n"
                   + _table(header, rows))
    return "\n\n".join(out)


def flash_tables(entries: list[dict], contender: str = CONTENDER) -> str:
    """Per (dtype, mode): N x d rows, ms and TFLOP/s per impl, speedup of ``contender`` over each baseline."""
    sweep = [e for e in entries if e.get("test") == "test_flash"]
    out = []
    fields = ("dtype", "mode", "causal", "batch_size", "heads", "compile")
    variants = sorted(
        _variants(sweep, fields),
        key=lambda v: (str(v[0]), ATTENTION_MODE_ORDER.index(v[1]) if v[1] in ATTENTION_MODE_ORDER else 9, str(v)),
    )
    for variant in variants:
        subset = [e for e in sweep if tuple(e.get(f) for f in fields) == variant]
        dtype, mode, causal, batch, heads, compiled = variant
        impls = _impls(subset)
        baselines = [i for i in impls if i != contender] if contender in impls else []
        cells = {(e["impl"], e["seq_len"], e["head_dim"]): e for e in subset}
        header = ["N", "d"]
        for impl in impls:
            header += [f"{_impl_label(impl, compiled)} ms", f"{_impl_label(impl, compiled)} TFLOP/s"]
        header += [f"{contender} speedup vs {b}" for b in baselines]
        rows = []
        for n, d in sorted({(e["seq_len"], e["head_dim"]) for e in subset}):
            row = [str(n), str(d)]
            for impl in impls:
                entry = cells.get((impl, n, d))
                row += [_cell_median(entry), _fmt_rate(_ok(entry, "tflops"))]
            for base in baselines:
                speedup = _same_run_ratio(cells.get((base, n, d)), cells.get((contender, n, d)))
                row.append("-" if speedup is None else f"{speedup:.2f}x")
            rows.append(row)
        shape = f"B={batch}" + (f", H={heads}" if heads else "")
        title = f"### Flash sweep: {dtype}, {mode}, {'causal' if causal else 'not causal'}, {shape}"
        out.append(title + " (median ms)\n\n" + _table(header, rows))
    return "\n\n".join(out)


def leaderboard_table(entries: list[dict], baselines: tuple[str, ...] = LEADERBOARD_BASELINES) -> str:
    """Per mode and implementation: median ms, TFLOP/s, and time relative to each baseline, same run."""
    board = [e for e in entries if e.get("test") == "test_leaderboard"]
    if not board:
        return ""
    shape_fields = ("batch_size", "heads", "seq_len", "head_dim", "dtype", "causal", "flush_l2")
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
        batch, heads, n, d, dtype, causal, flush = shape
        title = (f"### Leaderboard: B={batch}, H={heads}, N={n}, d={d}, {dtype}, "
                 f"{'causal' if causal else 'not causal'}" + (", L2 flushed before every round" if flush else ""))
        out.append(title + "\n\n" + _table(header, rows))
    return "\n\n".join(out)


def machine_section(machines: list[dict]) -> str:
    rows = [[m.get("file", "")] + [str(m.get(f)) for f in (*COMPARABLE_FIELDS, "driver", "cudnn")] for m in machines]
    return _table(["run", *COMPARABLE_FIELDS, "driver", "cudnn"], rows)


def render(paths: list[str | Path]) -> str:
    entries, machines = load_runs(paths)
    sections = [
        "# Benchmark report",
        machine_section(machines),
        "Times are per step; MFU uses model FLOPs (cs336_systems.flops) over the datasheet dense peak "
        "(cs336_systems.machine) unless the run passed --peak-tflops.",
        end_to_end_tables(entries),
        comparison_table(entries, "precision", "fp32", "bf16", "fp32 vs bf16 autocast"),
        comparison_table(entries, "compile", False, True, "eager vs torch.compile"),
        comparison_table(entries, "attention", "naive", "sdpa", "naive vs SDPA attention"),
        warmup_table(entries),
        attention_sweep_tables(entries),
        flash_tables(entries),
        leaderboard_table(entries),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="saved pytest-benchmark JSON files")
    parser.add_argument("-o", "--output", help="write Markdown here instead of stdout")
    args = parser.parse_args(argv)
    text = render(args.runs)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
