"""Saved benchmark runs -> PNG plots (matplotlib: the optional ``plot`` extra).

Input: the entries and machine facts of `cs336_systems.reporting.render.load_runs`.  Each ``*_plots`` function
returns `Plot` specs (file name, title, a function that draws into a fresh figure) without touching
matplotlib, so the report can name and link plots anywhere; `write_plots` draws them:

  * attention sweep (``test_attention``): per (dtype, causal, batch, heads, compile) and mode, median ms
    vs N, and memory in use before backward vs N: log-log, one panel per head dim d, one line per
    implementation (a line that ran out of memory says from which N in its legend label);
  * flash sweep (``test_flash``): per (dtype, mode, ...) TFLOP/s vs N (log2 x), one panel per d, one line
    per implementation;
  * all-reduce (suite ``allreduce``): per backend, bus bandwidth vs message size (log x), one line per
    world size, with the 2xH200 NVLink reference where it applies (`distributed.allreduce_reference`);
  * data parallel (suite ``data_parallel``): per case (size, context, batch, precision, world size,
    backend), DDPBucketed's step time vs bucket size (log x) with horizontal lines for ``none`` (no
    communication), ``torch-ddp`` and the single-bucket DDPBucketed; and the per-rank memory breakdown
    before optimizer.step() as stacked bars per variant (parameters, gradients, optimizer state,
    activations + other).

Drawing uses `matplotlib.figure.Figure` directly, never pyplot: a Figure saved with ``savefig`` renders
through Agg without selecting a global backend or keeping figures alive in pyplot's registry, so the
report works headless and from threads.  PNGs carry no "Software" metadata, so regenerating from the
same runs with the same matplotlib gives the same bytes.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.reporting.attention import impl_label, impl_order
from cs336_systems.reporting.distributed import (
    ALLREDUCE_REFERENCE,
    BASELINE_VARIANT,
    NO_COMM_VARIANT,
    allreduce_reference,
    dp_groups,
    group_title,
    only_variant,
    variant_label,
    variant_order,
)
from cs336_systems.reporting.tables import (
    ATTENTION_MODE_ORDER,
    MEASURED_BY,
    distinct,
    machines_by_run,
    ok_field,
    stat_ms,
    suite_entries,
)

PLOT_EXTRA_HINT = "plots need matplotlib, the `plot` extra: pip install -e '.[plot]'"
DPI = 110
PANEL_INCHES = (4.2, 3.4)  # one subplot
MEMORY_PARTS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations_other", "activations + other"),
)


class MissingPlotExtra(ImportError):
    """matplotlib is not installed (it comes with the ``plot`` extra)."""


@dataclass(frozen=True)
class Plot:
    """One PNG: ``draw(figure)`` fills an empty `matplotlib.figure.Figure` (and sets its size)."""

    filename: str
    title: str
    draw: Callable[[object], None]


def require_matplotlib():
    """The matplotlib.figure module, or MissingPlotExtra naming the extra to install."""
    try:
        from matplotlib import figure
    except ImportError as err:
        raise MissingPlotExtra(PLOT_EXTRA_HINT) from err
    return figure


def write_plots(plots: list[Plot], out_dir: str | Path) -> list[Path]:
    """Draw every plot into ``out_dir`` (created if missing); the PNG paths, in order."""
    figure = require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [p.filename for p in plots]
    if len(set(names)) != len(names):
        raise ValueError(f"plots: duplicate file names {sorted({n for n in names if names.count(n) > 1})}")
    paths = []
    for plot in plots:
        fig = figure.Figure(layout="constrained")
        plot.draw(fig)
        path = out / plot.filename
        fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})
        paths.append(path)
    return paths


def all_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Every plot the entries have data for."""
    return (attention_plots(entries, machines) + flash_plots(entries, machines)
            + allreduce_plots(entries, machines) + ddp_bucket_plots(entries, machines)
            + memory_plots(entries, machines))


# --- helpers -------------------------------------------------------------------------------------------


def _slug(*parts) -> str:
    text = "-".join(str(p) for p in parts if p not in (None, "", False))
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def _device(entries: list[dict], machines: list[dict] | None) -> str:
    """'NVIDIA H200 x2' (or 'CPU') for the runs these entries came from; several joined by ' / '."""
    by_run = machines_by_run(machines)
    labels = []
    for run in sorted({e.get("run") for e in entries}, key=str):
        facts = by_run.get(run, {})
        name = facts.get("gpu_name")
        label = f"{name} x{facts.get('gpu_count') or 1}" if name else "CPU"
        if label not in labels:
            labels.append(label)
    return " / ".join(labels) if labels else "unknown device"


def _panels(fig, count: int):
    """``count`` subplots, at most two per row (readable when the README scales the PNG down)."""
    cols = min(count, 2)
    rows = -(-count // cols)
    fig.set_size_inches(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for extra in axes[count:]:
        extra.set_visible(False)
    return list(axes[:count])


def _wrapped(text: str, fig) -> str:
    """``text`` broken into lines that fit the figure's width (~11 characters per inch at medium size)."""
    return textwrap.fill(text, width=max(40, int(11 * fig.get_size_inches()[0])))


def _variant_title(variant: dict) -> str:
    shape = (f"B={variant['batch_size']}" + (f", H={variant['heads']}" if variant.get("heads") else "")
             + (f", Hkv={variant['kv_heads']}" if variant.get("kv_heads") else ""))
    parts = [str(variant["dtype"]), "causal" if variant.get("causal") else "not causal", shape]
    if variant.get("compile"):
        parts.append("compiled")
    if variant.get("flush_l2"):
        parts.append("L2 flushed")
    if variant.get("timing") not in (None, "host"):  # host-synchronized rounds are the default
        parts.append(f"{variant['timing']} time")
    return ", ".join(parts)


def _variant_slug(variant: dict) -> list:
    return [variant["dtype"], "causal" if variant.get("causal") else "noncausal", f"b{variant['batch_size']}",
            f"h{variant['heads']}" if variant.get("heads") else None,
            f"kv{variant['kv_heads']}" if variant.get("kv_heads") else None, "compiled" if variant.get("compile") else None,
            "flush" if variant.get("flush_l2") else None,
            variant["timing"] if variant.get("timing") not in (None, "host") else None]


def _attention_variants(entries: list[dict], test: str, fields: tuple[str, ...]) -> list[tuple[dict, list]]:
    cases = [e for e in entries if e.get("test") == test]
    out = []
    for values in distinct(cases, fields):
        variant = dict(zip(fields, values))
        out.append((variant, [e for e in cases if all(e.get(f) == variant[f] for f in fields)]))
    return out


def _series(subset: list[dict], impl: str, value: Callable[[dict], float | None]):
    """(N values, y values, first N that ran out of memory or None) of one implementation, by N."""
    xs, ys, oom = [], [], None
    for e in sorted((e for e in subset if e.get("impl") == impl), key=lambda e: e["seq_len"]):
        if e.get("status") == "oom" and oom is None:
            oom = e["seq_len"]
        y = value(e)
        if y is not None:
            xs.append(e["seq_len"])
            ys.append(y)
    return xs, ys, oom


def _impl_lines(ax, subset: list[dict], value: Callable[[dict], float | None], compiled) -> None:
    for impl in impl_order(subset):
        xs, ys, oom = _series(subset, impl, value)
        label = impl_label(impl, compiled) + (f" (OOM from N={oom})" if oom is not None else "")
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        elif oom is not None:  # nothing measured at all: keep it in the legend
            ax.plot([], [], marker="x", linestyle="none", label=label)


def _by_head_dim(subset: list[dict]) -> list[int]:
    return sorted({e["head_dim"] for e in subset})


# --- attention suites ----------------------------------------------------------------------------------


def attention_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Attention sweep: latency vs N per mode, and memory before backward vs N (log-log, panel per d)."""
    fields = ("dtype", "causal", "batch_size", "heads", "kv_heads", "compile", *MEASURED_BY)
    plots = []
    for variant, subset in _attention_variants(entries, "test_attention", fields):
        device = _device(subset, machines)
        for mode in ATTENTION_MODE_ORDER:
            in_mode = [e for e in subset if e.get("mode") == mode]
            if not in_mode:
                continue
            title = f"Attention {mode} latency vs N: {_variant_title(variant)} ({device})"
            plots.append(Plot(_slug("attention-latency", *_variant_slug(variant), mode) + ".png", title,
                              _loglog_drawer(in_mode, title, "median ms", stat_ms, variant.get("compile"))))
        backward = [e for e in subset if e.get("mode") == "backward"]
        if any(e.get("memory_before_backward_gib") is not None for e in backward):
            title = f"Attention memory before backward vs N: {_variant_title(variant)} ({device})"
            plots.append(Plot(_slug("attention-memory", *_variant_slug(variant)) + ".png", title,
                              _loglog_drawer(backward, title, "GiB in use before backward",
                                             lambda e: e.get("memory_before_backward_gib"),
                                             variant.get("compile"))))
    return plots


def _loglog_drawer(subset: list[dict], title: str, ylabel: str, value, compiled) -> Callable:
    def draw(fig) -> None:
        dims = _by_head_dim(subset)
        for ax, d in zip(_panels(fig, len(dims)), dims):
            _impl_lines(ax, [e for e in subset if e["head_dim"] == d], value, compiled)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(title=f"d = {d}", xlabel="sequence length N", ylabel=ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(_wrapped(title, fig))
    return draw


def flash_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Flash sweep: TFLOP/s vs N (log2 x, linear y), one panel per d, one line per implementation."""
    fields = ("dtype", "mode", "causal", "batch_size", "heads", "kv_heads", "compile", *MEASURED_BY)
    plots = []
    variants = sorted(_attention_variants(entries, "test_flash", fields), key=lambda vs: (
        str(vs[0]["dtype"]), ATTENTION_MODE_ORDER.index(vs[0]["mode"])
        if vs[0]["mode"] in ATTENTION_MODE_ORDER else 9, str(vs[0])))
    for variant, subset in variants:
        if not any(ok_field(e, "tflops") is not None for e in subset):
            continue
        if len({e["seq_len"] for e in subset}) < 2:  # one N (a model shape, one GQA point): the report's table says it
            continue
        title = f"Attention {variant['mode']} TFLOP/s vs N: {_variant_title(variant)} ({_device(subset, machines)})"
        filename = _slug("flash-tflops", *_variant_slug(variant), variant["mode"]) + ".png"
        plots.append(Plot(filename, title, _flash_drawer(subset, title, variant.get("compile"))))
    return plots


def _flash_drawer(subset: list[dict], title: str, compiled) -> Callable:
    def draw(fig) -> None:
        dims = _by_head_dim(subset)
        for ax, d in zip(_panels(fig, len(dims)), dims):
            _impl_lines(ax, [e for e in subset if e["head_dim"] == d], lambda e: ok_field(e, "tflops"), compiled)
            ax.set_xscale("log", base=2)
            ax.set(title=f"d = {d}", xlabel="sequence length N", ylabel="TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(_wrapped(title, fig))
    return draw


# --- distributed suites --------------------------------------------------------------------------------


def allreduce_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Per backend: busbw vs message size (log x), one line per world size, reference where it applies."""
    cases = suite_entries(entries, "allreduce")
    by_run = machines_by_run(machines)
    plots = []
    for backend in sorted({str(e.get("backend")) for e in cases}, key=lambda b: (b != "nccl", b)):
        subset = [e for e in cases if str(e.get("backend")) == backend]
        if not any(ok_field(e, "busbw_gbps") is not None for e in subset):
            continue
        where = ", tensors on the CPU" if all(e.get("device") == "cpu" for e in subset) else ""
        title = f"All-reduce bus bandwidth: {backend}, float32{where} ({_device(subset, machines)})"
        plots.append(Plot(_slug("allreduce-busbw", backend) + ".png", title,
                          _allreduce_drawer(subset, title, backend, by_run)))
    return plots


def _allreduce_drawer(subset: list[dict], title: str, backend: str, by_run: dict) -> Callable:
    def draw(fig) -> None:
        (ax,) = _panels(fig, 1)
        fig.set_size_inches(6.4, 4.2)
        for world in sorted({e.get("world_size") for e in subset}, key=lambda w: w or 0):
            points = sorted(((e["size_mb"], ok_field(e, "busbw_gbps")) for e in subset
                             if e.get("world_size") == world and ok_field(e, "busbw_gbps") is not None))
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{world} ranks")
        reference = {}
        for e in subset:
            ref = allreduce_reference(backend, e.get("size_mb"), e.get("world_size"),
                                         by_run.get(e.get("run"), {}).get("gpu_name"))
            if ref is not None:
                reference[e["size_mb"]] = ref
        label = f"reference ({ALLREDUCE_REFERENCE['world_size']}x{ALLREDUCE_REFERENCE['gpu']} NVLink)"
        ranges = {v for v in reference.values() if isinstance(v, tuple)}
        for low, high in ranges:
            ax.axhspan(low, high, color="grey", alpha=0.2, label=label)
        numbers = sorted((k, v) for k, v in reference.items() if not isinstance(v, tuple))
        if numbers:
            ax.plot(*zip(*numbers), marker="x", linestyle="--", color="grey", label=label)
        ax.set_xscale("log")
        ax.set(xlabel="message size (MiB)", ylabel="busbw (GB/s)")
        ax.set_title(_wrapped(title, fig), fontsize="medium")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return draw


def _group_slug(key: tuple) -> list:
    size, context, batch, precision, world, backend = key
    return [size, f"ctx{context}", f"b{batch}", precision, f"{world}ranks", backend]


def ddp_bucket_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Per data_parallel case with bucket sizes: step ms vs bucket size, with none / torch-ddp lines."""
    plots = []
    for key, group in dp_groups(entries):
        sized = [e for e in group if e.get("variant") == "bucketed" and e.get("bucket_size_mb") is not None
                 and stat_ms(e) is not None]
        if not sized:
            continue
        title = f"DDPBucketed step time vs bucket size: {group_title(key)} ({_device(group, machines)})"
        plots.append(Plot(_slug("ddp-buckets", *_group_slug(key)) + ".png", title,
                          _bucket_drawer(group, sized, title)))
    return plots


def _bucket_drawer(group: list[dict], sized: list[dict], title: str) -> Callable:
    def draw(fig) -> None:
        (ax,) = _panels(fig, 1)
        fig.set_size_inches(7.0, 4.4)
        points = sorted((e["bucket_size_mb"], stat_ms(e)) for e in sized)
        ax.plot(*zip(*points), marker="o", color="C0", label="bucketed")
        runs = {e.get("run") for e in sized}
        single = [e for e in group if e.get("variant") == "bucketed" and e.get("bucket_size_mb") is None]
        lines = [(only_variant(group, NO_COMM_VARIANT), "none (no communication)", "C2", "-"),
                 (only_variant(group, BASELINE_VARIANT), "torch-ddp", "C3", "-"),
                 (single[0] if single else None, "bucketed (one bucket)", "C0", ":")]
        for entry, label, color, style in lines:
            if stat_ms(entry) is None:
                continue
            other_run = entry.get("run") not in runs
            ax.axhline(stat_ms(entry), color=color, linestyle=style,
                       label=label + (" (another run)" if other_run else ""))
        ax.set_xscale("log")
        ax.set(xlabel="bucket size (MiB)", ylabel="median step ms (slowest rank)")
        ax.set_title(_wrapped(title, fig), fontsize="medium")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return draw


def memory_plots(entries: list[dict], machines: list[dict] | None = None) -> list[Plot]:
    """Per data_parallel case that recorded memory: stacked bars of the per-rank breakdown per variant."""
    plots = []
    for key, group in dp_groups(entries):
        bars = [(variant_label(e), _ok_memory(e)) for e in sorted(group, key=variant_order)]
        bars = [(label, memory) for label, memory in bars if memory]
        if not bars:
            continue  # a CPU run records no CUDA memory
        title = f"Memory per rank before optimizer.step(): {group_title(key)} ({_device(group, machines)})"
        plots.append(Plot(_slug("memory", *_group_slug(key)) + ".png", title, _memory_drawer(bars, title)))
    return plots


def _ok_memory(entry: dict) -> dict | None:
    memory = ok_field(entry, "memory_gib") or {}
    return memory if any(memory.get(field) is not None for field, _ in MEMORY_PARTS) else None


def _memory_drawer(bars: list[tuple[str, dict]], title: str) -> Callable:
    def draw(fig) -> None:
        (ax,) = _panels(fig, 1)
        fig.set_size_inches(max(6.0, 0.75 * len(bars) + 2.5), 4.8)
        labels = [label for label, _ in bars]
        bottom = [0.0] * len(bars)
        for field, name in MEMORY_PARTS:
            heights = [memory.get(field) or 0.0 for _, memory in bars]
            ax.bar(labels, heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(ylabel="GiB per rank")
        ax.set_title(_wrapped(title, fig), fontsize="medium")
        ax.tick_params(axis="x", labelrotation=45)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    return draw
