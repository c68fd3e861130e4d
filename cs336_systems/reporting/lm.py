"""End-to-end LM tables.

Tables for the end-to-end suites:
  * per (implementation, precision, eager/compiled, attention): size x context rows, per mode mean +- std ms
    and MFU, tokens/s and peak memory of the train step; OOM cells say OOM;
  * our model vs the Hugging Face LlamaForCausalLM baseline (impl "hf-llama"): both medians and "own / HF",
    the ratio the gates judge, only where both ran in the same saved run;
  * fp32 vs bf16, eager vs compiled and naive vs sdpa attention: same-run medians and speedup;
  * the warm-up study: mean +- std per number of warm-up steps.

Runs saved before the end-to-end suite had an implementation axis measured our own model: an entry without
``impl`` counts as "own"; and before it had an optimizer axis, torch's AdamW: no ``optimizer`` counts as
"adamw".  Tables split by optimizer wherever a run measured several (`optimizer_of`), and by the later axes
(`tables.LM_AXIS_DEFAULTS`: float8 Linear layers, packed documents), which pair only like with like.
"""

from __future__ import annotations

from cs336_systems.bench.workloads.lm import DEFAULT_IMPL as OWN
from cs336_systems.bench.workloads.lm import DEFAULT_OPTIMIZER
from cs336_systems.reporting.tables import (
    CROSS_RUN_MARK,
    LM_AXIS_DEFAULTS,
    LM_FIELDS,
    MODE_ORDER,
    cell_time,
    compile_label,
    fmt,
    md_table,
    same_run_ratio,
    size_order,
    stat_ms,
)

HF = "hf-llama"
IMPL_TITLES = {HF: "Hugging Face LlamaForCausalLM"}


def impl_of(entry: dict) -> str:
    """The implementation an end-to-end entry measured (module docstring: no ``impl`` means our own)."""
    return entry.get("impl") or OWN


def optimizer_of(entry: dict) -> str:
    """The optimizer of an end-to-end entry's train step (module docstring: none recorded means "adamw")."""
    return entry.get("optimizer") or DEFAULT_OPTIMIZER


def _mfu_cell(entry: dict | None) -> str:
    mfu = entry.get("mfu") if entry and entry.get("status") == "ok" else None
    return fmt(None if mfu is None else 100 * mfu, ".1f") + ("%" if mfu else "")


def end_to_end_tables(entries: list[dict]) -> str:
    """One table per (implementation, precision, eager/compiled, attention, batch size): size x context rows;
    our model's tables first, titled as before the baselines existed."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end"]
    out = []

    def variant(e: dict) -> tuple:
        # "compile": False, True or CUDA_GRAPHS (load_entries normalizes CUDA-graph cases)
        return (impl_of(e), e.get("precision"), e.get("compile") or False, e.get("attention"), e.get("batch_size"),
                optimizer_of(e), *(e.get(axis) for axis in LM_AXIS_DEFAULTS))

    for impl, precision, compiled, attention, batch, optimizer, *axes in sorted(
            {variant(e) for e in lm}, key=lambda v: (v[0] != OWN, v[5] != DEFAULT_OPTIMIZER, str(v))):
        subset = [e for e in lm if variant(e) == (impl, precision, compiled, attention, batch, optimizer, *axes)]
        modes = [m for m in MODE_ORDER if any(e.get("mode") == m for e in subset)]
        cells = {(e["size"], e["context"], e["mode"]): e for e in subset}
        header = ["size", "context"]
        for mode in modes:
            header += [f"{mode} ms (mean ± std)", f"{mode} MFU"]
        header += ["tokens/s (last mode)", "peak GiB (last mode)"]
        rows = []
        for size, context in sorted({(e["size"], e["context"]) for e in subset},
                                    key=lambda sc: size_order({"size": sc[0], "context": sc[1]})):
            row = [size, str(context)]
            for mode in modes:
                entry = cells.get((size, context, mode))
                mfu = entry.get("mfu") if entry and entry.get("status") == "ok" else None
                row += [cell_time(entry), fmt(None if mfu is None else 100 * mfu, ".1f") + ("%" if mfu else "")]
            last = cells.get((size, context, modes[-1]))
            ok = last is not None and last.get("status") == "ok"
            row += [
                fmt(last.get("tokens_per_s") if ok else None, ",.0f"),
                fmt(last.get("peak_memory_gib") if ok else None, ".1f") if ok else ("OOM" if last else "-"),
            ]
            rows.append(row)
        which = "" if impl == OWN else f", {impl} baseline ({IMPL_TITLES.get(impl, impl)})"
        title = f"### End-to-end{which}: {precision}, {compile_label(compiled)}, attention={attention}, batch={batch}"
        if optimizer != DEFAULT_OPTIMIZER:
            title += f", optimizer={optimizer}"
        for (axis, default), value in zip(LM_AXIS_DEFAULTS.items(), axes):
            if value not in (default, None):
                title += f", {axis}={value}"
        out.append(title + "\n\n" + md_table(header, rows))
    return "\n\n".join(out)


def baseline_table(entries: list[dict]) -> str:
    """Our model against the hf-llama baseline, case by case: each baseline row with our twin (same size,
    context, batch, mode, precision, eager/compiled, attention), both medians and MFU, and "own / HF" (time
    ratio: below 1 ours is faster), only when both were timed in the same saved run."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end"]
    baselines = [e for e in lm if impl_of(e) == HF]
    if not baselines:
        return ""
    rows = []
    own_optimizers = sorted({optimizer_of(e) for e in lm if impl_of(e) == OWN}, key=lambda o: (o != DEFAULT_OPTIMIZER, o))
    axes = [axis for axis in LM_AXIS_DEFAULTS if len({e.get(axis) for e in lm}) > 1]  # columns where they vary
    for hf in sorted(baselines, key=lambda e: (size_order(e), MODE_ORDER.index(e["mode"]) if e.get("mode") in MODE_ORDER
                                              else len(MODE_ORDER), str(e.get("precision")), bool(e.get("compile")),
                                              optimizer_of(e), *(str(e.get(axis)) for axis in axes))):
        key = tuple(hf.get(f) for f in (*LM_FIELDS, *LM_AXIS_DEFAULTS))
        # one row per optimizer our model ran this case with (HF's optimizer is its own column)
        for optimizer in own_optimizers:
            twins = [e for e in lm if impl_of(e) == OWN and tuple(e.get(f) for f in (*LM_FIELDS, *LM_AXIS_DEFAULTS)) == key
                     and optimizer_of(e) == optimizer]
            if not twins and optimizer != DEFAULT_OPTIMIZER:
                continue
            own = next((e for e in twins if e.get("run") == hf.get("run")), twins[-1] if twins else None)
            ratio = same_run_ratio(own, hf)
            own_ms, hf_ms = stat_ms(own), stat_ms(hf)
            rows.append([str(hf.get("size")), str(hf.get("context")), str(hf.get("batch_size")), str(hf.get("mode")),
                         str(hf.get("precision")), compile_label(hf.get("compile")), str(hf.get("attention")),
                         *(str(hf.get(axis)) for axis in axes), optimizer, optimizer_of(hf),
                         fmt(own_ms, ".2f") if own_ms else cell_time(own), fmt(hf_ms, ".2f") if hf_ms else cell_time(hf),
                         fmt(ratio, ".2f"), _mfu_cell(own), _mfu_cell(hf)])
    header = ["size", "context", "batch", "mode", "precision", "compile", "attention", *axes, "own optimizer",
              "HF optimizer", "own median ms", "HF median ms", "own / HF", "own MFU", "HF MFU"]
    return (f"### Own model vs {HF} ({IMPL_TITLES[HF]})\n\n" + md_table(header, rows)
            + "\n\nown / HF: our median over the baseline's, same saved run only (\"-\" where either is missing or "
            "they come from different runs); below 1, ours is faster.")


def comparison_table(entries: list[dict], field: str, baseline, variant, title: str) -> str:
    """Pair cases that differ only in ``field`` (baseline vs variant): medians and speedup.  Within one
    implementation and optimizer; their columns show only when the entries measured several."""
    lm = [{**e, "impl": impl_of(e), "optimizer": optimizer_of(e)} for e in entries if e.get("test") == "test_end_to_end"]
    shown = [f for f in LM_FIELDS if f != field]
    axes = [axis for axis in LM_AXIS_DEFAULTS if axis != field]
    variants = [k for k in ("impl", "optimizer", *axes) if len({e.get(k) for e in lm}) > 1]
    others = variants + shown
    keys = ["impl", "optimizer", *axes, *shown]
    index = {(tuple(e.get(f) for f in keys), e.get(field)): e for e in lm}
    rows, crossed = [], False
    for (rest, value), base in sorted(index.items(), key=lambda kv: (size_order(kv[1]), str(kv[0]))):
        if value != baseline or (rest, variant) not in index:
            continue
        other = index[(rest, variant)]
        b, v = stat_ms(base), stat_ms(other)
        case = dict(zip(keys, rest))
        label = [str(case.get(f)) if f != "compile" else compile_label(case.get(f)) for f in others]
        speedup = f"{b / v:.2f}x" if b and v else "-"
        if b and v and base.get("run") != other.get("run"):
            speedup += CROSS_RUN_MARK
            crossed = True
        rows.append(label + [fmt(b, ".2f") if b else cell_time(base),
                             fmt(v, ".2f") if v else cell_time(other), speedup])
    if not rows:
        return ""
    header = list(others) + [f"{baseline} median ms", f"{variant} median ms", f"speedup {variant}/{baseline}"]
    note = (f"\n\n{CROSS_RUN_MARK}: the two cases come from different saved runs (times drift between runs; "
            "compare within one run)." if crossed else "")
    return f"### {title}\n\n" + md_table(header, rows) + note


def warmup_table(entries: list[dict]) -> str:
    study = [e for e in entries if e.get("test") == "test_warmup_study"]
    if not study:
        return ""
    rows = []
    for e in sorted(study, key=lambda e: (size_order(e), e.get("mode", ""), str(e.get("precision")),
                                          bool(e.get("compile")), e.get("warmup", 0))):
        rows.append([e["size"], str(e["context"]), e["mode"], e["precision"], compile_label(e.get("compile")),
                     str(e.get("warmup")), cell_time(e), fmt(stat_ms(e, "max"), ".2f"), fmt(stat_ms(e, "min"), ".2f")])
    header = ["size", "context", "mode", "precision", "compile", "warm-up steps", "ms (mean ± std)", "max ms",
              "min ms"]
    return "### Warm-up study\n\n" + md_table(header, rows)


def peak_memory_tables(entries: list[dict]) -> str:
    """End-to-end peak memory (GiB, measured rounds only) per size x context, one column per (mode,
    precision): the handout's "peak memory of the 2.7B model" table, for every size that ran."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end" and not e.get("compile")
          and e.get("attention") == "sdpa" and impl_of(e) == OWN
          and optimizer_of(e) == DEFAULT_OPTIMIZER]  # our model's memory; baselines and optimizers in their tables
    cells = {(e.get("size"), e.get("context"), e.get("batch_size"), e.get("mode"), e.get("precision")): e for e in lm}
    columns = [(m, p) for m in MODE_ORDER for p in ("fp32", "bf16", "fp16")
               if any(k[3] == m and k[4] == p for k in cells)]
    if not columns or not any(e.get("peak_memory_gib") is not None for e in lm):
        return ""
    rows = []
    for size, context, batch in sorted({k[:3] for k in cells}, key=lambda k: (size_order({"size": k[0], "context": k[1]}), k[2])):
        row = [str(size), str(context), str(batch)]
        for mode, precision in columns:
            e = cells.get((size, context, batch, mode, precision))
            if e is None:
                row.append("-")
            elif e.get("status") == "oom":
                row.append("OOM")
            else:
                row.append(fmt(e.get("peak_memory_gib"), ".2f"))
        rows.append(row)
    header = ["size", "context", "batch"] + [f"{m} {p} GiB" for m, p in columns]
    return "### Peak memory (eager, SDPA attention)\n\n" + md_table(header, rows)


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
            ms, base_ms = stat_ms(e), stat_ms(none)
            peak = e.get("peak_memory_gib") if e.get("status") == "ok" else None
            base_peak = none.get("peak_memory_gib") if none and none.get("status") == "ok" else None
            same_run = none is not None and none.get("run") == e.get("run")
            rows.append([
                str(e.get("checkpoint")), cell_time(e),
                f"{ms / base_ms:.2f}x" if ms and base_ms and same_run else "-",
                fmt(peak, ".2f"),
                f"{peak / base_peak:.2f}x" if peak and base_peak and same_run else "-",
            ])
        case = dict(zip(fields, key))
        title = (f"### Activation checkpointing: {case['size']}, context {case['context']}, batch "
                 f"{case['batch_size']}, {case['mode']}, {case['precision']}, {compile_label(case['compile'])}")
        out.append(title + "\n\n" + md_table(["policy", "ms (mean ± std)", "time ÷ none", "peak GiB", "peak ÷ none"],
                                            rows))
    return "\n\n".join(out)


def gpu_clock_table(entries: list[dict]) -> str:
    """The GPU's state while each end-to-end case's measured rounds ran (`bench.gpu_telemetry`, runs that
    recorded it): SM clock median and minimum, power median and maximum, temperature at the start and the
    share of samples with a clock-lowering event (power cap, thermal), and the cool-down waited before the
    case.  A case whose clock sat below its peers' was slowed by the GPU, not by its code.  "host share": the
    host's median time to queue a round over the round's median (`host_share`; near 1 host-bound, "-" for
    runs that did not record it)."""
    lm = [e for e in entries if e.get("test") == "test_end_to_end" and e.get("gpu_samples")]
    if not lm:
        return ""
    rows = []
    for e in sorted(lm, key=lambda e: (size_order(e), e.get("batch_size") or 0, MODE_ORDER.index(e["mode"])
                                       if e.get("mode") in MODE_ORDER else len(MODE_ORDER), str(e.get("precision")),
                                       str(e.get("compile")), impl_of(e),
                                       str(e.get("attention")), optimizer_of(e))):
        reasons = ", ".join(e.get("gpu_slowdown_reasons") or []) or "-"
        rows.append([str(e.get("size")), str(e.get("context")), str(e.get("batch_size")), str(e.get("mode")),
                     str(e.get("precision")), compile_label(e.get("compile")), impl_of(e),
                     str(e.get("attention")), optimizer_of(e), fmt(stat_ms(e), ".2f"), fmt(e.get("host_share"), ".2f"),
                     f"{e['gpu_sm_clock_mhz_median']:.0f} / {e['gpu_sm_clock_mhz_min']:.0f}",
                     f"{e['gpu_power_w_median']:.0f} / {e['gpu_power_w_max']:.0f}",
                     f"{e['gpu_temperature_c_start']} / {e['gpu_temperature_c_max']}",
                     f"{100 * e['gpu_slowdown_fraction']:.0f}% ({reasons})", fmt(e.get("cooldown_s"), ".1f")])
    header = ["size", "context", "batch", "mode", "precision", "compile", "impl", "attention", "optimizer", "median ms",
              "host share", "SM MHz median / min",
              "power W median / max", "temp C start / max", "slowed samples", "cool-down s"]
    return "### GPU clocks during the measured rounds (end-to-end)\n\n" + md_table(header, rows)
