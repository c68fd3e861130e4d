"""Distributed tables.

Tables for the distributed suites (cases identified by ``extra_info["suite"]``; every time is the slowest
rank's per-round median):
  * allreduce: per backend, size x world-size rows: time per all-reduce, algbw and busbw (as recorded by
    cs336_systems.bench.workloads.allreduce), and busbw over the 2xH200 NVLink reference (`ALLREDUCE_REFERENCE`);
  * data_parallel: per (size, context, batch, precision, world size, backend) one row per variant
    (bucketed: per bucket size): step ms, ratio to torch DDP and to the no-communication step,
    synchronization time and share, and the part of NaiveDDP's communication time the overlapping
    wrappers hide; the two DDP targets (`DDP_TARGETS`) evaluated on this run's numbers; a summary of
    step times per precision; a memory table per case;
  * the DDP bucket model (only when both suites are present): o and w fitted to the all-reduce times of
    the same backend and world size (cs336_systems.tools.accounting), s = gradient bytes of the model, the
    predicted optimal bucket sqrt(s o w) and overhead curve next to the measured step times.
"""

from __future__ import annotations

import functools
import math

from cs336_systems.reporting.attention import (
    cell_median,
)
from cs336_systems.reporting.tables import (
    CROSS_RUN_MARK,
    GiB,
    MiB,
    fmt,
    fmt_duration,
    fmt_mib,
    fmt_percent,
    fmt_ratio,
    machines_by_run,
    md_table,
    ok_field,
    run_ratio,
    size_order,
    stat_ms,
    suite_entries,
)
from cs336_systems.tools import accounting

# Reference all-reduce bus bandwidths measured with NCCL on 2xH200 (also quoted in benchmarks.json's
# allreduce description): 2xH200 with NVLink, 2 ranks.  NCCL: busbw in
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


# The DDP targets: DDPBucketed's best bucket size at most 0.98x torch DDP's step time, and
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


def allreduce_reference(backend: str, size_mb, world_size, gpu_name: str | None):
    """The reference busbw (GB/s) for this case: a number (NCCL), a (low, high) range (gloo), or
    None where the reference does not apply (another world size, another GPU, an unlisted size)."""
    ref = ALLREDUCE_REFERENCE
    if world_size != ref["world_size"] or ref["gpu"] not in (gpu_name or ""):
        return None
    table = ref.get(backend)
    if isinstance(table, dict):
        return table.get(size_mb)
    return table


def reference_cells(busbw: float | None, reference) -> list[str]:
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
    cases = suite_entries(entries, "allreduce")
    by_run = machines_by_run(machines)
    out = []
    for backend in sorted({str(e.get("backend")) for e in cases}):
        subset = sorted((e for e in cases if str(e.get("backend")) == backend),
                        key=lambda e: (e.get("size_mb") or 0, e.get("world_size") or 0))
        rows = []
        for e in subset:
            ok = e.get("status") == "ok"
            median = e["stats"].get("median") if ok else None
            busbw = ok_field(e, "busbw_gbps")
            gpu = by_run.get(e.get("run"), {}).get("gpu_name")
            reference = allreduce_reference(backend, e.get("size_mb"), e.get("world_size"), gpu)
            time_cell = fmt_duration(median) if ok else ("OOM" if e.get("status") == "oom" else "-")
            rows.append([fmt_mib(e.get("size_mb")), str(e.get("world_size")), time_cell,
                         fmt(ok_field(e, "algbw_gbps"), ".1f"), fmt(busbw, ".1f"),
                         *reference_cells(busbw, reference)])
        header = ["size MiB", "ranks", "median time per all-reduce", "algbw GB/s", "busbw GB/s",
                  "reference busbw GB/s", "busbw ÷ reference"]
        out.append(f"### All-reduce: {backend} (float32; slowest rank's median per all-reduce)\n\n"
                   + md_table(header, rows))
    if not out:
        return ""
    ref = ALLREDUCE_REFERENCE
    nccl = ", ".join(f"{fmt_mib(k)} MiB {v:g}" for k, v in ref["nccl"].items())
    note = (f"busbw = algbw · 2(n−1)/n (nccl-tests). Reference: {ref['world_size']}×{ref['gpu']} "
            f"(NVLink) numbers, applied to {ref['world_size']}-rank runs on that GPU only: NCCL busbw {nccl} "
            f"GB/s; gloo {ref['gloo'][0]:g}–{ref['gloo'][1]:g} GB/s.")
    return "\n\n".join(out) + "\n\n" + note


def dp_groups(entries: list[dict]) -> list[tuple[tuple, list[dict]]]:
    cases = suite_entries(entries, "data_parallel")
    keys = sorted({tuple(e.get(f) for f in DP_GROUP_FIELDS) for e in cases},
                  key=lambda k: (size_order({"size": k[0], "context": k[1] or 0, "batch_size": k[2] or 0}), str(k)))
    return [(k, [e for e in cases if tuple(e.get(f) for f in DP_GROUP_FIELDS) == k]) for k in keys]


def variant_order(entry: dict) -> tuple:
    variant = entry.get("variant")
    bucket = entry.get("bucket_size_mb")
    return (VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER), str(variant),
            math.inf if bucket is None else bucket)


def variant_label(entry: dict) -> str:
    variant, bucket = entry.get("variant"), entry.get("bucket_size_mb")
    if variant == "bucketed":
        return f"bucketed {fmt_mib(bucket)} MiB" if bucket is not None else "bucketed (one bucket)"
    if bucket is not None:
        return f"{variant} ({fmt_mib(bucket)} MiB buckets)"
    return str(variant)


def group_title(key: tuple) -> str:
    size, context, batch, precision, world, backend = key
    return f"{size}, context {context}, per-rank batch {batch}, {precision}, {world} ranks ({backend})"


def only_variant(entries: list[dict], variant: str) -> dict | None:
    found = [e for e in entries if e.get("variant") == variant]
    return found[0] if found else None


def sync_ms(entry: dict | None) -> float | None:
    value = ok_field(entry, "sync_ms")
    return float(value) if value is not None else None


def hidden_fraction(entry: dict | None, naive: dict | None, by_run: dict[str, dict] | None = None
                    ) -> tuple[float | None, bool]:
    """1 - sync_ms(entry) / sync_ms(naive): the share of NaiveDDP's communication time that overlapping
    with backward hid (same run; across runs of identical machine facts marked as such)."""
    ratio, cross = run_ratio(sync_ms(entry), sync_ms(naive), entry, naive, by_run or {})
    return (None, False) if ratio is None else (1 - ratio, cross)


def ddp_targets(group: list[dict]) -> dict:
    """The DDP targets on one data_parallel case, from same-run numbers only.

    Returns {"bucketed": (best bucketed entry or None, its step / torch DDP's step or None, met or None),
             "individual": (hidden fraction or None, met or None)}; None = not measured in one run.
    """
    base = only_variant(group, BASELINE_VARIANT)
    candidates = [e for e in group if e.get("variant") == "bucketed" and stat_ms(e) is not None
                  and base is not None and e.get("run") == base.get("run")]
    best = min(candidates, key=stat_ms) if candidates and stat_ms(base) else None
    ratio = stat_ms(best) / stat_ms(base) if best is not None else None
    bucketed_met = None if ratio is None else ratio <= DDP_TARGETS["bucketed_max_ratio"]
    hidden, _ = hidden_fraction(only_variant(group, "individual"), only_variant(group, "naive"))  # no machines: same run
    individual_met = None if hidden is None else hidden >= DDP_TARGETS["individual_min_hidden"]
    return {"bucketed": (best, ratio, bucketed_met), "individual": (hidden, individual_met)}


def verdict(met: bool | None) -> str:
    return "not measured in one run" if met is None else ("**met**" if met else "**not met**")


def targets_text(group: list[dict]) -> str:
    targets = ddp_targets(group)
    best, ratio, met = targets["bucketed"]
    limit = DDP_TARGETS["bucketed_max_ratio"]
    if best is not None:
        bucketed = (f"best is {variant_label(best)} at {stat_ms(best):.2f} ms = {ratio:.3f}x torch DDP "
                    f"-> {verdict(met)}")
    else:
        bucketed = verdict(None)
    hidden, met_hidden = targets["individual"]
    floor = DDP_TARGETS["individual_min_hidden"]
    individual = (f"{100 * hidden:.1f}% -> {verdict(met_hidden)}" if hidden is not None else verdict(None))
    return (f"Targets: DDPBucketed's best bucket size ≤ {limit:g}x torch DDP's step: {bucketed}. "
            f"DDPIndividualParameters hides ≥ {100 * floor:.0f}% of NaiveDDP's communication time "
            f"(1 − sync ms ÷ naive sync ms): {individual}.")


def data_parallel_tables(entries: list[dict], machines: list[dict] | None = None) -> str:
    """Per data_parallel case: one row per variant (bucketed: per bucket size) and the DDP targets."""
    by_run = machines_by_run(machines)
    out = []
    for key, group in dp_groups(entries):
        base, none, naive = (only_variant(group, v) for v in (BASELINE_VARIANT, NO_COMM_VARIANT, "naive"))
        rows = []
        for e in sorted(group, key=variant_order):
            step = stat_ms(e)
            hidden = hidden_fraction(e, naive, by_run) if e.get("variant") in HIDING_VARIANTS else (None, False)
            share = ok_field(e, "sync_share")
            rows.append([
                variant_label(e), cell_median(e),
                fmt_ratio(run_ratio(step, stat_ms(base), e, base, by_run)),
                fmt_ratio(run_ratio(step, stat_ms(none), e, none, by_run)),
                fmt(sync_ms(e), ".2f"), fmt(None if share is None else 100 * share, ".1f"),
                fmt_percent(hidden), fmt(ok_field(e, "num_buckets"), "d"),
            ])
        header = ["variant", "median step ms", "÷ torch-ddp", "÷ none", "sync ms", "sync % of step",
                  "naive comm hidden", "buckets"]
        out.append(f"### Data parallel: {group_title(key)}\n\n" + md_table(header, rows) + "\n\n"
                   + targets_text(group))
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
    by_run = machines_by_run(machines)
    groups = dp_groups(entries)
    shapes = {tuple(v for f, v in zip(DP_GROUP_FIELDS, k) if f != "precision") for k, _ in groups}
    if len(shapes) != 1:
        return ""
    precisions = [k[DP_GROUP_FIELDS.index("precision")] for k, _ in groups]
    columns = {}
    for key, group in groups:
        base = only_variant(group, BASELINE_VARIANT)
        best = {}
        for e in group:
            label = "bucketed (best)" if e.get("variant") == "bucketed" else variant_label(e)
            if e.get("variant") == "bucketed" and label in best and (
                    stat_ms(e) is None or (stat_ms(best[label]) is not None and stat_ms(best[label]) <= stat_ms(e))):
                continue
            best[label] = e
        columns[key[DP_GROUP_FIELDS.index("precision")]] = (best, base)
    labels = sorted({label for best, _ in columns.values() for label in best},
                    key=lambda lab: variant_order(next(b[lab] for b, _ in columns.values() if lab in b)))
    rows = []
    for label in labels:
        row = [label]
        for precision in precisions:
            best, base = columns[precision]
            e = best.get(label)
            cell = cell_median(e)
            if e is not None and e.get("variant") == "bucketed" and stat_ms(e) is not None:
                bucket = e.get("bucket_size_mb")
                cell += " (one bucket)" if bucket is None else f" ({fmt_mib(bucket)} MiB)"
            row += [cell, fmt_ratio(run_ratio(stat_ms(e), stat_ms(base), e, base, by_run), ".2f")]
        rows.append(row)
    header = ["variant"] + [h for p in precisions for h in (f"{p} step ms", f"{p} ÷ torch-ddp")]
    size, context, batch, world, backend = next(iter(shapes))
    return (f"### Data parallel summary: {size}, context {context}, per-rank batch {batch}, {world} ranks "
            f"({backend})\n\n" + md_table(header, rows) + "\n\nMedian step ms (slowest rank); bucketed: its "
            f"fastest bucket size. {CROSS_RUN_MARK}: torch-ddp was measured in another saved run with the same "
            "machine facts (a cross-run ratio; times drift between runs).")


def data_parallel_memory_tables(entries: list[dict]) -> str:
    """Per data_parallel case: variant -> memory after construction, peaks, breakdown before the step."""
    out = []
    for key, group in dp_groups(entries):
        rows = []
        for e in sorted(group, key=variant_order):
            memory = ok_field(e, "memory_gib") or {}
            if e.get("status") == "oom":
                cells = ["OOM"] * len(MEMORY_FIELDS)
            else:
                cells = [fmt(memory.get(field), ".2f") for field, _ in MEMORY_FIELDS]
            rows.append([variant_label(e), *cells])
        if all(cell == "-" for row in rows for cell in row[1:]):
            continue  # a CPU run records no CUDA memory
        header = ["variant"] + [f"{label} GiB" for _, label in MEMORY_FIELDS]
        out.append(f"### Data parallel memory per rank: {group_title(key)}\n\n" + md_table(header, rows))
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


def bucket_model_section(key: tuple, group: list[dict], allreduce: list[dict]) -> str:
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
    bucketed = sorted((e for e in group if e.get("variant") == "bucketed"), key=variant_order)
    if not bucketed or not points:
        return ""
    title = f"### DDP bucket model: {group_title(key)}"
    sizes = ", ".join(fmt_mib(e["bytes"] / MiB) for e in points)
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

    none = only_variant(group, NO_COMM_VARIANT)
    rows, predicted = [], []
    for e in bucketed:
        bucket = e.get("bucket_size_mb")
        n_model = 1.0 if bucket is None else max(1.0, s / (bucket * MiB))
        n_formed = ok_field(e, "num_buckets")
        model_ms, formed_ms = overhead_ms(n_model), overhead_ms(n_formed)
        predicted.append((e, formed_ms if formed_ms is not None else model_ms))
        same_run = none is not None and stat_ms(none) and stat_ms(e) and e.get("run") == none.get("run")
        rows.append([
            "one bucket" if bucket is None else fmt_mib(bucket), f"{n_model:.1f}", fmt(n_formed, "d"),
            fmt(model_ms, ".2f"), fmt(formed_ms, ".2f"), cell_median(e),
            fmt(stat_ms(e) - stat_ms(none) if same_run else None, ".2f"), fmt(sync_ms(e), ".2f"),
        ])
    measured = [e for e in bucketed if stat_ms(e) is not None]
    if measured:
        best = min(measured, key=stat_ms)
        bullets.append(f"measured best bucket size: {variant_label(best)} ({stat_ms(best):.2f} ms per step)")
    modelled = [(e, p) for e, p in predicted if p is not None]
    if modelled:
        e, p = min(modelled, key=lambda pair: pair[1])
        bullets.append(f"among the measured bucket sizes the model predicts the least overhead for "
                       f"{variant_label(e)} ({p:.2f} ms)")
    header = ["bucket MiB", "n_b = s ÷ bucket", "buckets formed", "predicted overhead ms (n_b = s ÷ bucket)",
              "predicted overhead ms (buckets formed)", "measured step ms", "step − none ms (same run)",
              "sync ms"]
    return (title + "\n\n" + "\n".join(f"- {b}" for b in bullets) + "\n\n" + md_table(header, rows) + "\n\n"
            "overhead(n_b) = n_b·o + s ÷ (n_b·w) (cs336_systems.tools.accounting). The wrapper never splits a "
            "parameter, so small bucket sizes form fewer buckets than s ÷ bucket.")


def bucket_model_sections(entries: list[dict]) -> str:
    """The DDP bucket model next to the measurements; empty unless both distributed suites are present."""
    allreduce = suite_entries(entries, "allreduce")
    if not allreduce:
        return ""
    sections = [bucket_model_section(key, group, allreduce) for key, group in dp_groups(entries)]
    return "\n\n".join(s for s in sections if s)
