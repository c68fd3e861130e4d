"""The perf/ wiring (bench fixture, matrix parametrization, OOM recording, machine_info, comparisons),
exercised in isolated pytest sessions built from the project's real conftest files."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cs336_systems.bench import machine
from cs336_systems.reporting import baseline, gates

ROOT = Path(__file__).resolve().parents[2]

TINY_MATRIX = {
    "suites": {
        "end_to_end": {
            "profiles": {
                "cpu": [{"sizes": ["tiny"], "contexts": [8, 16], "batch_sizes": [1], "modes": ["forward"],
                         "precisions": ["fp32"], "compile": [False], "warmup": 1, "rounds": 3, "group": "g1"}]
            }
        }
    }
}

PERF_TESTS = '''
import pytest, torch
from cs336_systems.bench.harness import SynchronizedClock, run_pytest_benchmark

@pytest.mark.suite("end_to_end")
def test_case(case, bench):
    x = torch.randn(32, 32)
    result = bench(lambda: (lambda: x @ x), case=case, flops_per_step=2 * 32**3, tokens=100)
    assert result.ok and len(result.times_s) == case["rounds"]

def test_oom(bench):
    def setup():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    bench(setup, case={"size": "tiny", "context": 8, "batch_size": 1, "mode": "forward",
                       "precision": "fp32", "compile": False, "attention": "sdpa", "warmup": 1, "rounds": 2})

def test_pytest_benchmark_reads_the_clock_only_after_a_sync(benchmark):
    events, state = [], {"now": 0.0, "pending": 0.0}
    def sync():
        events.append("sync"); state["now"] += state["pending"]; state["pending"] = 0.0
    def clock():
        events.append("read"); return state["now"]
    def step():
        events.append("step"); state["pending"] += 0.5
    result = run_pytest_benchmark(benchmark, lambda: step, warmup=2, rounds=4,
                                  clock=SynchronizedClock(sync=sync, clock=clock, host_clock=lambda: state["now"]))
    assert events.count("step") == 6
    assert all(events[i - 1] == "sync" for i, e in enumerate(events) if e == "read")
    assert list(benchmark.stats.stats.data) == [0.5] * 4 == list(result.times_s)
    assert list(result.host_s) == [0.0] * 4  # the fake host queues its work in no time
'''


@pytest.fixture
def project(pytester, perf_session):
    """A project folder with the real conftest files; ``run(*args)`` runs pytest there, in this process
    (tests/conftest.py's `perf_session`)."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    perf = pytester.mkdir("perf")
    (perf / "conftest.py").write_text((ROOT / "perf" / "conftest.py").read_text())
    (perf / "test_fake.py").write_text(PERF_TESTS)
    (pytester.path / "benchmarks.json").write_text(json.dumps(TINY_MATRIX))
    return SimpleNamespace(path=pytester.path, run=perf_session)


def test_bench_fixture_records_cases_rates_and_ooms(project):
    result = project.run(
        "perf", "--perf-profile=cpu", "--benchmark-json=out.json", "-p", "no:cacheprovider", "-rs"
    )
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["*1 case(s) ran out of memory*", "*OOM (recorded in the saved JSON)*"])
    data = json.loads((project.path / "out.json").read_text())
    names = {b["name"] for b in data["benchmarks"]}
    assert names == {"test_case[tiny-ctx8-b1-forward-fp32-eager-sdpa-w1]",
                     "test_case[tiny-ctx16-b1-forward-fp32-eager-sdpa-w1]",
                     "test_pytest_benchmark_reads_the_clock_only_after_a_sync"}
    case = next(b for b in data["benchmarks"] if b["name"].startswith("test_case[tiny-ctx8"))
    info = case["extra_info"]
    assert info["status"] == "ok" and info["context"] == 8 and info["group"] == "g1"
    assert info["tokens_per_s"] == pytest.approx(100 / case["stats"]["median"])
    assert info["tflops"] == pytest.approx(2 * 32**3 / case["stats"]["median"] / 1e12)
    if torch.cuda.is_available():  # fp32 peak of the GPU, or None if the GPU is not in the table
        peak = machine.peak_tflops(torch.cuda.get_device_name(0), "fp32")
        assert info["peak_tflops"] == peak
        assert info["mfu"] == (None if peak is None else pytest.approx(info["tflops"] / peak))
    else:
        assert info["mfu"] is None and info["peak_tflops"] is None
    assert case["stats"]["rounds"] == 3
    assert [o["name"] for o in data["oom"]] == ["test_oom"]
    assert data["perf_profile"] == "cpu"
    assert data["perf_groups"] == ["g1"] and data["perf_not_timed"] == []  # every selected case was timed
    assert {"gpu_name", "torch", "triton", "cuda", "driver"} <= set(data["machine_info"]["cs336_systems"])


def test_machine_facts_record_the_librarys_switches(monkeypatch):
    """Set, non-empty CS336_* variables are recorded (sorted); other variables and empty ones are not."""
    for name in [n for n in os.environ if n.startswith("CS336_")]:
        monkeypatch.delenv(name)
    assert machine.machine_facts()["switches"] == {}
    monkeypatch.setenv("CS336_FLASH_TMA", "0")
    monkeypatch.setenv("CS336_FLASH_SPLIT_D", "1")
    monkeypatch.setenv("CS336_FLASH_SPLITS", "")
    monkeypatch.setenv("NOT_CS336_FLASH_TMA", "1")
    facts = machine.machine_facts()
    assert facts["switches"] == {"CS336_FLASH_SPLIT_D": "1", "CS336_FLASH_TMA": "0"}
    assert list(facts["switches"]) == ["CS336_FLASH_SPLIT_D", "CS336_FLASH_TMA"]


def test_perf_group_filters_cases(project):
    result = project.run("perf", "--perf-profile=cpu", "--perf-group=g1", "-k", "test_case", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # several groups, comma-separated, run in one session
    result = project.run("perf", "--perf-profile=cpu", "--perf-group=g1, g1", "-k", "test_case", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # a group the profile does not have is a usage error, not an empty run that passes
    for groups in ("nope", "nope, g1", ","):
        result = project.run("perf", "--perf-profile=cpu", f"--perf-group={groups}", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, groups
        assert "its groups: g1" in result.stderr.str(), groups
    for peak in ("0", "-1", "nan", "x"):
        result = project.run("perf", "--perf-profile=cpu", f"--peak-tflops={peak}", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, peak


def test_peak_override_gives_mfu(project):
    project.run(
        "perf", "--perf-profile=cpu", "-k", "test_case", "--peak-tflops=1.0", "--benchmark-json=out.json", "-p", "no:cacheprovider"
    ).assert_outcomes(passed=2)
    data = json.loads((project.path / "out.json").read_text())
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        assert info["mfu"] == pytest.approx(info["tflops"] / 1.0)


def test_comparing_runs_from_another_gpu_is_refused_unless_forced(project):
    storage = project.path / "store"
    args = ("perf", "--perf-profile=cpu", "-k", "test_case", f"--benchmark-storage=file://{storage}", "-p", "no:cacheprovider")
    project.run(*args, "--benchmark-save=base").assert_outcomes(passed=2)
    saved = next(storage.rglob("0001_base.json"))
    data = json.loads(saved.read_text())
    data["machine_info"]["cs336_systems"]["gpu_name"] = "Imaginary GPU 9000"
    saved.write_text(json.dumps(data))
    result = project.run(*args, "--benchmark-compare=0001")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # refused by default
    assert "COMPARING RUNS FROM DIFFERENT GPUS, SOFTWARE OR SWITCHES" in output
    assert "saved 'Imaginary GPU 9000'" in output and "--compare-any-machine" in output
    forced = project.run(*args, "--benchmark-compare=0001", "--compare-any-machine")
    forced.assert_outcomes(passed=2)
    assert "COMPARING RUNS FROM DIFFERENT GPUS, SOFTWARE OR SWITCHES" in forced.stdout.str() + forced.stderr.str()
    # the same GPU and versions, but another cuDNN, driver or set of switches: refused too
    for field, value in (("cudnn", 1), ("driver", "0.0.0"), ("switches", {"CS336_FLASH_FUSED_BWD": "0"})):
        changed = json.loads(json.dumps(data))
        changed["machine_info"]["cs336_systems"]["gpu_name"] = machine.machine_facts()["gpu_name"]
        changed["machine_info"]["cs336_systems"][field] = value
        saved.write_text(json.dumps(changed))
        result = project.run(*args, "--benchmark-compare=0001")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, field
        assert f"    {field}: now " in result.stdout.str() + result.stderr.str()


def test_baseline_differences_hold_cudnn_driver_and_switches_equal():
    a = {"cudnn": 91900, "driver": "580", "switches": {}}
    assert machine.baseline_differences(a, dict(a)) == []
    assert machine.baseline_differences(a, a | {"switches": {"CS336_FLASH_TMA": "0"}}) == [
        ("switches", {}, {"CS336_FLASH_TMA": "0"})]
    assert machine.baseline_differences(a, a | {"cudnn": 91000})[0][0] == "cudnn"
    assert machine.baseline_differences(a, {"cudnn": 91900}) == []  # a run saved before a field was recorded
    assert machine.baseline_differences(a, a | {"switches": None}) == []  # no switches set, either way


def test_same_machine_comparison_is_quiet(project):
    storage = project.path / "store"
    args = ("perf", "--perf-profile=cpu", "-k", "test_case", f"--benchmark-storage=file://{storage}", "-p", "no:cacheprovider")
    project.run(*args, "--benchmark-save=base").assert_outcomes(passed=2)
    result = project.run(*args, "--benchmark-compare=0001")
    result.assert_outcomes(passed=2)
    assert "COMPARING RUNS FROM DIFFERENT GPUS" not in result.stdout.str() + result.stderr.str()


# --- per-round hooks and the attention suites ------------------------------------------------------------

HOOK_TESTS = '''
from cs336_systems.bench import harness as benchmarking

RealClock = benchmarking.SynchronizedClock


class FakeDevice:
    """Queued work becomes visible to the clock only at a sync, as on a GPU."""

    def __init__(self):
        self.events, self.now, self.pending = [], 0.0, 0.0

    def sync(self):
        self.events.append("sync"); self.now += self.pending; self.pending = 0.0

    def clock(self):
        self.events.append("read"); return self.now

    def host_clock(self):  # the host-share reads, unsynchronized by design: not logged
        return self.now

    def queue(self, event, seconds):
        self.events.append(event); self.pending += seconds


class BackwardLikeStep:
    def __init__(self, dev):
        self.dev = dev

    def before_each(self):  # the untimed forward
        self.dev.queue("forward", 10.0)

    def __call__(self):  # the timed backward
        self.dev.queue("step", 0.5)


WARMUP = ["forward", "flush", "step"]
DRAIN = ["sync", "read"]
ROUND = ["forward", "flush", "sync", "read", "step", "sync", "read"]


def test_run_pytest_benchmark_never_times_before_each(benchmark):
    dev = FakeDevice()
    result = benchmarking.run_pytest_benchmark(
        benchmark, lambda: BackwardLikeStep(dev), warmup=1, rounds=4,
        clock=RealClock(sync=dev.sync, clock=dev.clock, host_clock=dev.host_clock),
        before_each=lambda: dev.queue("flush", 100.0),
    )
    assert dev.events == WARMUP + DRAIN + ROUND * 4
    assert list(benchmark.stats.stats.data) == [0.5] * 4 == list(result.times_s)


def test_bench_flushes_l2_per_round_untimed(bench, benchmark, monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(benchmarking, "SynchronizedClock",
                        lambda device=None: RealClock(sync=dev.sync, clock=dev.clock, host_clock=dev.host_clock))
    monkeypatch.setattr(benchmarking, "L2Flush", lambda device: (lambda: dev.queue("flush", 100.0)))
    metrics = {}

    def setup():
        metrics["accuracy_error"] = 0.0  # filled by the workload while it runs
        return BackwardLikeStep(dev)

    case = {"impl": "naive", "seq_len": 8, "head_dim": 4, "mode": "backward", "dtype": "fp32", "causal": True,
            "flush_l2": True, "warmup": 1, "rounds": 3}
    result = bench(setup, case=case, flops_per_step=8.0, extra_info=metrics)
    assert dev.events == WARMUP + DRAIN + ROUND * 3
    assert list(result.times_s) == [0.5] * 3
    assert benchmark.extra_info["accuracy_error"] == 0.0 and benchmark.extra_info["tflops"] == 16.0 / 1e12
    # the fake host queues in no time: a device-bound round
    assert benchmark.extra_info["host_ms"] == 0.0 and benchmark.extra_info["host_share"] == 0.0
'''

ATTENTION_MATRIX = {
    "suites": {
        "attention": {"profiles": {"cpu": [
            {"group": "att", "impls": ["naive", "sdpa-flash"], "batch_sizes": [2], "seq_lens": [16],
             "head_dims": [8], "dtypes": ["fp32"], "causal": [False], "modes": ["forward", "backward"],
             "warmup": 1, "rounds": 2}]}},
        "flash": {"profiles": {"cpu": [
            {"group": "fl", "impls": ["naive"], "batch_sizes": [1], "heads": [None, 2], "seq_lens": [16],
             "head_dims": [8], "dtypes": ["bf16"], "causal": [True], "modes": ["forward-backward"],
             "warmup": 0, "rounds": 2}]}},
        "leaderboard": {"profiles": {"cpu": [
            {"group": "lb", "impls": ["naive"], "batch_sizes": [1], "heads": [2], "seq_lens": [16],
             "head_dims": [8], "dtypes": ["bf16"], "causal": [True], "modes": ["forward"], "flush_l2": True,
             "warmup": 1, "rounds": 2}]}},
    }
}


def test_hooks_are_never_timed_through_pytest_benchmark_and_bench(project):
    (project.path / "perf" / "test_hooks.py").write_text(HOOK_TESTS)
    result = project.run("perf/test_hooks.py", "--perf-profile=cpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_attention_suites_record_accuracy_rates_and_skips(project):
    (project.path / "benchmarks.json").write_text(json.dumps(ATTENTION_MATRIX))
    (project.path / "perf" / "test_fake.py").unlink()
    (project.path / "perf" / "test_attention.py").write_text((ROOT / "perf" / "test_attention.py").read_text())
    result = project.run(
        "perf", "--perf-profile=cpu", "--benchmark-json=out.json", "-p", "no:cacheprovider", "-rs"
    )
    result.assert_outcomes(passed=5, skipped=2)
    result.stdout.fnmatch_lines(["*sdpa-flash is not available on cpu*"])
    data = json.loads((project.path / "out.json").read_text())
    by_name = {b["name"]: b for b in data["benchmarks"]}
    assert set(by_name) == {
        "test_attention[naive-b2-n16-d8-forward-fp32-full-eager-w1]",
        "test_attention[naive-b2-n16-d8-backward-fp32-full-eager-w1]",
        "test_flash[naive-b1-n16-d8-forward-backward-bf16-causal-eager-w0]",
        "test_flash[naive-b1-h2-n16-d8-forward-backward-bf16-causal-eager-w0]",
        "test_leaderboard[naive-b1-h2-n16-d8-forward-bf16-causal-eager-w1-l2flush]",
    }
    backward = by_name["test_attention[naive-b2-n16-d8-backward-fp32-full-eager-w1]"]
    info = backward["extra_info"]
    assert info["status"] == "ok" and info["accuracy_error"] < 1e-6 and info["accuracy_tolerance"] == 1e-3
    assert info["flops_per_step"] == 4 * 2 * 16 * 16 * 8 * 2.5
    assert info["tflops"] == pytest.approx(info["flops_per_step"] / backward["stats"]["median"] / 1e12)
    assert backward["stats"]["rounds"] == 2
    flash = by_name["test_flash[naive-b1-h2-n16-d8-forward-backward-bf16-causal-eager-w0]"]["extra_info"]
    assert flash["heads"] == 2 and 0 < flash["accuracy_error"] < 5e-2
    board = by_name["test_leaderboard[naive-b1-h2-n16-d8-forward-bf16-causal-eager-w1-l2flush]"]["extra_info"]
    assert board["flush_l2"] is True and board["flops_per_step"] == 4 * 2 * 16 * 16 * 8 * 0.5


@pytest.mark.parametrize("max_ratio, fails", [(1e6, False), (1e-6, True)])
def test_ratio_gates_are_evaluated_at_the_end_of_the_session(project, max_ratio, fails):
    data = dict(TINY_MATRIX, gates=[{"name": "longer is not slower", "suite": "end_to_end",
                                     "numerator": {"context": 16}, "denominator": {"context": 8},
                                     "max_ratio": max_ratio}])
    (project.path / "benchmarks.json").write_text(json.dumps(data))
    result = project.run("perf", "--perf-profile=cpu", "-k", "test_case", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)  # every case passed; the gate alone decides the exit code
    output = result.stdout.str()
    if fails:
        assert result.ret == 1
        assert "ratio gates: 1 violated" in output and "| longer is not slower |" in output and "VIOLATED" in output
    else:
        assert result.ret == 0 and "ratio gates: all 1 measured pairs hold" in output


def test_an_ambiguous_gate_fails_the_session_but_the_json_is_saved(project):
    # the denominator side leaves out context, which the numerator names: both contexts match it
    data = dict(TINY_MATRIX, gates=[{"name": "ambiguous", "suite": "end_to_end", "numerator": {"context": 16},
                                     "denominator": {"mode": "forward"}, "max_ratio": 1e6}])
    (project.path / "benchmarks.json").write_text(json.dumps(data))
    result = project.run("perf", "--perf-profile=cpu", "-k", "test_case", "-p", "no:cacheprovider",
                         "--benchmark-json=out.json")
    result.assert_outcomes(passed=2)
    output = result.stdout.str()
    assert result.ret == 1 and "ratio gates: error" in output and "differ only in ['context'" in output
    assert len(json.loads((project.path / "out.json").read_text())["benchmarks"]) == 2


# --- a gate owes a verdict on every pair the session selected ---------------------------------------------

GATED_TESTS = '''
import pytest, torch

@pytest.mark.suite("end_to_end")
def test_case(case, bench):
    def setup():
        if case["context"] == 16:
            {failure}
        x = torch.randn(8, 8)
        return lambda: x @ x
    bench(setup, case=case)
'''

TWO_GROUPS = dict(TINY_MATRIX, suites={"end_to_end": {"profiles": {"cpu": [
    TINY_MATRIX["suites"]["end_to_end"]["profiles"]["cpu"][0],
    {**TINY_MATRIX["suites"]["end_to_end"]["profiles"]["cpu"][0], "contexts": [32], "group": "g2"}]}}},
    gates=[{"name": "longer is not slower", "suite": "end_to_end", "numerator": {"context": 16},
            "denominator": {"context": 8}, "max_ratio": 1e6}])


@pytest.mark.parametrize("failure, outcome, reason", [
    ('raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")', "skipped",
     "OOM: CUDA out of memory. Tried to allocate 8.00 GiB"),
    ('pytest.skip("flash-x is not available on cpu")', "skipped", "skipped: flash-x is not available on cpu"),
    ('raise RuntimeError("kernel launch failed")', "failed", "failed: RuntimeError: kernel launch failed"),
])
def test_a_gate_whose_case_did_not_run_fails_the_session_and_the_saved_run(project, failure, outcome, reason):
    (project.path / "benchmarks.json").write_text(json.dumps(TWO_GROUPS))
    (project.path / "perf" / "test_fake.py").write_text(GATED_TESTS.replace("{failure}", failure))
    result = project.run("perf", "--perf-profile=cpu", "--perf-group=g1", "-p", "no:cacheprovider",
                         "--benchmark-json=out.json")
    result.assert_outcomes(passed=1, **{outcome: 1})
    output = result.stdout.str()
    assert result.ret == 1 and "ratio gates: 1 not measured" in output
    assert f"NOT MEASURED: numerator tiny-ctx16-b1-forward-fp32-eager-sdpa-w1: {reason}" in output
    data = json.loads((project.path / "out.json").read_text())
    assert data["perf_groups"] == ["g1"]
    if reason.startswith("OOM"):
        assert [o["extra_info"]["context"] for o in data["oom"]] == [16] and data["perf_not_timed"] == []
    else:
        (record,) = data["perf_not_timed"]
        assert record["extra_info"]["context"] == 16 and record["reason"] == reason
    # the saved run judged alone (`python -m cs336_systems.gates`, which exits with main's status)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = gates.main([str(project.path / "out.json"), "--matrix", str(project.path / "benchmarks.json")])
    assert code == 1 and reason in out.getvalue(), out.getvalue() + err.getvalue()


def test_gates_of_groups_or_cases_not_selected_are_not_applicable_not_passed(project):
    (project.path / "benchmarks.json").write_text(json.dumps(TWO_GROUPS))
    (project.path / "perf" / "test_fake.py").write_text(GATED_TESTS.replace("{failure}", "pass"))
    for selection, why in ((["--perf-group=g2"], "needs group g1, not selected"),
                           (["-k", "ctx16"], "group g1 selected, but the gate's cases deselected")):
        result = project.run("perf", "--perf-profile=cpu", *selection, "-p", "no:cacheprovider")
        assert result.ret == 0, selection
        output = result.stdout.str()
        assert "ratio gates: none applies to this run" in output and "| not applicable |" in output
        assert f"| longer is not slower | {why}" in output and "ok |" not in output


def test_comparing_a_group_the_baseline_does_not_cover_fails(project):
    (project.path / "benchmarks.json").write_text(json.dumps(dict(TWO_GROUPS, gates=[])))
    (project.path / "perf" / "test_fake.py").write_text(GATED_TESTS.replace("{failure}", "pass"))
    project.run("perf", "--perf-profile=cpu", "--perf-group=g1", "-p", "no:cacheprovider",
                "--benchmark-json=g1.json").assert_outcomes(passed=2)
    store = project.path / "store"
    baseline.write_baseline([project.path / "g1.json"], store)
    compare = ("--perf-profile=cpu", "-p", "no:cacheprovider", f"--benchmark-storage=file://{store}",
               "--benchmark-compare=0001", "--benchmark-compare-fail=median:1000%")
    same = project.run("perf", "--perf-group=g1", *compare)
    assert same.ret == 0, same.stdout.str()[-2000:]
    other = project.run("perf", "--perf-group=g2", *compare)
    other.assert_outcomes(passed=1)
    assert other.ret == 1
    assert "the baseline does not cover group(s) g2 (1 case(s)); it covers g1" in other.stdout.str()


@pytest.mark.slow  # four isolated perf sessions (~9 s)
def test_baseline_refresh_runs_each_group_spec_then_merges_or_stops_at_a_failing_one(project):
    assert Path.cwd() == project.path  # pytester runs each test from its folder: the CLI's relative paths
    (project.path / "benchmarks.json").write_text(json.dumps(dict(TWO_GROUPS, gates=[])))
    (project.path / "perf" / "test_fake.py").write_text(GATED_TESTS.replace("{failure}", "pass"))

    def refresh(specs):
        """``python -m cs336_systems.baseline --refresh specs ...`` from the project folder (the current
        directory), the CLI in this process: it exits with `baseline.main`'s status; its pytest runs are
        processes of their own."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = baseline.main(["--refresh", specs, "--profile", "cpu", "--runs", "runs", "--storage", "store",
                                  "--pytest-command", f"{sys.executable} -m pytest -p no:cacheprovider"])
        return subprocess.CompletedProcess(["cs336_systems.baseline"], code, out.getvalue(), err.getvalue())

    done = refresh("g1+g2")  # one session for both groups
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--perf-group=g1,g2 --benchmark-json=runs/g1+g2.json" in done.stdout
    data = json.loads(next((project.path / "store").rglob("0001_baseline.json")).read_text())
    assert data["cs336_groups"] == ["g1", "g2"] and len(data["benchmarks"]) == 3
    failed = refresh("nope")
    assert failed.returncode == 2 and "group nope: pytest exited with status 4; nothing merged" in failed.stderr


def test_collect_only_reports_no_gate_as_not_measured(project):
    """--collect-only, the way to check an edit of benchmarks.json, measures nothing: its gates are not
    "not measured" failures."""
    data = dict(TINY_MATRIX, gates=[{"name": "longer is not slower", "suite": "end_to_end",
                                     "numerator": {"context": 16}, "denominator": {"context": 8},
                                     "max_ratio": 2.0}])
    (project.path / "benchmarks.json").write_text(json.dumps(data))
    result = project.run("perf", "--perf-profile=cpu", "-k", "test_case", "-p", "no:cacheprovider", "--collect-only")
    assert result.ret == 0, result.stdout.str()
    assert "not measured" not in result.stdout.str()


def test_a_run_json_that_fails_to_write_after_measuring_is_saved_to_a_fallback(project, monkeypatch):
    """A write of --benchmark-json that fails after every case was measured (a full disk) keeps the run in a
    fallback file, and the session says where."""
    import errno

    from pytest_benchmark.session import BenchmarkSession

    def full_disk(self, output_json):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BenchmarkSession, "save_json", full_disk)
    monkeypatch.chdir(project.path)
    target = project.path / "run.json"
    result = project.run("perf", "--perf-profile=cpu", "-k", "test_case", "-p", "no:cacheprovider",
                         f"--benchmark-json={target}")
    err = result.stderr.str()
    assert "run.json was not written; the run is saved in" in err, err
    fallback = Path(err.split("the run is saved in ")[1].split(" instead")[0])
    saved = json.loads(fallback.read_text())
    assert len(saved["benchmarks"]) == 2 and saved["perf_profile"] == "cpu"
    assert not target.exists()


def test_a_run_json_written_outside_the_current_folder_needs_no_fallback(project, monkeypatch, tmp_path):
    """pytest-benchmark hands the option over as a Path, whose ``name`` is only its basename: a run saved in
    another folder is found there, with no fallback file and no warning."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(project.path)
    target = elsewhere / "run.json"
    result = project.run("perf", "--perf-profile=cpu", "-k", "test_case", "-p", "no:cacheprovider",
                         f"--benchmark-json={target}")
    assert json.loads(target.read_text())["benchmarks"]
    assert "was not written" not in result.stderr.str()
    assert not list(project.path.glob("perf-run-unsaved-*.json"))
