"""Project-wide pytest wiring (tests/ and perf/).

Markers
  gpu            needs CUDA; skipped with a reason when it is absent
  multi_gpu(n)   needs n CUDA devices; skipped otherwise
  slow           long-running; left out by default (as with -m "not slow"): --run-slow runs them with
                 the rest, -m slow runs only them.  The default applies when no -m expression is given and no
                 test is named by id (path::name), which always runs.

Options
  --run-slow                    also run the tests marked slow (CI's `.ci/run` does)
  --perf-profile=cpu|gpu|full   which benchmarks.json profile perf/ runs (default: gpu if CUDA is
                                present, else cpu)
  --perf-group=NAME[,NAME...]   only the perf cases of these groups (see benchmarks.json)
  --perf-only=NODE_ID           only the collected item with this node id, a usage error if none has it
                                (`cs336_systems.reporting.isolated` runs one case a process with it)
  --peak-tflops=X               peak used for MFU instead of the per-GPU datasheet lookup
  --compare-any-machine         allow --benchmark-compare across GPUs / versions / switches (warning only)
  --perf-gate[=strict]          with --benchmark-compare: decide each compared case from its per-round samples
                                (`cs336_systems.reporting.significance`: regressed, improved, unchanged,
                                inconclusive; per-group settings in benchmarks.json "regression") and fail
                                the session on a regression (strict: on an inconclusive case too); the table
                                is printed and appended to $GITHUB_STEP_SUMMARY when that is set
  --cool-down-s=S               before each GPU perf case wait up to S seconds (default 10; 0: never)
                                for the GPU to cool to its first case's temperature + 3 deg C
                                (`cs336_systems.bench.gpu_telemetry`; needs pynvml)

pytest-benchmark integration
  machine_info gains a "cs336_systems" entry (GPU name/count, driver, CUDA, cuDNN, torch, triton, the
  CS336_* switches set), and comparing against a saved run whose GPU name or count, CUDA, torch, triton,
  cuDNN, driver or set of CS336_* switches differ is refused with the list of differences
  (``--compare-any-machine`` turns the refusal into a loud warning): absolute times do not transfer
  between machines.  A ``--benchmark-compare`` that compared none of the run's timed cases, or a run with
  cases of a group the baseline does not cover, fails the session (`reporting.baseline.coverage`); a
  baseline saved from a dirty work tree is named in a warning.  ``--benchmark-json=PATH`` is checked
  before anything runs: a path that cannot be written is a usage error, not a run lost at the end.

CUDA faults
  A kernel fault (an illegal address, a launch failure, a device-side assert) loses the process's CUDA
  context, so every later GPU test in it would fail with the same error and hide which test faulted.  Without
  xdist the faulting test fails and the session stops there; an xdist worker exits at once (xdist reports that
  test as crashed and starts a fresh worker for the tests left).  An xfail test that faults ends the process's
  GPU use all the same.  A distributed case's rank that faults (its own process) does not count.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

try:
    import torch
except ModuleNotFoundError:  # pytest from an environment without the project's install
    pytest.exit("torch is not installed in this Python environment: follow the README's Setup (a venv, then "
                "`pip install torch==2.13.0` on a CPU machine and `pip install -e \".[dev,plot,baselines]\"`), "
                "and run `python -m pytest tests/` from that venv", returncode=pytest.ExitCode.USAGE_ERROR)

# Without a GPU, Triton kernels can only run in Triton's interpreter, which must be switched on before
# any @triton.jit decorator runs (the kernels are imported lazily, after this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.bench import machine
from cs336_systems.cli_args import non_negative_float, positive_float
from cs336_systems.bench.matrix import PROFILES
from cs336_systems.parallel.launch import SpawnError
from cs336_systems.reporting import baseline

COMPARED_KEY = pytest.StashKey[list]()  # the saved runs --benchmark-compare loaded
COVERAGE_KEY = pytest.StashKey[baseline.Coverage]()  # what --benchmark-compare covered of this run
GATE_KEY = pytest.StashKey[tuple]()  # --perf-gate: (verdicts, failing verdicts, problems)
DESELECTED_KEY = pytest.StashKey[set]()  # node ids deselected on purpose (-k, -m, slow tests left out)

# pytester runs the perf wiring (fixture, hooks) in isolated sessions from tests/.
pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336_systems")
    group.addoption("--run-slow", action="store_true",
                    help="also run the tests marked slow (left out by default unless -m selects them)")
    group.addoption(
        "--perf-profile", choices=PROFILES, default=None,
        help="benchmarks.json profile for perf/ (default: gpu when CUDA is available, else cpu)",
    )
    group.addoption("--perf-group", default=None, help="run only perf cases of these groups (comma-separated)")
    group.addoption("--perf-only", default=None, metavar="NODE_ID",
                    help="keep only the collected item with this node id (one case a process: cs336-perf-isolated)")
    group.addoption("--peak-tflops", type=positive_float, default=None, help="peak TFLOP/s for MFU")
    group.addoption(
        "--cool-down-s", type=non_negative_float, default=10.0,
        help="before each GPU perf case, wait up to this many seconds for the GPU to cool back to its "
             "temperature at the first case + 3 deg C (needs pynvml; 0: never wait)",
    )
    group.addoption(
        "--compare-any-machine", action="store_true",
        help="allow --benchmark-compare against a run from another GPU or software version (warn only)",
    )
    group.addoption(
        "--perf-gate", nargs="?", const="regressions", default=None, choices=("regressions", "strict"),
        help="with --benchmark-compare: the statistical gate (Mann-Whitney U and a minimum effect per group, "
             "benchmarks.json 'regression'); fails on a regression, with =strict on an inconclusive case too",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "multi_gpu(n): needs n CUDA devices")
    config.addinivalue_line("markers", "slow: long-running; left out unless --run-slow or -m selects them")
    _leave_out_slow_tests_by_default(config)
    config.stash[COMPARED_KEY] = []
    if config.getoption("--perf-gate") and not config.getoption("benchmark_compare", None):
        raise pytest.UsageError("--perf-gate compares against a saved run: give --benchmark-compare (and "
                                "--benchmark-storage for a committed baseline, e.g. file://results/h100/baselines)")
    _check_benchmark_json(config)
    _check_benchmark_storage(config)


SLOW_LEFT_OUT = pytest.StashKey[int]()  # how many tests marked slow the default left out


def _leave_out_slow_tests_by_default(config: pytest.Config) -> None:
    """No -m, no --run-slow and no test named by id: the tests marked slow are deselected after collection (as
    with -m "not slow").  xdist workers parse the same command line, so each decides the same."""
    if config.getoption("markexpr", "") or config.getoption("--run-slow"):
        return
    if any("::" in str(arg) for arg in config.args):
        return
    config.stash[SLOW_LEFT_OUT] = 0


def _deselect_slow(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = [item for item in items if item.get_closest_marker("slow")]
    if not slow:
        return
    items[:] = [item for item in items if not item.get_closest_marker("slow")]
    config.hook.pytest_deselected(items=slow)
    config.stash[SLOW_LEFT_OUT] = len(slow)
    if hasattr(config, "workeroutput"):  # an xdist worker: it collects, the controller prints the summary
        config.workeroutput["slow_left_out"] = len(slow)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Remember what was deselected on purpose: a --benchmark-compare does not miss their baseline cases."""
    if items:
        stash = items[0].config.stash
        stash.setdefault(DESELECTED_KEY, set()).update(item.nodeid for item in items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    config = node.config
    if SLOW_LEFT_OUT in config.stash:  # every worker collects (and deselects) the same tests
        config.stash[SLOW_LEFT_OUT] = max(config.stash[SLOW_LEFT_OUT],
                                          getattr(node, "workeroutput", {}).get("slow_left_out", 0))


def _check_benchmark_storage(config: pytest.Config) -> None:
    """--benchmark-autosave / --benchmark-save write into --benchmark-storage only after the last case: check
    now that its folder can be made and written (a file in its place, a read-only or full disk would lose
    the whole run after measuring it)."""
    if not (config.getoption("benchmark_autosave", False) or config.getoption("benchmark_save", None)):
        return
    storage = str(config.getoption("benchmark_storage", None) or "")
    if "://" in storage and not storage.startswith("file://"):
        return  # another storage backend (elasticsearch): its own errors
    folder = Path(storage.removeprefix("file://") or ".benchmarks")
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a directory")
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".cs336-write-check-{os.getpid()}"
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as exc:
        raise pytest.UsageError(f"--benchmark-storage={storage}: cannot save runs there ({exc.strerror or exc}); "
                                "the run would be lost after it finished") from None


def _check_benchmark_json(config: pytest.Config) -> None:
    """pytest-benchmark writes --benchmark-json only after the last case: check now that it can."""
    path = config.getoption("benchmark_json", None)
    if path is None or hasattr(path, "write"):
        # Releases of pytest-benchmark that parse the option with argparse.FileType hand over a file they have
        # already opened for writing: nothing left to check.
        return
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError("is a directory")
        if path.exists():
            with open(path, "ab"):  # appends nothing, truncates nothing
                pass
        else:
            with open(path, "xb"):
                pass
            path.unlink()
    except FileExistsError:  # created meanwhile (another torchrun rank's check): writable
        pass
    except OSError as exc:
        raise pytest.UsageError(f"--benchmark-json={path}: cannot write there ({exc.strerror or exc}); "
                                "the run would be lost after it finished") from None


def perf_profile(config: pytest.Config) -> str:
    return config.getoption("--perf-profile") or machine.default_profile()


def _keep_only(config: pytest.Config, items: list[pytest.Item], node_id: str) -> None:
    kept = [item for item in items if item.nodeid == node_id]
    if not kept:
        raise pytest.UsageError(f"--perf-only {node_id!r}: no collected item has this node id (of {len(items)} "
                                "collected; `pytest --collect-only -q` with the same arguments lists them)")
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid != node_id])
    items[:] = kept


@pytest.hookimpl(trylast=True)  # after -k and -m: the count of slow tests left out is of those they kept
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--perf-only"):
        _keep_only(config, items, config.getoption("--perf-only"))
    if SLOW_LEFT_OUT in config.stash:
        _deselect_slow(config, items)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and n_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (marked gpu); none available"))
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            needed = marker.args[0] if marker.args else 2
            if n_gpus < needed:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs {needed} CUDA devices (marked multi_gpu); {n_gpus} available")
                )


def pytest_report_header(config: pytest.Config) -> str:
    facts = machine.machine_facts()
    gpu = f"{facts['gpu_count']}x {facts['gpu_name']}" if facts["gpu_name"] else "no GPU"
    return (
        f"cs336_systems: {gpu}, torch {facts['torch']}, triton {facts['triton']}, "
        f"cuda {facts['cuda']}, perf profile {perf_profile(config)}"
    )


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["cs336_systems"] = machine.machine_facts()


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(config, benchmarksession, machine_info, compared_benchmark):
    ours = machine_info.get("cs336_systems", {})
    theirs = compared_benchmark.get("machine_info", {}).get("cs336_systems", {})
    differences = machine.incomparable_fields(ours, theirs) + machine.baseline_differences(ours, theirs)
    if differences:
        lines = "\n".join(f"    {field}: now {a!r}, saved {b!r}" for field, a, b in differences)
        message = (
            "\n" + "!" * 78 + "\nCOMPARING RUNS FROM DIFFERENT GPUS, SOFTWARE OR SWITCHES: absolute times do not "
            "transfer."
            f"\n{lines}\nCompare only runs from the same machine and versions, or use in-run ratios "
            "(benchmarks.json gates).\n" + "!" * 78
        )
        if not config.getoption("--compare-any-machine"):
            raise pytest.UsageError(message + "\nRefusing the comparison; pass --compare-any-machine to force it.")
        benchmarksession.logger.warning(message)
    config.stash[COMPARED_KEY].append(compared_benchmark)
    if (compared_benchmark.get("commit_info") or {}).get("dirty"):
        commit = (compared_benchmark.get("commit_info") or {}).get("id", "unknown")
        benchmarksession.logger.warning(
            f"The saved run compared against was made from a work tree with uncommitted changes (commit {commit}, "
            "dirty): its times cannot be traced to code. Refresh the baseline at a clean commit.")


# How torch and Triton word a sticky kernel fault (the context is unusable after it): a RuntimeError (torch's
# AcceleratorError is one) whose message starts with their CUDA prefix and names one of these faults.  Only those
# exceptions: an assertion or a child process's error that quotes such a message does not lose this process's
# context.
CUDA_FAULT = re.compile(r"(CUDA error|Triton Error \[CUDA\]): .*(illegal memory access|unspecified launch failure|"
                        r"misaligned address|illegal instruction|device-side assert triggered)")


def _cuda_fault(exc: BaseException | None, seen: set[int] | None = None) -> bool:
    """Whether ``exc``, an exception it was raised from or during, or one inside an exception group (Hypothesis
    reports several distinct failures as one) is a CUDA fault."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return False
    seen.add(id(exc))
    if isinstance(exc, RuntimeError) and not isinstance(exc, SpawnError) and CUDA_FAULT.match(str(exc)):
        return True
    inner = list(getattr(exc, "exceptions", ())) if isinstance(exc, BaseExceptionGroup) else []
    return any(_cuda_fault(e, seen) for e in (exc.__cause__, exc.__context__, *inner))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.excinfo is None or not _cuda_fault(call.excinfo.value):
        return report
    reason = f"CUDA context lost in {item.nodeid} ({call.excinfo.exconly().splitlines()[0][:200]})"
    if hasattr(item.config, "workerinput"):  # an xdist worker
        # Exiting before this report is sent makes xdist name this test as the one its worker crashed in.
        sys.stderr.write(f"\n{reason}: this worker exits, xdist replaces it\n")
        sys.stderr.flush()
        os._exit(3)
    item.session.shouldstop = f"{reason}: the tests after it cannot use the GPU in this process"
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A --benchmark-compare that compared nothing, or left a group of this run without a baseline, fails."""
    bench_session = getattr(session.config, "_benchmarksession", None)
    if bench_session is None or not bench_session.compare:
        return
    timed = {b.fullname: (b.extra_info or {}).get("group") for b in bench_session.benchmarks if b}
    covered = baseline.coverage(timed, session.config.stash.get(COMPARED_KEY, []),
                                session.config.stash.get(DESELECTED_KEY, set()))
    session.config.stash[COVERAGE_KEY] = covered
    failed = bool(covered.problems())
    mode = session.config.getoption("--perf-gate")
    if mode:
        gate = _statistical_gate(bench_session, session.config, strict=mode == "strict")
        session.config.stash[GATE_KEY] = gate
        failed = failed or bool(gate[1] or gate[2])
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _statistical_gate(bench_session, config: pytest.Config, strict: bool) -> tuple[list, list, list[str]]:
    """--perf-gate: a verdict per case of this run that the compared baseline has, from both runs' per-round
    samples; returns (verdicts, the failing ones, problems that fail the gate by themselves)."""
    from cs336_systems.bench import matrix
    from cs336_systems.reporting import significance

    saved: dict[str, list] = {}
    without_samples = []
    for run in config.stash.get(COMPARED_KEY, []):
        for record in run.get("benchmarks", []):
            name = record.get("fullname") or record.get("name", "")
            data = (record.get("stats") or {}).get("data")
            if isinstance(data, list) and data:
                saved[name] = data
            else:
                without_samples.append(name)
    new, fields = {}, {}
    for bench in bench_session.benchmarks:
        if bench and bench.stats is not None and getattr(bench.stats, "data", None):
            new[bench.fullname] = list(bench.stats.data)
            fields[bench.fullname] = bench.extra_info or {}
    verdicts = significance.compare(saved, new, fields, matrix.load(matrix.DEFAULT_PATH).gate_settings)
    problems = []
    unsampled = sorted(name for name in without_samples if name in new)
    if unsampled:
        problems.append(f"the baseline kept no per-round samples for {len(unsampled)} case(s) this run timed (e.g. "
                        f"{unsampled[0]}): rebuild it with cs336-baseline from runs that kept them")
    if not verdicts:
        problems.append("--perf-gate decided no case: the baseline has none of this run's cases with samples")
    return verdicts, significance.failures(verdicts, strict), problems


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(SLOW_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} test{'s' * (left_out != 1)} marked slow left out: --run-slow runs "
                                    "them too, -m slow only them")
    gate = config.stash.get(GATE_KEY, None)
    if gate is not None:
        _report_gate(terminalreporter, config, *gate)
    covered = config.stash.get(COVERAGE_KEY, None)
    if covered is None:
        return
    if covered.problems():
        terminalreporter.section("--benchmark-compare: incomplete comparison", red=True)
        for problem in covered.problems():
            terminalreporter.line(problem)
    if covered.missing:
        terminalreporter.section(f"--benchmark-compare: {len(covered.missing)} case(s) not in the baseline")
        for name in covered.missing:
            terminalreporter.line(f"not compared: {name}")
    if covered.not_run:
        terminalreporter.section(f"--benchmark-compare: {len(covered.not_run)} baseline case(s) did not run")
        for name in covered.not_run:
            terminalreporter.line(f"did not run: {name}")


def _report_gate(terminalreporter, config: pytest.Config, verdicts: list, failing: list, problems: list[str]) -> None:
    """The --perf-gate table on the terminal, and appended to $GITHUB_STEP_SUMMARY (a CI job's summary page)."""
    from cs336_systems.reporting import significance

    strict = config.getoption("--perf-gate") == "strict"
    title = (f"--perf-gate: {'FAILED' if failing or problems else 'passed'} "
             f"({'regressions and inconclusive cases fail' if strict else 'regressions fail'})")
    lines = [*problems, significance.summary(verdicts)]
    if verdicts:
        lines += ["", significance.table(verdicts)]
    terminalreporter.section(title, red=bool(failing or problems), green=not (failing or problems))
    for line in lines:
        terminalreporter.line(line)
    summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_file:
        try:
            with open(summary_file, "a") as out:
                out.write(f"### {title}\n\n" + "\n".join(lines) + "\n\n")
        except OSError as exc:
            terminalreporter.line(f"--perf-gate: could not append to GITHUB_STEP_SUMMARY {summary_file}: {exc}")
