"""The README's generated "Results" block: ``python -m cs336_systems.report --readme README.md``.

Rewrites the block between ``<!-- results:start -->`` and ``<!-- results:end -->`` in the README's
"## Results" section from the committed runs listed in `README_RESULTS`: the H200 2.7B train step per
model and optimizer, the H100 attention leaderboard, and the sections' plots, each with device, versions, date and commit.  Only runs
saved at a clean commit go in: a run from a work tree with uncommitted changes, or one that records no
commit, cannot be traced to code, and is refused (`UntraceableRun`).  `data_parallel_readme` renders the
multi-GPU groups' runs as a section, for when such runs are at clean commits.  Everything outside the markers is left as it is; running it twice changes
nothing.  The tables reuse cs336_systems.reporting.render's formatting helpers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cs336_systems.reporting.attention import cell_median, fmt_rate, impl_label
from cs336_systems.reporting.distributed import (
    allreduce_reference,
    data_parallel_summary,
    dp_groups,
    group_title,
    targets_text,
)
from cs336_systems.reporting.lm import DEFAULT_OPTIMIZER, HF, OWN, impl_of, optimizer_of
from cs336_systems.reporting.tables import (
    ATTENTION_MODE_ORDER,
    CROSS_RUN_MARK,
    MODE_ORDER,
    TIMING_LABEL,
    commit_label,
    distinct,
    fmt,
    fmt_mib,
    fmt_ratio,
    load_runs,
    machines_by_run,
    md_table,
    ok_field,
    relative_link,
    run_ratio,
    same_run_ratio,
    stat_ms,
    suite_entries,
)

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"
README_HEADING = "## Results"
README_COMMAND = "python -m cs336_systems.report --readme README.md"
# The end-to-end headline case: the handout's largest model at the context and batch the H100 runs used.
HEADLINE_CASE = {"size": "2.7B", "context": 512, "batch_size": 4, "precision": "bf16", "attention": "sdpa"}
LEADERBOARD_COLUMNS = (("flash-triton", True), ("sdpa-flash", False), ("sdpa-cudnn", False))


def headline_table(entries: list[dict], machines: list[dict]) -> str:
    """Per mode of HEADLINE_CASE: eager and compiled median ms, TFLOP/s, MFU, and compiled ÷ eager.

    Where the runs also hold the hf-llama baseline (transformers' LlamaForCausalLM) at that case, each mode
    gets a row per implementation and our rows add "own / HF" for eager and compiled (same saved run only,
    the ratio the gates judge); without it the table is our model's alone.
    """
    by_run = machines_by_run(machines)
    lm = [e for e in entries if e.get("test") == "test_end_to_end" and optimizer_of(e) == DEFAULT_OPTIMIZER
          and all(e.get(k) == v for k, v in HEADLINE_CASE.items())]
    cells = {(impl_of(e), e.get("mode"), bool(e.get("compile"))): e for e in lm if not e.get("cuda_graphs")}
    with_hf = any(impl == HF for impl, _, _ in cells)
    rows = []
    for mode in [m for m in MODE_ORDER if any(e.get("mode") == m for e in lm)]:
        for impl in (OWN, HF) if with_hf else (OWN,):
            if not any(k[:2] == (impl, mode) for k in cells):
                continue
            row = [mode] + ([impl] if with_hf else [])
            for compiled in (False, True):
                e = cells.get((impl, mode, compiled))
                mfu = ok_field(e, "mfu")
                row += [cell_median(e), fmt(ok_field(e, "tflops"), ".0f"),
                        "-" if mfu is None else f"{100 * mfu:.1f}%"]
            eager, compiled = cells.get((impl, mode, False)), cells.get((impl, mode, True))
            row.append(fmt_ratio(run_ratio(stat_ms(compiled), stat_ms(eager), compiled, eager, by_run), ".2f", ""))
            if with_hf:
                for flag in (False, True):
                    ratio = same_run_ratio(cells.get((OWN, mode, flag)), cells.get((HF, mode, flag)))
                    row.append("-" if impl != OWN or ratio is None else f"{ratio:.2f}")
            rows.append(row)
    if not rows:
        return ""
    peaks = sorted({e.get("peak_tflops") for e in lm if e.get("peak_tflops")})
    case = HEADLINE_CASE
    header = ["mode"] + (["impl"] if with_hf else []) + [
        "eager median ms", "eager TFLOP/s", "eager MFU", "compiled median ms", "compiled TFLOP/s", "compiled MFU",
        "compiled ÷ eager"] + (["own / HF eager", "own / HF compiled"] if with_hf else [])
    baseline = (" hf-llama: Hugging Face LlamaForCausalLM of the same size (SDPA, same step); own / HF below 1: "
                "ours is faster." if with_hf else "")
    return (f"{case['size']} model, {case['precision']} autocast, batch {case['batch_size']}, context "
            f"{case['context']}, {case['attention']} attention; train step = forward + backward + fused AdamW; "
            "compiled = per-block torch.compile.\n\n" + md_table(header, rows) + "\n\n"
            f"MFU against the dense datasheet peak ({', '.join(f'{p:g}' for p in peaks)} TFLOP/s). "
            f"{CROSS_RUN_MARK}: eager and compiled come from two saved runs with the same machine facts." + baseline)


# The optimizers of the end-to-end grids, in the order the optimizer table shows them.
OPTIMIZER_TITLES = {"adamw": "torch AdamW, float32 weights", "adamw-master": "AdamWMaster (bf16 compute weights)",
                    "adamw-master-fp32": "AdamWMaster, float32 master copies"}


def optimizer_table(entries: list[dict], machines: list[dict]) -> str:
    """The compiled train step of HEADLINE_CASE per optimizer (rows) and model (own, HF): median ms, MFU and
    peak memory, "own / HF" with the same optimizer, and a last row with each model's fastest optimizer.

    Every cell must come from one saved run (ValueError otherwise): the ratios are same-run ratios."""
    steps = [e for e in entries if e.get("test") == "test_end_to_end" and e.get("mode") == "train-step"
             and e.get("compile") and not e.get("cuda_graphs") and e.get("status") == "ok"
             and all(e.get(k) == v for k, v in HEADLINE_CASE.items())]
    if len({e.get("run") for e in steps}) > 1:
        raise ValueError("optimizer_table: its cells must come from one saved run (same-run ratios)")
    cells = {(impl_of(e), optimizer_of(e)): e for e in steps}
    order = list(OPTIMIZER_TITLES) + sorted({opt for _, opt in cells} - set(OPTIMIZER_TITLES))
    rows = []

    def model_cells(e):
        mfu = ok_field(e, "mfu")
        memory = ok_field(e, "peak_memory_gib")
        return [cell_median(e), "-" if mfu is None else f"{100 * mfu:.1f}%", fmt(memory, ".1f")]

    for opt in [o for o in order if any(k[1] == o for k in cells)]:
        own, hf = cells.get((OWN, opt)), cells.get((HF, opt))
        ratio = same_run_ratio(own, hf)
        rows.append([OPTIMIZER_TITLES.get(opt, opt)] + model_cells(own) + model_cells(hf)
                    + ["-" if ratio is None else f"{ratio:.2f}"])
    best = {impl: min((e for (i, _), e in cells.items() if i == impl), key=stat_ms, default=None)
            for impl in (OWN, HF)}
    if best[OWN] is not None and best[HF] is not None:
        rows.append([f"each one's fastest ({optimizer_of(best[OWN])} / {optimizer_of(best[HF])})"]
                    + model_cells(best[OWN]) + model_cells(best[HF])
                    + [f"{same_run_ratio(best[OWN], best[HF]):.2f}"])
    if not rows:
        return ""
    case = HEADLINE_CASE
    header = ["optimizer", "own ms", "own MFU", "own peak GiB", "HF ms", "HF MFU", "HF peak GiB", "own / HF"]
    peaks = sorted({e.get("peak_tflops") for e in steps if e.get("peak_tflops")})
    return (f"{case['size']} model, train step (forward, backward, optimizer step), {case['precision']} autocast, "
            f"batch {case['batch_size']}, context {case['context']}, {case['attention']} attention, per-block "
            "torch.compile; own: cs336_systems.model, HF: Hugging Face LlamaForCausalLM of the same size; "
            "median ms, one saved run.\n\n" + md_table(header, rows) + "\n\n"
            f"MFU against the dense datasheet peak ({', '.join(f'{p:g}' for p in peaks)} TFLOP/s); own / HF "
            "below 1: ours is faster.")


def leaderboard_summary(entries: list[dict], machines: list[dict]) -> str:
    """Per leaderboard shape (device-timed cases), per mode: compiled flash-triton, sdpa-flash and sdpa-cudnn ms and TFLOP/s,
    and flash-triton's time over each SDPA kernel's (same run)."""
    # device time only (the convention of FlashAttention and Triton benchmarks); the report has the host timing
    board = [e for e in entries if e.get("test") == "test_leaderboard" and e.get("timing") == "device"]
    shape_fields = ("batch_size", "heads", "seq_len", "head_dim", "dtype", "causal", "flush_l2", "timing")
    out = []
    for shape in distinct(board, shape_fields):
        subset = [e for e in board if tuple(e.get(f) for f in shape_fields) == shape]
        header = ["mode"]
        for impl, compiled in LEADERBOARD_COLUMNS:
            header += [f"{impl_label(impl, compiled)} ms", f"{impl_label(impl, compiled)} TFLOP/s"]
        contender = impl_label(*LEADERBOARD_COLUMNS[0])
        header += [f"{contender} ÷ {impl}" for impl, _ in LEADERBOARD_COLUMNS[1:]]
        rows = []
        modes = sorted({e["mode"] for e in subset},
                       key=lambda m: ATTENTION_MODE_ORDER.index(m) if m in ATTENTION_MODE_ORDER else 9)
        for mode in modes:
            pick = {(impl, compiled): next((e for e in subset if e["mode"] == mode and e["impl"] == impl
                                            and bool(e.get("compile")) == compiled), None)
                    for impl, compiled in LEADERBOARD_COLUMNS}
            row = [mode]
            for column in LEADERBOARD_COLUMNS:
                row += [cell_median(pick[column]), fmt_rate(ok_field(pick[column], "tflops"))]
            first = pick[LEADERBOARD_COLUMNS[0]]
            for column in LEADERBOARD_COLUMNS[1:]:
                ratio = same_run_ratio(first, pick[column])
                row.append("-" if ratio is None else f"{ratio:.2f}")
            rows.append(row)
        batch, heads, n, d, dtype, causal, flush, timing = shape
        out.append(f"B={batch}, H={heads}, N={n}, d={d}, {dtype}, {'causal' if causal else 'not causal'}"
                   + (", L2 flushed before every round" if flush else "")
                   + f", {TIMING_LABEL.get(timing, timing)}; median ms.\n\n"
                   + md_table(header, rows))
    return "\n\n".join(out)


def allreduce_summary(entries: list[dict], machines: list[dict]) -> str:
    """Rows per message size; busbw GB/s per (backend, world size), and the 2xH200 NVLink reference."""
    cases = [e for e in suite_entries(entries, "allreduce") if e.get("status") == "ok"]
    if not cases:
        return ""
    by_run = machines_by_run(machines)
    columns = sorted({(str(e.get("backend")), e.get("world_size")) for e in cases},
                     key=lambda c: (c[0] != "nccl", c[0], c[1] or 0))
    cells = {(str(e.get("backend")), e.get("world_size"), e.get("size_mb")): e for e in cases}
    header = ["size MiB"] + [f"{b} {w} ranks busbw GB/s" for b, w in columns] + ["reference GB/s"]
    rows = []
    for size in sorted({e.get("size_mb") for e in cases}):
        row = [fmt_mib(size)] + [fmt(ok_field(cells.get((b, w, size)), "busbw_gbps"), ".1f") for b, w in columns]
        refs = []
        for b, w in columns:
            e = cells.get((b, w, size))
            ref = None if e is None else allreduce_reference(b, size, w, by_run.get(e.get("run"), {}).get("gpu_name"))
            if ref is not None:
                refs.append(f"{b} {ref[0]:g}–{ref[1]:g}" if isinstance(ref, tuple) else f"{b} {ref:g}")
        row.append(", ".join(dict.fromkeys(refs)) or "-")
        rows.append(row)
    return (md_table(header, rows) + "\n\nbusbw = algbw · 2(n−1)/n, float32, slowest rank's median per "
            "all-reduce. Reference: 2×H200 NVLink (2 ranks on that GPU only).")


def data_parallel_readme(entries: list[dict], machines: list[dict]) -> str:
    """The data-parallel summary table and each case's DDP targets as bullets."""
    summary = data_parallel_summary(entries, machines)
    if summary.startswith("### "):  # nested under the README section's own heading
        summary = "#" + summary
    bullets = [f"- {group_title(key)}: {targets_text(group)}" for key, group in dp_groups(entries)]
    return "\n\n".join(part for part in (summary, "\n".join(bullets)) if part)


@dataclass(frozen=True)
class ResultsSection:
    """One part of the README's Results block: a title, committed runs (paths relative to the README),
    the table renderer (entries, machines) -> Markdown, and where this section's plots go (if any)."""

    title: str
    runs: tuple[str, ...]
    table: Callable[[list[dict], list[dict]], str] | None = None
    plots_dir: str | None = None
    plots: Callable[[list[dict], list[dict]], list] | None = None

    def __post_init__(self):
        if not self.runs:
            raise ValueError(f"ResultsSection {self.title!r}: runs is empty")
        if (self.plots is None) != (self.plots_dir is None):
            raise ValueError(f"ResultsSection {self.title!r}: plots and plots_dir go together, got "
                             f"plots={self.plots!r}, plots_dir={self.plots_dir!r}")


def _flash_plot_specs(entries, machines):
    from cs336_systems.reporting import plots
    return plots.flash_plots(entries, machines)


README_RESULTS = (
    ResultsSection("H200: the 2.7B train step, own and Hugging Face's, per optimizer",
                   ("results/h200/gate-validation/e2e-hf--a1.json",), optimizer_table),
    ResultsSection("H100: attention leaderboard", ("results/h100/leaderboard.json",),
                   leaderboard_summary),
    ResultsSection("H100: attention TFLOP/s vs sequence length",
                   ("results/h100/flash-bf16-graph.json",),
                   None, "results/h100/plots", _flash_plot_specs),
)


class UntraceableRun(ValueError):
    """A run for the README saved from a dirty work tree or without a commit."""


def _check_traceable(path: Path, section: str) -> None:
    info = json.loads(path.read_text()).get("commit_info") or {}
    if not info.get("id") or info.get("dirty"):
        why = "from a work tree with uncommitted changes" if info.get("id") else "without a commit"
        raise UntraceableRun(f"README results section {section!r}: {path} was saved {why}, so its numbers cannot "
                             "be traced to code; re-measure it at a clean commit")


def provenance(paths: list[Path], root: Path) -> str:
    """Device, versions and date of the runs: one line when their machine facts agree, else one per run."""
    groups: dict[tuple, list[tuple[Path, str]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        facts = data.get("machine_info", {}).get("cs336_systems", {})
        key = tuple(facts.get(f) for f in ("gpu_name", "gpu_count", "driver", "cuda", "torch", "triton", "cudnn"))
        groups.setdefault(key, []).append((path, data.get("datetime", ""), commit_label(data)))
    lines = []
    for (gpu, count, driver, cuda, torch_version, triton, cudnn), runs in groups.items():
        device = f"{gpu} ×{count}" if gpu else "CPU"
        stamps = sorted(datetime.fromisoformat(d).astimezone(timezone.utc) for _, d, _ in runs if d)
        if stamps:
            days = sorted({s.date().isoformat() for s in stamps})
            span = (f"{stamps[0]:%H:%M}–{stamps[-1]:%H:%M} UTC" if stamps[0] != stamps[-1]
                    else f"{stamps[0]:%H:%M} UTC")
            date = f"{' / '.join(days)} ({span})"
        else:
            date = "unknown"
        files = ", ".join(f"[`{relative_link(p, root)}`]({relative_link(p, root)}) (commit {commit})"
                          for p, _, commit in runs)
        lines.append(f"Device: {device}, driver {driver}; CUDA {cuda}, torch {torch_version}, triton {triton}, "
                     f"cuDNN {cudnn}. Date: {date}. Runs: {files}.")
    return "\n".join(lines)


def readme_block(root: str | Path, sections: tuple[ResultsSection, ...] = README_RESULTS,
                 write_plots: bool = True) -> str:
    """The Markdown between the README markers, from the committed runs under ``root``; with
    ``write_plots`` the sections' PNGs are drawn into their plots_dir (links are written either way)."""
    root = Path(root)
    parts = [f"<!-- generated by `{README_COMMAND}` from the committed runs; edit the code, not this block -->"]
    for section in sections:
        paths = [root / run for run in section.runs]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"README results section {section.title!r}: missing runs {missing}")
        for path in paths:
            _check_traceable(path, section.title)
        entries, machines = load_runs(paths)
        body = [f"### {section.title}", provenance(paths, root)]
        if section.table is not None:
            body.append(section.table(entries, machines))
        if section.plots is not None:
            specs = section.plots(entries, machines)
            if write_plots and specs:
                from cs336_systems.reporting import plots
                plots.write_plots(specs, root / section.plots_dir)
            body += [f"![{spec.title}]({section.plots_dir}/{spec.filename})" for spec in specs]
        parts.append("\n\n".join(b for b in body if b))
    return "\n\n".join(parts)


class ReadmeMarkersError(ValueError):
    """The README lacks the Results heading or the markers inside it (or has them more than once)."""


def results_span(text: str, readme: Path) -> tuple[int, int]:
    """Offsets of the text between the markers, which must lie inside the README's Results section."""
    heading = next((i for i, line in enumerate(text.splitlines(keepends=True)) if line.rstrip() == README_HEADING),
                   None)
    if heading is None:
        raise ReadmeMarkersError(f"{readme}: no '{README_HEADING}' heading")
    lines = text.splitlines(keepends=True)
    start_of_section = sum(len(line) for line in lines[:heading])
    next_heading = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    end_of_section = sum(len(line) for line in lines[:next_heading])
    section = text[start_of_section:end_of_section]
    for marker in (README_START, README_END):
        if section.count(marker) != 1:
            raise ReadmeMarkersError(f"{readme}: the '{README_HEADING}' section must contain the marker {marker!r} "
                             f"exactly once (found {section.count(marker)})")
    start = start_of_section + section.index(README_START) + len(README_START)
    end = start_of_section + section.index(README_END)
    if end < start:
        raise ReadmeMarkersError(f"{readme}: {README_END!r} comes before {README_START!r}")
    return start, end


def update_readme(readme: str | Path, sections: tuple[ResultsSection, ...] = README_RESULTS,
                  write_plots: bool = True) -> bool:
    """Regenerate the block between the markers in the README's Results section (runs and plot
    directories relative to the README's directory); True when the file changed."""
    readme = Path(readme)
    text = readme.read_text()
    start, end = results_span(text, readme)  # fail on bad markers before drawing anything
    new = text[:start] + "\n" + readme_block(readme.parent, sections, write_plots) + "\n" + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text
