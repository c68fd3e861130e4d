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
with every core already running a worker, more threads only contend.  Once collected, what a process has
imported is frozen out of the garbage collector (`pytest_collection_finish`).

Hypothesis: the ``dev`` profile by default, ``thorough`` (each property test's full example count, as CI runs)
with ``HYPOTHESIS_PROFILE=thorough`` or ``--hypothesis-profile=thorough``; see tests/hypothesis_profiles.py.

The ``perf_session`` fixture runs an isolated pytest session (a perf/ suite built from the project's
conftest files) inside this process: a fresh interpreter would import torch again, seconds per session.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest

import hypothesis_profiles

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


# Imported by the tests of any broad run (torch.optim and torch.compile import torch._dynamo; the attention
# kernels and the machine facts, triton), before the freeze below so that they are frozen too.
BROAD_RUN_TESTS, BROAD_RUN_IMPORTS = 200, ("torch._dynamo", "triton")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what is imported by now (torch and the rest: ~400k objects) out of every later garbage
    collection, each of which would walk all of it again (0.2-0.3 s per full collection, tens of seconds
    per run of the suite).  Objects made by the tests are collected as usual."""
    if len(session.items) >= BROAD_RUN_TESTS:
        for name in BROAD_RUN_IMPORTS:
            importlib.import_module(name)
    gc.collect()  # so that no garbage is frozen with them
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    # before any test module is collected: their @settings read the profile's scale (--hypothesis-profile wins)
    if config.getoption("hypothesis_profile", None) is None:
        try:
            hypothesis_profiles.load_from_environment()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
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


# --- isolated pytest sessions, in this process ----------------------------------------------------------

# What the isolated perf sessions import (the project's conftest files, perf/'s suites), imported once per
# worker before any pytester exists: pytester drops every module imported after it was made (by a session,
# or by the test itself) when it ends, and a module imported anew later breaks the process (a native
# extension such as triton's aborts it; torch registers its ops twice).  `perf_session` fails, naming the
# module, when a session imports one not listed here.
PERF_SESSION_IMPORTS = (
    "hypothesis",  # its pytest plugin imports it when a session starts
    "triton",
    "torch._dynamo",  # the attention workloads reset it (and it imports much of torch and numpy)
    "torch.utils.serialization",  # torch.save / torch.load import it on first use (spawn's results)
    "cs336_systems.attention",
    "cs336_systems.bench.gpu_telemetry",
    "cs336_systems.bench.harness",
    "cs336_systems.bench.machine",
    "cs336_systems.bench.matrix",
    "cs336_systems.bench.workloads.attention",
    "cs336_systems.bench.workloads.data_parallel",  # perf/test_distributed.py imports it at collection
    "cs336_systems.parallel.launch",
    "cs336_systems.reporting.baseline",
    "cs336_systems.reporting.gates",
    "cs336_systems.reporting.significance",  # --perf-gate: scipy.stats, whose extensions load once
    "scipy.stats",
)


def _must_not_reload(name: str, module) -> bool:
    """A module that cannot be imported a second time in one process without harm: a native extension,
    or part of torch, triton or this project (op registrations, global state)."""
    path = str(getattr(module, "__file__", None) or "")
    return path.endswith((".so", ".pyd")) or name.split(".")[0] in ("torch", "triton", "cs336_systems")


class _FirstImports:
    """pytester plugin: the modules a session imported that this process had not (read at its very end,
    before pytester drops them)."""

    def __init__(self) -> None:
        self.before = set(sys.modules)
        self.new: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.new = sorted(name for name in set(sys.modules) - self.before
                          if _must_not_reload(name, sys.modules[name]))


@pytest.fixture(scope="session")
def _perf_session_imports() -> None:
    # session-scoped, so set up before any test's pytester (pytest makes wider-scoped fixtures first)
    for name in PERF_SESSION_IMPORTS:
        importlib.import_module(name)
    import torch

    with torch.autograd.profiler.record_function("imports"):  # imports torch.profiler's helpers on first use
        pass


@pytest.fixture
def perf_session(_perf_session_imports: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """``perf_session(*args) -> RunResult``: ``pytester.runpytest_inprocess(*args)`` (the session sees this
    process's environment at the call, as a subprocess would), failing when the session imported a module
    that must not be imported twice (see `PERF_SESSION_IMPORTS`).

    A Python warning the session issues outside its own warning capture (pytest-benchmark's, while it loads
    a saved run to compare with) is printed on stderr by a session in a process of its own: it is added to
    the result's stderr the same way (`warnings.formatwarning`), not left to the calling test's warnings."""
    # Under `pytest -n`, xdist's worker variables would make pytest-benchmark disable itself there.
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> pytest.RunResult:
        first = _FirstImports()
        with warnings.catch_warnings(record=True) as loose:
            result = pytester.runpytest_inprocess(*args, plugins=[first])
        for w in loose:
            result.errlines.extend(warnings.formatwarning(w.message, w.category, w.filename, w.lineno,
                                                          w.line).splitlines())
        result.stderr = pytest.LineMatcher(result.errlines)
        packages = sorted({".".join(name.split(".")[:2]) for name in first.new})
        assert not first.new, (f"the in-process session imported {len(first.new)} modules for the first time, "
                               f"of {packages}; add them to PERF_SESSION_IMPORTS in tests/conftest.py")
        return result

    return run
