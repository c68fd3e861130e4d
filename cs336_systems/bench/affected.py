"""Which perf groups a change can move: the GPU workflow's plan (.github/workflows/perf-gpu.yml).

    python cs336_systems/bench/affected.py [--all] [CHANGED_PATH ...]   (standard library only: no install)
    -> {"single": [group, ...], "multi": [{"name", "groups", "launcher"}, ...], "reason": "..."}

A pull request or a push runs the perf groups its changed files can affect, each compared with the committed
baseline by the statistical gate; the nightly schedule and a manual run take every group (``--all``).  A
path maps to groups by the first rule of `PATH_RULES` whose prefix it starts with; a path under
``cs336_systems/`` that no rule names affects every group (a new module is timed until a rule says
otherwise), and a path outside the package and the perf suite affects none.

Single-GPU jobs run one group each: the gpu profile's groups of every suite but the multi-GPU ones.
Multi-GPU jobs (`MULTI_GPU_JOBS`) run groups that must share one pytest session (a sharding group with the
DDP group of its precision, whose torch DDP case its ratios divide by).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections.abc import Iterable
from pathlib import Path

BENCHMARKS_JSON = Path(__file__).resolve().parents[2] / "benchmarks.json"

MULTI_GPU_SUITES = ("allreduce", "data_parallel")
# One job each (its groups share a pytest session); launcher: torchrun (NCCL, a process per GPU) or spawn
# (gloo ranks started by the case itself).
MULTI_GPU_JOBS = (
    {"name": "allreduce-nccl", "groups": "allreduce-nccl", "launcher": "torchrun"},
    {"name": "data-parallel-bf16", "groups": "ddp-bf16,sharding-bf16", "launcher": "torchrun"},
    {"name": "data-parallel-fp32", "groups": "ddp-fp32,sharding-fp32", "launcher": "torchrun"},
    {"name": "allreduce-gloo", "groups": "allreduce-gloo", "launcher": "spawn"},
)
EVERY = ("*",)
# (path prefix, group patterns): the first matching rule decides.  What each area of the code can move.
PATH_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cs336_systems/attention/", ("leaderboard", "flash-*", "attention-*", "e2e-flash-attention", "e2e-packed",
                                  "packed-*")),
    ("cs336_systems/optim/", ("e2e-*",)),
    ("cs336_systems/model.py", ("e2e-*", "warmup", "checkpointing-*")),
    ("cs336_systems/checkpointing.py", ("checkpointing-*", "e2e-*")),
    ("cs336_systems/amp.py", ("e2e-*", "checkpointing-*", "warmup", "ddp-*", "sharding-*")),
    ("cs336_systems/parallel/", ("ddp-*", "sharding-*", "scaling-*", "allreduce-*")),
    ("cs336_systems/bench/workloads/attention.py", ("leaderboard", "flash-*", "attention-*")),
    ("cs336_systems/bench/workloads/lm.py", ("e2e-*", "warmup", "checkpointing-*", "packed-*")),
    ("cs336_systems/bench/workloads/packed_attention.py", ("packed-*",)),
    ("cs336_systems/bench/workloads/hf_llama.py", ("e2e-hf",)),
    ("cs336_systems/bench/workloads/allreduce.py", ("allreduce-*",)),
    ("cs336_systems/bench/workloads/data_parallel.py", ("ddp-*", "sharding-*", "scaling-*")),
    # the gate and the reports decide on timings without changing them: one group proves the wiring
    ("cs336_systems/reporting/", ("leaderboard",)),
    # command-line tools outside the perf suite
    ("cs336_systems/tools/", ()),
    ("cs336_systems/accounting.py", ()),
    ("cs336_systems/profile.py", ()),
    ("cs336_systems/memory.py", ()),
    ("cs336_systems/", EVERY),  # the harness, the machine facts, the matrix, anything new
    ("perf/", EVERY),
    ("benchmarks.json", EVERY),
    ("pyproject.toml", EVERY),
    ("conftest.py", EVERY),
    (".github/workflows/perf-gpu.yml", EVERY),
)


def single_gpu_groups(benchmarks: dict) -> list[str]:
    """The gpu profile's groups of the single-GPU suites, in benchmarks.json's order (the decoded JSON: the
    planner runs before anything is installed; `bench.matrix` validates the same file)."""
    found: list[str] = []
    for suite, body in benchmarks["suites"].items():
        if suite in MULTI_GPU_SUITES:
            continue
        for grid in body["profiles"].get("gpu", []):
            if grid["group"] not in found:
                found.append(grid["group"])
    return found


def patterns_for(path: str) -> tuple[str, ...]:
    """The group patterns a changed path affects (`PATH_RULES`; nothing outside them)."""
    path = path.removeprefix("./")
    for prefix, patterns in PATH_RULES:
        if path == prefix or path.startswith(prefix):
            return patterns
    return ()


def plan(changed: Iterable[str] | None, benchmarks: dict | None = None) -> dict:
    """The jobs to run for ``changed`` paths (None: every job, the nightly or a manual run); ``benchmarks``:
    the decoded benchmarks.json (default: the repository's)."""
    if benchmarks is None:
        benchmarks = json.loads(BENCHMARKS_JSON.read_text())
    single = single_gpu_groups(benchmarks)
    if changed is None:
        return {"single": single, "multi": list(MULTI_GPU_JOBS), "reason": "every group (schedule or manual run)"}
    patterns = sorted({p for path in changed for p in patterns_for(path)})

    def hit(group: str) -> bool:
        return any(fnmatch.fnmatchcase(group, p) for p in patterns)

    multi = [job for job in MULTI_GPU_JOBS if any(hit(g) for g in job["groups"].split(","))]
    chosen = [g for g in single if hit(g)]
    return {"single": chosen, "multi": multi,
            "reason": f"groups matching {', '.join(patterns)}" if patterns else "no change the perf suite times"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python cs336_systems/bench/affected.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="changed paths, relative to the repository's root")
    parser.add_argument("--all", action="store_true", help="every group (the nightly run, a manual run)")
    args = parser.parse_args(argv)
    if args.all and args.paths:
        parser.error("give changed paths or --all, not both")
    print(json.dumps(plan(None if args.all else args.paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
