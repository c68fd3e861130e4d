"""tests/ only: run in parallel by default (pytest-xdist), one intra-op thread per CPU share.

``pytest tests/`` (or a plain ``pytest``, whose testpaths is tests/) runs as if given ``-n auto``: one
worker per CPU.  An explicit ``-n`` wins (``-n 0``: serial, for debugging; ``--pdb`` and
``--collect-only`` stay serial too), and so does an explicit ``--dist``.  This is a hook here rather than
``addopts`` in pyproject.toml because addopts would apply to ``pytest perf/`` as well, and the benchmarks
must run in one process (pytest-benchmark turns itself off under xdist).  This conftest is only loaded
when every path asked for lies under tests/, and the hook checks that again, so ``pytest perf/`` and
``pytest tests/ perf/`` stay serial.

Scheduling (unless ``--dist`` is given): a module whose tests share one expensive module-scoped result (a
spawned multi-process job, a profiled CLI run: `SHARED`) goes to one worker as a unit, so its job runs
once; every other test is handed out on its own, to whichever worker is free.  The shared units go first.
xdist's own ``--dist loadgroup`` would do this with ``xdist_group`` marks, but it silently stops grouping
on pytest >= 9.2 (pytest-xdist#1386), so the grouping is done here, on the controller, from the test ids.

Each worker gets ``cpus // workers`` intra-op threads (torch, and OpenMP in the subprocesses it starts):
with every core already running a worker, more threads only contend.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Modules (paths under tests/) whose tests share a module-scoped spawned job or CLI run: one unit each.
# A module missing here is still correct under xdist, only slower (each worker would run the job).
SHARED = frozenset({
    "parallel/test_ddp.py",
    "parallel/test_zero.py",
    "test_checkpointing.py",
    "bench/test_data_parallel_workloads.py",
    "bench/test_rank_timing.py",
    "tools/test_kernel_profile.py",
})

_OUR_SCHEDULE = pytest.StashKey[bool]()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own pytest_cmdline_main, which resolves -n and --dist
def pytest_cmdline_main(config: pytest.Config) -> None:
    option = config.option
    if not hasattr(option, "numprocesses") or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # xdist not loaded (-p no:xdist), or this is a worker
    if option.numprocesses is None:
        if option.collectonly or config.getoption("usepdb", False):
            return
        paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
        if not paths or not all(p == TESTS or TESTS in p.parents for p in paths):
            return  # something outside tests/ (e.g. perf/) was asked for: stay serial
        option.numprocesses = "auto"
    if option.numprocesses and option.dist == "no" and not option.distload:
        option.dist = "loadscope"  # what the workers are told; the scheduler is ours (below)
        config.stash[_OUR_SCHEDULE] = True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not config.stash.get(_OUR_SCHEDULE, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    tests_dir = TESTS.relative_to(config.rootpath).as_posix() + "/" if TESTS.is_relative_to(config.rootpath) else ""

    class SharedJobScheduling(LoadScopeScheduling):
        """A `SHARED` module is one unit; every other test is a unit of its own.  Units are queued by
        size, largest first (xdist's default for scopes), so the shared modules start first."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith(tests_dir) and path[len(tests_dir):] in SHARED:
                return path
            return nodeid

    return SharedJobScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, _cpus() // workers)
    import torch

    torch.set_num_threads(threads)
    # subprocesses started by tests (pytest sessions, CLIs) inherit it; spawned ranks pin 1 thread anyway
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
