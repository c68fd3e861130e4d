"""perf/ wiring: cases generated from benchmarks.json, and the `bench` fixture.

A perf test is marked ``@pytest.mark.suite("<suite name>")`` and takes a ``case`` argument; it is
parametrized with that suite's cases under the active profile (``--perf-profile``), optionally filtered by
``--perf-group``.  Its body hands a workload *setup* to ``bench(...)``, which

* runs warm-up and measured rounds through `cs336_systems.bench.harness.run_pytest_benchmark`
  (synchronizing clock, peak memory after warm-up, OOM capture), so a case cannot forget to sync;
* records the case, status, peak memory and derived rates (tokens/s, TFLOP/s, MFU) in ``extra_info``, and
  for host-timed cases ``host_ms`` / ``host_share``: the median host time to queue a round and its ratio to
  the round's median (near 1: host-bound; the e2e cases' GPU-bound steps read well below 1),
  which pytest-benchmark writes into its JSON (``--benchmark-autosave`` / ``--benchmark-json``), plus
  whatever the workload put in the ``extra_info`` dict it was handed (accuracy error, memory before
  backward: numbers the workload only knows once it has run);
* zeroes a 256 MiB buffer before every round, outside the timed region, when the case says
  ``"flush_l2": true`` (`benchmarking.L2Flush`: a cold L2 each round, as triton.testing.do_bench);
  ``"timings": ["device"]`` times attention rounds with CUDA events (``benchmarking`` timing="device",
  do_bench's convention: device time, host overhead hidden behind queued work) instead of the default
  host-synchronized clock; its cases' ids end in ``devicetime``; ``"timings": ["graph"]`` times replays
  of the step captured in a CUDA graph (ids end in ``graphtime``);
* on a GPU with NVML (``pynvml``), for the single-process cases (not ``dist_bench``'s): first waits (``--cool-down-s``, at most 10 s by default) until the GPU
  is back within 3 deg C of its temperature at the session's first case, so a case does not start hot
  from the one before (a hot H100 reaches its power cap sooner and lowers its clock), and samples the SM
  clock, power and temperature during the measured rounds (`cs336_systems.bench.gpu_telemetry`): the
  ``gpu_*`` and ``cooldown_*`` fields of ``extra_info``;
* turns an OOM into a skip whose reason says OOM, and lists it under ``"oom"`` in the saved JSON,
  so reports show OOM cells and comparisons never treat a missing time as a speed-up.

Multi-process cases (suites ``allreduce`` and ``data_parallel``) take the ``dist_bench`` fixture
instead: ``dist_bench(body, case=case)`` runs the collective ``body(device, case)`` on every rank, where
each rank times its rounds with the same harness and the slowest rank's time per round is kept
(`cs336_systems.bench.rank_timing`); rank 0's times are then recorded as this case's pytest-benchmark
rounds (`benchmarking.record_measured_times`).  The ranks come from one of two places:

* a plain ``pytest perf/`` spawns ``world_size`` local processes per case (gloo on the CPU, or NCCL with
  one GPU each; cases needing more GPUs than present are skipped with the reason);
* under torchrun (``torchrun --nproc-per-node=N [--nnodes=M ...] -m pytest perf/ ...``) every rank runs
  the same session; the process group is the job's (env:// rendezvous, one per session), cases whose
  world_size or backend differ from the job's are skipped, and only rank 0 writes JSON / autosaves.

At the end of the session the ratio gates of benchmarks.json are evaluated on the perf cases the session
selected (after --perf-group, -k and -m), not only on those that produced a time: a selected pair with a
side that ran out of memory, was skipped or failed fails the run with the reason, and a gate with no
selected pair is listed as not applicable (`cs336_systems.reporting.gates`).  The saved JSON records the
selection (``perf_profile``, ``perf_groups``, ``perf_not_timed`` with reasons) so ``cs336-gates`` judges a
saved run the same way.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from cs336_systems import switches
from cs336_systems.bench import harness as benchmarking
from cs336_systems.bench import flops
from cs336_systems.bench import gpu_telemetry
from cs336_systems.reporting import gates
from cs336_systems.bench import machine
from cs336_systems.bench import matrix
from cs336_systems.parallel import launch

OOM_KEY = pytest.StashKey[list]()
RESULTS_KEY = pytest.StashKey[list]()  # timed cases of this pytest session, for the ratio gates
SELECTED_KEY = pytest.StashKey[dict]()  # nodeid -> (test name, case) of every perf case this pytest session selected
OUTCOMES_KEY = pytest.StashKey[dict]()  # nodeid -> why a perf case did not pass ("skipped: ...", "failed: ...")
GATES_KEY = pytest.StashKey[list]()
GATES_ERROR_KEY = pytest.StashKey[str]()  # an ambiguous gate (gates.evaluate raised)
RUN_JSON_KEY = pytest.StashKey[dict]()  # the run as pytest-benchmark is about to write it (--benchmark-json)
GATES_IDLE_KEY = pytest.StashKey[str]()  # why the gates were not evaluated (nothing timed by design)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def perf_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _profile(config: pytest.Config) -> str:
    return config.getoption("--perf-profile") or machine.default_profile()


def _load_matrix(config: pytest.Config) -> matrix.Matrix:
    if not hasattr(config, "_cs336_matrix"):
        config._cs336_matrix = matrix.load(ROOT / "benchmarks.json")
    return config._cs336_matrix


# A case's test id is its identity (`matrix.case_id`): benchmarks.json refuses two cases with one id.
case_id = matrix.case_id


# Case fields that say *what* is compared within one pytest-benchmark table (the implementation, the
# eager/compiled and attention choices, the parallelism variant); every other field of the case names the
# table, so each table holds like with like and pytest-benchmark picks one sensible unit for it.
_COMPARED_FIELDS = frozenset({"impl", "compile", "attention", "variant", "bucket_size_mb", "world_size", "warmup",
                              "checkpoint", "rounds", "inner_iters", "suite", "device"})


def benchmark_group(case: dict) -> str:
    """The pytest-benchmark group of a case: its suite and the fields that are not compared within a table
    (e.g. ``flash: b1-n4096-d64-forward-bf16-causal-graphtime``)."""
    shape = case_id({k: v for k, v in case.items() if k not in _COMPARED_FIELDS})
    suite = case.get("suite", "perf")
    return f"{suite}: {shape}" if shape else suite


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the placeholder item pytest makes for a suite with no case in the selected profile / groups, so
    suites filtered out by --perf-group vanish instead of showing as 'got empty parameter set' skips."""
    empty = [item for item in items
             if "case" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")
             and not isinstance(item.callspec.params.get("case"), dict)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("suite")
    if marker is None or not marker.args:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} takes `case` but has no @pytest.mark.suite(name)")
    suite = marker.args[0]
    config = metafunc.config
    # The suite travels with the case into extra_info: gates and reports select cases by it.
    groups = config.getoption("--perf-group")
    # comma-separated: groups run in one session share its ratios (e.g. ddp-bf16,sharding-bf16 puts the
    # sharding variants and torch DDP in the same run); selected before duplicates across groups are merged
    wanted = None if groups is None else {g.strip() for g in groups.split(",") if g.strip()}
    cases = [{**c, "suite": suite} for c in _load_matrix(config).cases(suite, _profile(config), wanted)]
    metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def torchrun_rank() -> int | None:
    """This process's global rank when launched by torchrun (None for a plain pytest run).

    Only torchrun's own TORCHELASTIC_RUN_ID counts: other launchers export RANK / WORLD_SIZE too, and a
    plain pytest under them must not wait for a rendezvous nobody started.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("RANK", "0"))
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "suite(name): perf test parametrized from benchmarks.json's suite")
    config.stash[OOM_KEY] = []
    config.stash[RESULTS_KEY] = []
    config.stash[SELECTED_KEY] = {}
    config.stash[OUTCOMES_KEY] = {}
    _check_perf_groups(config)


def _check_perf_groups(config: pytest.Config) -> None:
    """--perf-group names must be groups of the selected profile: a typo would otherwise run nothing and pass."""
    groups = config.getoption("--perf-group")
    if groups is None:
        return
    wanted = {g.strip() for g in groups.split(",") if g.strip()}
    profile = _profile(config)
    known = {grid.get("group") for suite in _load_matrix(config).suites.values() for grid in suite.get(profile, [])}
    unknown = sorted(wanted - known)
    if not wanted or unknown:
        raise pytest.UsageError(
            f"--perf-group={groups!r}: {'no group named' if not wanted else f'unknown group(s) {unknown}'} in "
            f"profile {profile!r}; its groups: {', '.join(sorted(g for g in known if g))}")


def pytest_sessionstart(session: pytest.Session) -> None:
    rank = torchrun_rank()
    bench_session = getattr(session.config, "_benchmarksession", None)
    if rank not in (None, 0) and bench_session is not None:
        # Every rank runs the same cases; only rank 0 saves (one file, no races, no duplicate autosaves).
        bench_session.json = None
        bench_session.save = None
        bench_session.autosave = None
        bench_session.histogram = False


@pytest.fixture(scope="session")
def torchrun_context():
    """The torchrun job's process group (initialized once per session), or None outside torchrun."""
    if torchrun_rank() is None:
        yield None
        return
    # CS336_DIST_TIMEOUT_S bounds every collective, so a hung case fails instead of stalling the job.
    ctx = launch.init_from_env(timeout_s=float(switches.read("CS336_DIST_TIMEOUT_S") or "600"))
    yield ctx
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _peak_for(precision: str, peak_override: float | None) -> float | None:
    if peak_override is not None:
        return peak_override
    if not torch.cuda.is_available():
        return None
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    return machine.peak_tflops(torch.cuda.get_device_name(0), precision)


COOL_DOWN_MARGIN_C = 3.0
START_TEMPERATURE_KEY = pytest.StashKey[float]()


def _cool_down(config: pytest.Config, device: torch.device) -> dict:
    """Wait for the GPU to cool to the session's first-case temperature + COOL_DOWN_MARGIN_C (at most
    --cool-down-s seconds); the record of the wait, {} on CPU or without NVML."""
    if START_TEMPERATURE_KEY not in config.stash:
        start = gpu_telemetry.temperature_c(device)
        if start is None:
            return {}
        config.stash[START_TEMPERATURE_KEY] = float(start)
    max_wait_s = config.getoption("--cool-down-s")
    if not max_wait_s:
        return {}
    target = config.stash[START_TEMPERATURE_KEY] + COOL_DOWN_MARGIN_C
    return {"cooldown_target_c": target, **(gpu_telemetry.cool_down(device, target, max_wait_s) or {})}


def _gate_entry(case: dict, stats, extra_info: dict) -> dict:
    """What the in-run gates judge of a timed case: its fields, its times, and the results a gate may bound
    instead of time (`gates.RESULT_STATISTICS`, e.g. peak memory) where the case recorded them."""
    return {**case, "stats": {"median": stats.median, "mean": stats.mean, "min": stats.min},
            **{k: extra_info[k] for k in gates.RESULT_STATISTICS if k in extra_info}}


@pytest.fixture
def bench(benchmark, request: pytest.FixtureRequest, perf_device: torch.device):
    """``bench(setup, *, case, flops_per_step=None, tokens=None, extra_info=None) -> Measurement``.

    ``extra_info`` is a dict the workload fills while it runs; it is merged into the benchmark's
    extra_info (and into the OOM record) after the run.  See the module docstring.
    """

    def run(setup, *, case: dict, flops_per_step: float | None = None, tokens: int | None = None,
            extra_info: dict | None = None):
        benchmark.group = benchmark_group(case)
        benchmark.extra_info.update(case)
        benchmark.extra_info["device"] = str(perf_device)
        benchmark.extra_info.update(_cool_down(request.config, perf_device))
        telemetry = gpu_telemetry.Telemetry(perf_device)
        result = benchmarking.run_pytest_benchmark(
            benchmark, setup, warmup=case["warmup"], rounds=case["rounds"], device=perf_device,
            before_each=benchmarking.L2Flush(perf_device) if case.get("flush_l2") else None,
            timing=case.get("timing", "host"), monitor=telemetry,
        )
        benchmark.extra_info.update(telemetry.summary())
        benchmark.extra_info["status"] = result.status
        benchmark.extra_info.update(extra_info or {})
        if not result.ok:
            request.config.stash[OOM_KEY].append(
                {"name": request.node.name, "fullname": request.node.nodeid,
                 "extra_info": {**case, **(extra_info or {})}, "error": result.error}
            )
            pytest.skip(f"OOM (recorded in the saved JSON): {result.error}")
        if result.stats is None:  # --benchmark-disable: the step ran once as a smoke test, untimed
            return result
        median = result.stats.median
        stats = result.stats
        if result.peak_memory_bytes is not None:
            benchmark.extra_info["peak_memory_gib"] = result.peak_memory_bytes / 2**30
        if result.host_s:  # timing "host": the host's time to queue a round, and its share of the round
            host = statistics.median(result.host_s)
            benchmark.extra_info["host_ms"] = host * 1e3
            benchmark.extra_info["host_share"] = host / median
        request.config.stash[RESULTS_KEY].append(_gate_entry(case, stats, benchmark.extra_info))
        if tokens is not None:
            benchmark.extra_info["tokens_per_s"] = tokens / median
        if flops_per_step is not None:
            # LM cases name an autocast "precision", attention cases the inputs' "dtype".
            precision = case.get("precision", case.get("dtype", "fp32"))
            peak = _peak_for(precision, request.config.getoption("--peak-tflops"))
            benchmark.extra_info["flops_per_step"] = flops_per_step
            benchmark.extra_info["tflops"] = flops_per_step / median / 1e12
            benchmark.extra_info["peak_tflops"] = peak
            benchmark.extra_info["mfu"] = flops.mfu(flops_per_step, median, peak)
        return result

    return run


# Generous: XL models take a while to build and warm up; a hung collective still ends the case.
_SPAWN_TIMEOUT_S = {"allreduce": 300.0, "data_parallel": 900.0}


@pytest.fixture
def dist_bench(benchmark, request: pytest.FixtureRequest, torchrun_context):
    """``dist_bench(body, *, case) -> dict``: run a collective benchmark body on world_size ranks and record
    rank 0's slowest-rank round times as this case's rounds (see the module docstring).

    The body returns the same outcome on every rank (`cs336_systems.bench.rank_timing` agrees on it): status
    "oom" (a rank ran out of memory; recorded under "oom" in the saved JSON, shown as an OOM cell) or
    "error" (a rank raised: the test fails with that rank's error and traceback)."""

    def run(body, *, case: dict) -> dict:
        world, backend = case["world_size"], case["backend"]
        benchmark.group = benchmark_group(case)
        benchmark.extra_info.update(case)
        if torchrun_context is not None:
            if world != torchrun_context.world_size or backend != torchrun_context.backend:
                pytest.skip(f"case needs world_size={world}, backend={backend}; this torchrun job has "
                            f"world_size={torchrun_context.world_size}, backend={torchrun_context.backend}")
            result = body(torchrun_context.device, case)
        else:
            if backend == "nccl" and torch.cuda.device_count() < world:
                pytest.skip(f"needs {world} GPUs for NCCL; {torch.cuda.device_count()} visible")
            try:
                result = launch.spawn(launch.run_case_on_local_device, world, body, case, backend=backend,
                                      timeout_s=_SPAWN_TIMEOUT_S.get(case["suite"], 600.0))[0]
            except launch.SpawnError as exc:
                if not benchmarking.is_out_of_memory(RuntimeError(str(exc))):
                    raise
                result = {"status": "oom", "error": str(exc).strip().splitlines()[-1]}
        benchmark.extra_info["status"] = result["status"]
        benchmark.extra_info["device"] = "cuda" if backend == "nccl" else "cpu"
        if result["status"] == "oom":  # every rank stopped; the error names the rank(s) out of memory
            request.config.stash[OOM_KEY].append(
                {"name": request.node.name, "fullname": request.node.nodeid, "extra_info": dict(case),
                 "error": result.get("error")}
            )
            pytest.skip(f"OOM (recorded in the saved JSON): {result.get('error')}")
        if result["status"] != "ok":  # a rank raised: its rank, phase and traceback
            pytest.fail(f"distributed case failed: {result.get('error')}", pytrace=False)
        benchmarking.record_measured_times(benchmark, result["times_s"])
        benchmark.extra_info.update(result.get("extra_info", {}))
        if result.get("peak_memory_bytes") is not None:
            benchmark.extra_info["peak_memory_gib"] = result["peak_memory_bytes"] / 2**30
        stats = benchmarking.Stats.of(result["times_s"])
        request.config.stash[RESULTS_KEY].append(_gate_entry(case, stats, benchmark.extra_info))
        return result

    return run


# --- what the session selected and what became of each case (for the gates and the saved JSON) ----------

def pytest_collection_finish(session: pytest.Session) -> None:
    """Remember the perf cases left after --perf-group, -k and -m: the cases this run owes a time."""
    session.config.stash[SELECTED_KEY] = {
        item.nodeid: (item.name, item.callspec.params["case"]) for item in session.items
        if isinstance(getattr(getattr(item, "callspec", None), "params", {}).get("case"), dict)
    }


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    outcomes = item.config.stash.get(OUTCOMES_KEY, None)
    if outcomes is not None and report.outcome != "passed" and item.nodeid not in outcomes:
        outcomes[item.nodeid] = _reason(report)
    return report


def _reason(report: pytest.TestReport) -> str:
    """"skipped: <reason>" or "failed: <exception line>" (setup and teardown errors say so)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return "skipped: " + str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = str(report.longrepr).strip().splitlines()
    message = crash.message if crash is not None else (lines[-1] if lines else "")
    kind = "failed" if report.when == "call" else f"error in {report.when}"
    return f"{kind}: {' '.join(str(message).split())[:500]}"


def _not_timed(config: pytest.Config) -> list[dict]:
    """The selected perf cases that have neither a time nor an OOM record, each with why."""
    timed = {gates.case_key(r) for r in config.stash.get(RESULTS_KEY, [])}
    oom = {o["fullname"] for o in config.stash.get(OOM_KEY, [])}
    outcomes = config.stash.get(OUTCOMES_KEY, {})
    return [{"name": name, "fullname": nodeid, "extra_info": case,
             "reason": outcomes.get(nodeid, "not run (the session ended first)")}
            for nodeid, (name, case) in config.stash.get(SELECTED_KEY, {}).items()
            if nodeid not in oom and gates.case_key(case) not in timed]


def _selected_groups(config: pytest.Config) -> list[str]:
    """The groups --perf-group selected, or every group of the profile when it was not given."""
    groups = config.getoption("--perf-group")
    available = _load_matrix(config).groups(_profile(config))
    if groups is None:
        return available
    wanted = {g.strip() for g in groups.split(",") if g.strip()}
    return [g for g in available if g in wanted]


def _session_run(config: pytest.Config) -> gates.RunCases:
    reasons = {gates.case_key(o["extra_info"]): f"OOM: {o['error']}" for o in config.stash.get(OOM_KEY, [])}
    reasons.update({gates.case_key(r["extra_info"]): r["reason"] for r in _not_timed(config)})
    selected = [case for _, case in config.stash.get(SELECTED_KEY, {}).values()]
    return gates.RunCases(selected, list(config.stash.get(RESULTS_KEY, [])), reasons, _selected_groups(config))


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    output_json["oom"] = list(config.stash.get(OOM_KEY, []))
    output_json["perf_profile"] = _profile(config)
    output_json["perf_groups"] = _selected_groups(config)
    output_json["perf_not_timed"] = _not_timed(config)
    config.stash[RUN_JSON_KEY] = output_json


def _json_path(target) -> Path:
    """--benchmark-json's value as a path: pytest-benchmark parses it to a Path (whose ``name`` is only the
    basename), older releases to an open file (whose ``name`` is its path)."""
    return Path(target) if isinstance(target, (str, os.PathLike)) else Path(target.name)


def _written(target) -> bool:
    """Whether ``target`` (`_json_path`) holds a saved run."""
    try:
        data = json.loads(_json_path(target).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("benchmarks"), list)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A --benchmark-json that could not be written after every case was measured (a full disk, a folder
    removed meanwhile): save the run to a fallback file and say where, instead of losing it."""
    run = config.stash.get(RUN_JSON_KEY, None)
    target = config.getoption("benchmark_json", None)
    if run is None or target is None or _written(target):
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in (Path.cwd(), Path.home(), Path(tempfile.gettempdir())):
        fallback = folder / f"perf-run-unsaved-{stamp}-{os.getpid()}.json"
        try:
            fallback.write_text(json.dumps(run, indent=1, default=str))
        except OSError:
            continue
        sys.stderr.write(f"\n--benchmark-json={_json_path(target)} was not written; the run is saved "
                         f"in {fallback} instead\n")
        return
    sys.stderr.write(f"\n--benchmark-json={_json_path(target)} was not written, and no fallback "
                     "file could be written either (current folder, home, temp): the run is lost\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Evaluate benchmarks.json's ratio gates on the perf cases this pytest session selected (see
    `cs336_systems.reporting.gates`): a violated pair, or a selected pair without a time, fails the run."""
    config = session.config
    if not config.stash.get(SELECTED_KEY, {}) or config.option.collectonly:
        return  # (--collect-only measures nothing: its cases are not "not measured")
    bench_session = getattr(config, "_benchmarksession", None)
    if bench_session is None or bench_session.disabled or bench_session.skip:
        config.stash[GATES_IDLE_KEY] = "benchmarks disabled or skipped in this pytest session: nothing was timed"
        return
    m = _load_matrix(config)
    profile = _profile(config)
    profile_cases = [{**c, "suite": s} for s in m.suites for c in m.cases(s, profile)]
    try:
        checks = gates.evaluate(m.gates, _session_run(config), gates.case_fields_of(m), profile_cases)
    except ValueError as exc:  # an ambiguous gate: fail the run, but let pytest-benchmark save its JSON
        config.stash[GATES_ERROR_KEY] = str(exc)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    config.stash[GATES_KEY] = checks
    if not all(c.ok for c in checks) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    error = config.stash.get(GATES_ERROR_KEY, None)
    if error is not None:
        terminalreporter.section("ratio gates: error", red=True)
        terminalreporter.line(error)
    idle = config.stash.get(GATES_IDLE_KEY, None)
    if idle is not None:
        terminalreporter.section("ratio gates: not evaluated")
        terminalreporter.line(idle)
    checks = config.stash.get(GATES_KEY, [])
    if checks:
        failed = not all(c.ok for c in checks)
        terminalreporter.section(gates.summary(checks), red=failed, green=not failed)
        for line in gates.table(checks).splitlines():
            terminalreporter.line(line)
    ooms = config.stash.get(OOM_KEY, [])
    if ooms:
        terminalreporter.section(f"{len(ooms)} case(s) ran out of memory (recorded)")
        for oom in ooms:
            terminalreporter.line(f"OOM {oom['name']}: {oom['error']}")
