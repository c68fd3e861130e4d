"""Saved pytest-benchmark runs -> Markdown tables (and PNG plots), run comparisons, the README's results.

    python -m cs336_systems.report RUN.json [RUN2.json ...] [-o report.md] [--plots DIR] [--any-machine]
    python -m cs336_systems.report --compare OLD.json NEW.json [-o diff.md] [--threshold 10] [--any-machine]
    python -m cs336_systems.report --readme README.md

Runs from different machines or software (GPU, GPU count, CUDA, torch, triton) are refused (exit status 2)
unless ``--any-machine``, which renders them under a warning naming each run that differs; a case whose
statistics are missing, non-numeric, negative or not finite is an error naming the file and the case (exit
status 2).

``--plots DIR`` draws the plots of `cs336_systems.reporting.plots` (needs matplotlib, the ``plot`` extra) and links
them at the end of the report, relative to the report's directory.

``--compare`` pairs the cases of two runs by pytest node id (`cs336_systems.reporting.compare`): old and new
median, delta %, flagged beyond ``--threshold`` percent; runs from different machines are refused (exit
status 2) unless ``--any-machine``.

``--history DIR`` lists the headline cases of a results folder across every committed version of its runs
(`cs336_systems.reporting.history`), a step marked where the median moves beyond ``--threshold`` percent and
stays there.

``--readme`` rewrites the generated block of the README's "## Results" section from the committed runs
(`cs336_systems.reporting.readme_block`); everything outside its markers is left as it is.

Reads the JSON written by ``pytest perf/ --benchmark-autosave`` (or ``--benchmark-json``): the timed
benchmarks with their ``extra_info`` (the case and derived rates) plus this project's ``"oom"`` list.
Later files override earlier ones for the same case, so a sweep run in groups can be merged; the flash
sweep's tables alone look at every run of a case, so that a cell measured in two runs can show the
speedup over a baseline that only one of them measured (see `flash_tables`).

The tables come from `reporting.lm`, `reporting.attention` and `reporting.distributed`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from cs336_systems.reporting.attention import (
    attention_sweep_tables,
    flash_tables,
    leaderboard_table,
)
from cs336_systems.reporting.distributed import (
    allreduce_tables,
    bucket_model_sections,
    data_parallel_memory_tables,
    data_parallel_summary,
    data_parallel_tables,
)
from cs336_systems.reporting.lm import (
    baseline_table,
    checkpointing_tables,
    comparison_table,
    end_to_end_tables,
    gpu_clock_table,
    peak_memory_tables,
    warmup_table,
)
from cs336_systems.reporting.run_files import RunFileError
from cs336_systems.reporting.tables import (
    latest_entries,
    load_entries,
    machines_differ,
    machine_section,
    relative_link,
)


def plots_section(entries: list[dict], machines: list[dict], plots_dir: str | Path,
                  link_base: str | Path) -> str:
    """Draw every plot the entries have data for into ``plots_dir``; Markdown image links relative to
    ``link_base`` (the directory the report is written to)."""
    from cs336_systems.reporting import (
        plots,  # deferred: matplotlib is an optional extra
    )

    specs = plots.all_plots(entries, machines)
    if not specs:
        return ""
    paths = plots.write_plots(specs, plots_dir)
    links = [f"![{spec.title}]({relative_link(path, link_base)})" for spec, path in zip(specs, paths)]
    return "## Plots\n\n" + "\n\n".join(links)


def render(paths: list[str | Path], plots_dir: str | Path | None = None,
           link_base: str | Path | None = None, any_machine: bool = False) -> str:
    """The Markdown report of the runs; with ``plots_dir``, also the PNG plots, linked at the end.  Runs from
    different machines or software (`tables.machines_differ`) are refused (RunFileError): one table would put
    their times side by side as if comparable.  ``any_machine``: render them anyway, under a warning that
    names every run that differs."""
    every, machines = load_entries(paths)
    differ = machines_differ(machines)
    if differ and not any_machine:
        raise RunFileError("these runs come from different machines or software, and one report would set their "
                           "times side by side: " + "; ".join(differ) + ". Render them separately, or pass "
                           "--any-machine to mark the report as mixing them")
    entries = latest_entries(every)
    sections = [
        "# Benchmark report",
        ("**Warning: this report mixes runs from different machines or software; ratios across them are not "
         "comparable.** " + "; ".join(differ)) if differ else "",
        machine_section(machines),
        "Times are per step; MFU uses model FLOPs (cs336_systems.bench.flops) over the datasheet dense peak "
        "(cs336_systems.bench.machine) unless the run passed --peak-tflops."
        if any(e.get("test") in ("test_end_to_end", "test_warmup_study") for e in entries) else "",
        end_to_end_tables(entries),
        baseline_table(entries),
        comparison_table(entries, "precision", "fp32", "bf16", "fp32 vs bf16 autocast"),
        comparison_table(entries, "compile", False, True, "eager vs torch.compile"),
        comparison_table(entries, "attention", "naive", "sdpa", "naive vs SDPA attention"),
        comparison_table(entries, "linear_precision", "bf16", "fp8-tensorwise", "bf16 vs float8 (tensorwise) Linear layers"),
        comparison_table(entries, "linear_precision", "bf16", "fp8-rowwise", "bf16 vs float8 (rowwise) Linear layers"),
        comparison_table(entries, "packing", "padded", "packed", "documents padded vs packed"),
        warmup_table(entries),
        peak_memory_tables(entries),
        gpu_clock_table(entries),
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
              "       %(prog)s --readme README.md\n"
              "       %(prog)s --history results/GPU/ [--case TEXT ...] [--threshold PCT] [-o history.md]")
    parser.add_argument("runs", nargs="*", help="saved pytest-benchmark JSON files")
    parser.add_argument("-o", "--output", help="write Markdown here instead of stdout")
    parser.add_argument("--plots", metavar="DIR", help="also draw PNG plots into DIR and link them (needs the "
                                                       "`plot` extra: matplotlib)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two saved runs case by case")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="--compare: flag deltas beyond this many percent (default %(default)g)")
    parser.add_argument("--any-machine", action="store_true",
                        help="compare (--compare) or render runs from different machines or software, with a "
                             "warning (refused by default)")
    parser.add_argument("--history", metavar="DIR", help="the headline cases of a results folder across every "
                                                          "committed version of its runs, steps marked")
    parser.add_argument("--case", action="append", help="--history: cases whose test id contains this text "
                                                        "(repeatable; default: the compiled leaderboard and "
                                                        "end-to-end cases)")
    parser.add_argument("--readme", metavar="README", help="regenerate the Results block of this README from "
                                                           "the committed runs, and its plots")
    args = parser.parse_args(argv)
    modes = [bool(args.runs), args.compare is not None, args.readme is not None, args.history is not None]
    if sum(modes) != 1:
        parser.error("give either RUN.json files, or --compare OLD NEW, or --readme README, or --history DIR")
    if args.threshold <= 0 or not math.isfinite(args.threshold):
        parser.error(f"--threshold must be a positive percentage, got {args.threshold:g}")
    if args.plots is not None and not (args.runs or args.history):
        parser.error("--plots goes with RUN.json files or --history")
    from cs336_systems.reporting.compare import IncomparableRuns, compare_runs
    from cs336_systems.reporting.plots import (
        MissingPlotExtra,  # the module itself needs no matplotlib
    )
    from cs336_systems.reporting.readme_block import ReadmeMarkersError, UntraceableRun, update_readme

    try:
        if args.readme is not None:
            changed = update_readme(args.readme)
            print(f"{args.readme}: results block {'updated' if changed else 'already up to date'}")
            return 0
        if args.history is not None:
            from cs336_systems.reporting.history import DEFAULT_CASES, render_history

            base = Path(args.output).parent if args.output else Path.cwd()
            text = render_history(Path(args.history), tuple(args.case or DEFAULT_CASES), args.threshold,
                                  plots_dir=args.plots, link_base=base)
        elif args.compare is not None:
            text = compare_runs(*args.compare, threshold=args.threshold, any_machine=args.any_machine)
        else:
            base = Path(args.output).parent if args.output else Path.cwd()
            text = render(args.runs, plots_dir=args.plots, link_base=base, any_machine=args.any_machine)
    except (IncomparableRuns, MissingPlotExtra, ReadmeMarkersError, RunFileError, UntraceableRun, OSError,
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
