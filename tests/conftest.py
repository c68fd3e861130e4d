"""tests/ only: run in parallel by default (pytest-xdist), one intra-op thread per CPU share.

``pytest tests/`` (or a plain ``pytest``, whose testpaths is tests/) runs as if given ``-n auto --dist
loadgroup``: one worker per CPU.  Any explicit ``-n`` wins (``-n 0``: serial, for debugging or ``--pdb``).
This is a hook here rather than ``addopts`` in pyproject.toml because addopts would apply to ``pytest
perf/`` as well, and the benchmarks must run in one process (pytest-benchmark turns itself off under
xdist).  This conftest is only loaded when every path asked for lies under tests/, so ``pytest perf/``
and ``pytest tests/ perf/`` stay serial.

Tests that share one expensive module-scoped result (a spawned multi-process job, a profiled CLI run) are
kept on one worker with ``xdist_group`` marks added at collection, so the job runs once; other tests are
handed out one by one, the shared jobs first (longest first), so the workers finish together.

Each worker gets ``cpu_count // workers`` intra-op threads (torch, OpenMP in subprocesses it starts):
with every core already busy with a worker, more threads only contend.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Default to ``-n auto --dist loadgroup`` when nothing chose otherwise (runs before xdist's hook)."""
    option = config.option
    if not hasattr(option, "numprocesses") or option.numprocesses is not None:
        return  # xdist not loaded (-p no:xdist), or -n given
    if os.environ.get("PYTEST_XDIST_WORKER") or option.collectonly or config.getoption("usepdb", False):
        return
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    if not paths or not all(p == TESTS or TESTS in p.parents for p in paths):
        return  # something outside tests/ (e.g. perf/) was asked for: stay serial
    option.numprocesses = "auto"
    if option.dist == "no":
        option.dist = "loadgroup"


def _worker_count() -> int | None:
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return int(count) if os.environ.get("PYTEST_XDIST_WORKER") and count else None


def pytest_configure(config: pytest.Config) -> None:
    workers = _worker_count()
    if workers is None or workers <= 1:
        return
    threads = max(1, _cpus() // workers)
    import torch

    torch.set_num_threads(threads)
    # subprocesses started by tests (pytest sessions, CLIs) inherit it; spawned ranks pin 1 thread anyway
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# Module-scoped results shared by every test of a module (keyed by the module's path under tests/): such a
# module is one xdist group, so its job runs on one worker once.  test_zero.py caches one job per world
# size, so each world size is its own group.
SHARED = {
    "parallel/test_ddp.py": None,
    "parallel/test_zero.py": "world",
    "test_checkpointing.py": None,
    "bench/test_data_parallel_workloads.py": None,
    "bench/test_rank_timing.py": None,
    "tools/test_kernel_profile.py": None,
}


def _group(item: pytest.Item) -> str | None:
    path = item.path.relative_to(TESTS).as_posix() if TESTS in item.path.parents else None
    if path not in SHARED:
        return None
    key = SHARED[path]
    callspec = getattr(item, "callspec", None)
    if key is not None and callspec is not None and key in callspec.params:
        return f"{path}[{key}={callspec.params[key]}]"
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _worker_count() is None:
        return  # serial: marks and order unchanged
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
