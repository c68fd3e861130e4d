"""Each selected perf case in a fresh process, the processes' runs merged into one saved run.

    cs336-perf-isolated OUT.json [--order collected|reversed] [--timeout-s S] [--pytest-command CMD] -- PYTEST_ARGS
    (or python -m cs336_systems.perf_isolated)

A case's time can depend on what ran before it in the same process: the allocator's cached blocks, the
compiled graphs and autotuning caches, kernels already loaded, a CUDA context that exists.  A comparison
that must not share that state (the models with one attention implementation against another, say) runs
each case alone.  That does not make the sequence irrelevant: on a loaded host the position of a process
in it still shows (docs/flash-attention-experiments.md, Section 19: the second process of a pair ran slower
in both orders), so run the selection in both orders (``--order reversed``) and compare.

Algorithm: collect the node ids that ``pytest --collect-only -q PYTEST_ARGS`` selects; for each, in the
chosen order, run ``pytest PYTEST_ARGS --perf-only=NODE_ID --benchmark-json=TMP`` in a new process (the
root conftest's ``--perf-only`` keeps that one item), one process after the other, each with its own
timeout; merge the runs (`reporting.baseline.merge_runs`: the machine facts must agree, each case keeps
the name of the file it came from) and record the order and the arguments under ``cs336_isolated``.

Exit status: 0 when every case's process passed; 1 when one failed or timed out (OUT then holds the
others, and the failures are listed); 2 for bad arguments, a selection of no case, or no run to merge.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cs336_systems.reporting.baseline import merge_runs
from cs336_systems.reporting.run_files import read_run

ORDERS = ("collected", "reversed")
# Options this tool sets for each process itself, or that would run several cases in one process.
RESERVED = ("--benchmark-json", "--perf-only", "-n", "--numprocesses", "--collect-only", "--co")


def child_environment() -> dict[str, str]:
    """This process's environment less pytest-xdist's worker variables: started from inside a pytest worker
    (a test of this tool), a child would take itself for one, and pytest-benchmark turns itself off there."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_") and k != "PYTEST_CURRENT_TEST"}


class UsageError(ValueError):
    """Bad arguments or an empty selection: the message says which."""


def check_pytest_args(args: list[str]) -> None:
    """UsageError naming the first argument this tool must set itself (or that shares a process)."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in RESERVED or (arg.startswith("-n") and not arg.startswith("--")):  # -n4, -nauto: xdist
            raise UsageError(f"pytest argument {arg!r}: cs336-perf-isolated sets the output, the selection and "
                             "one process a case itself; leave it out")


def collect(args: list[str], python: str = sys.executable) -> list[str]:
    """The node ids ``pytest --collect-only -q args`` selects, in collection order; UsageError when
    collection fails or selects nothing."""
    done = subprocess.run([python, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, env=child_environment())
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode not in (0, 5) or not ids:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise UsageError(f"pytest {' '.join(args)} selects no case (collection exit status {done.returncode}):"
                         f"\n{tail}")
    return ids


def ordered(ids: list[str], order: str) -> list[str]:
    """``ids`` in the order the processes run them."""
    if order not in ORDERS:
        raise UsageError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")
    return list(ids) if order == "collected" else list(reversed(ids))


def run_each(ids: list[str], args: list[str], folder: Path, timeout_s: float,
             pytest_command: tuple[str, ...] = (sys.executable, "-m", "pytest"),
             log=print) -> tuple[list[Path], list[str]]:
    """Run each node id in its own process of ``pytest_command`` (as `baseline --refresh` and the calibration
    take it: torchrun for the multi-GPU groups); returns (the run files written, the failures as lines)."""
    runs, failures = [], []
    for i, node in enumerate(ids):
        out, transcript = folder / f"case-{i:04d}.json", folder / f"case-{i:04d}.log"
        command = [*pytest_command, *args, f"--perf-only={node}", f"--benchmark-json={out}", "-q",
                   "-p", "no:cacheprovider"]
        start = time.perf_counter()
        with transcript.open("w") as sink:
            try:
                status = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s,
                                        env=child_environment()).returncode
            except subprocess.TimeoutExpired:
                status = None
        seconds = time.perf_counter() - start
        outcome = "timed out" if status is None else f"exit status {status}"
        log(f"[{i + 1}/{len(ids)}] {node}: {outcome}, {seconds:.1f} s")
        if out.is_file():
            runs.append(out)
        elif status == 0:
            outcome, status = "exit status 0 but no run written (pytest-benchmark off?)", -1
        if status != 0:
            tail = "\n".join(transcript.read_text(errors="replace").strip().splitlines()[-10:])
            failures.append(f"{node}: {outcome}\n{tail}")
    return runs, failures


def merge(runs: list[Path], ids: list[str], args: list[str], order: str) -> dict:
    """One run from the processes' runs (`merge_runs`), with the order and arguments under cs336_isolated."""
    merged = merge_runs([read_run(p) for p in runs], [str(p) for p in runs])
    merged["cs336_isolated"] = {"order": order, "node_ids": ids, "pytest_args": args,
                                "processes": len(ids), "runs_merged": len(runs)}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cs336-perf-isolated", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the merged run (pytest-benchmark JSON) to write")
    parser.add_argument("--order", choices=ORDERS, default="collected",
                        help="the processes' order: as collected (default) or reversed")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the bound on each case's process")
    parser.add_argument("--pytest-command", default=f"{sys.executable} -m pytest",
                        help="how to start each case's pytest (e.g. 'torchrun --standalone --nproc-per-node=2 -m "
                             "pytest' for the multi-GPU groups); collection runs plain pytest; default %(default)s")
    parser.epilog = "After --: the pytest arguments that select the cases (paths, -k, --perf-group, ...)."
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:split])
    args = argv[split + 1:]
    try:
        if ns.timeout_s <= 0:
            raise UsageError(f"--timeout-s must be positive; got {ns.timeout_s}")
        if not ns.out.parent.is_dir():
            raise UsageError(f"{ns.out}: its folder does not exist")
        check_pytest_args(args)
        ids = ordered(collect(args), ns.order)
    except UsageError as exc:
        print(f"cs336-perf-isolated: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cs336-isolated-") as tmp:
        runs, failures = run_each(ids, args, Path(tmp), ns.timeout_s, tuple(shlex.split(ns.pytest_command)))
        if not runs:
            print("cs336-perf-isolated: no process wrote a run:\n" + "\n".join(failures), file=sys.stderr)
            return 2
        merged = merge(runs, ids, args, ns.order)
    ns.out.write_text(json.dumps(merged, separators=(",", ":")) + "\n")
    print(f"wrote {ns.out}: {len(merged['benchmarks'])} timed case(s), {len(merged['oom'])} out of memory, "
          f"from {len(runs)} process(es)")
    if failures:
        print(f"cs336-perf-isolated: {len(failures)} case(s) failed:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
