"""In-run ratio gates: pairing, verdicts, validation, the CLI, and failing a perf session.

A gate owes a verdict on every pair the run selected: a pair whose case did not run fails it with the
reason, and a gate with no selected pair is "not applicable", never a pass."""

import copy
import json
import re
from pathlib import Path

import pytest

from cs336_systems.reporting import gates
from cs336_systems.bench import matrix

ROOT = Path(__file__).resolve().parents[2]
FIELDS = matrix.case_fields("leaderboard")


def _entry(impl, mode, median, compile_=False, **extra):
    return {"suite": "leaderboard", "impl": impl, "mode": mode, "compile": compile_, "batch_size": 1,
            "heads": 16, "seq_len": 16384, "head_dim": 64, "dtype": "bf16", "causal": True, "warmup": 5,
            "rounds": 10, "group": "leaderboard", "stats": {"median": median, "mean": median, "min": median},
            **extra}


def _run(entries, selected=None, reasons=None):
    """A run that selected ``selected`` (default: exactly the timed ``entries``)."""
    if selected is None:
        selected = [{k: v for k, v in e.items() if k != "stats"} for e in entries]
    return gates.RunCases(selected, entries, reasons or {})


GATE = {"name": "flash beats FA2", "suite": "leaderboard", "where": {"mode": "forward-backward"},
        "numerator": {"impl": "flash-triton", "compile": True},
        "denominator": {"impl": "sdpa-flash", "compile": False}, "max_ratio": 0.8}


def test_pairs_on_the_unnamed_fields_and_judges_the_ratio():
    entries = [
        _entry("flash-triton", "forward-backward", 5.0, compile_=True),
        _entry("sdpa-flash", "forward-backward", 7.0),
        _entry("flash-triton", "forward", 1.0, compile_=True),  # excluded by "where"
        _entry("sdpa-flash", "forward", 10.0),
    ]
    (check,) = gates.evaluate([GATE], _run(entries), FIELDS)
    assert check.ratio == pytest.approx(5 / 7) and check.ok
    assert "seq_len=16384" in check.case and "mode" not in check.case

    entries[0]["stats"]["median"] = 6.0
    (check,) = gates.evaluate([GATE], _run(entries), FIELDS)
    assert check.ratio == pytest.approx(6 / 7) and not check.ok
    assert "VIOLATED" in gates.table([check])


def test_cases_that_differ_elsewhere_are_not_paired():
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True, seq_len=8192),
               _entry("sdpa-flash", "forward-backward", 7.0)]
    (check,) = gates.evaluate([GATE], _run(entries), FIELDS)
    assert check.ratio is None and not check.applicable and check.ok
    assert "not applicable" in gates.table([check])


def test_ambiguous_denominators_raise_instead_of_taking_the_last():
    """A denominator side that leaves out a field the numerator names (here compile) matches two cases."""
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True),
               _entry("sdpa-flash", "forward-backward", 7.0),
               _entry("sdpa-flash", "forward-backward", 9.0, compile_=True)]
    loose = {**GATE, "denominator": {"impl": "sdpa-flash"}}
    with pytest.raises(ValueError, match=r"gate 'flash beats FA2': several denominator cases .* differ only in "
                                         r"\['compile'\]"):
        gates.evaluate([loose], _run(entries), FIELDS)
    # a bookkeeping field (warm-up) is not compared either: two runs of one case at different warm-ups
    entries[2] = _entry("sdpa-flash", "forward-backward", 9.0, warmup=0)
    with pytest.raises(ValueError, match=r"differ only in \['warmup'\]"):
        gates.evaluate([GATE], _run(entries), FIELDS)
    (check,) = gates.evaluate([GATE], _run(entries[:2]), FIELDS)
    assert check.ratio == pytest.approx(5 / 7)


def test_statistic_is_selectable():
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True), _entry("sdpa-flash", "forward-backward", 7.0)]
    entries[0]["stats"]["min"] = 1.0
    (check,) = gates.evaluate([{**GATE, "statistic": "min"}], _run(entries), FIELDS)
    assert check.ratio == pytest.approx(1 / 7)


def test_a_gate_can_bound_peak_memory_instead_of_time():
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True, peak_memory_gib=3.0),
               _entry("sdpa-flash", "forward-backward", 1.0, peak_memory_gib=4.0)]
    gate = {**GATE, "statistic": "peak_memory_gib", "max_ratio": 1.0}
    (check,) = gates.evaluate([gate], _run(entries), FIELDS)
    assert check.ratio == pytest.approx(0.75) and check.ok  # slower (5 vs 1), but smaller
    entries[0]["peak_memory_gib"] = 4.2
    (check,) = gates.evaluate([gate], _run(entries), FIELDS)
    assert check.ratio == pytest.approx(1.05) and check.verdict == "VIOLATED"
    del entries[1]["peak_memory_gib"]  # a case without the quantity cannot be judged on it: not measured
    (check,) = gates.evaluate([gate], _run(entries), FIELDS)
    assert check.verdict == "NOT MEASURED" and not check.ok
    assert re.fullmatch(r"denominator sdpa-flash\S*: no peak_memory_gib recorded", check.problem), check.problem
    matrix.parse(_matrix_with(gate))
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.statistic: unknown value 'peak_memory'"):
        matrix.parse(_matrix_with({**gate, "statistic": "peak_memory"}))


def _matrix_with(gate):
    data = json.loads((ROOT / "benchmarks.json").read_text())
    data["gates"] = [gate]
    return data


def test_gate_validation_names_unknown_fields():
    matrix.parse(_matrix_with(GATE))
    bad = copy.deepcopy(GATE)
    bad["numerator"]["implementation"] = "x"
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.numerator: unknown case field 'implementation'"):
        matrix.parse(_matrix_with(bad))
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.where: expected a non-empty object"):
        matrix.parse(_matrix_with({**GATE, "where": 3}))


def _saved_run(entries, ooms=(), not_timed=(), profile="gpu", **extra):
    """A saved run as perf/conftest.py writes it (``perf_not_timed``: the run's own record of its selection)."""
    def record(e):
        name = f"test_leaderboard[{e['impl']}-{e['mode']}-{'compiled' if e['compile'] else 'eager'}]"
        return {"name": name, "fullname": f"perf/test_attention.py::{name}",
                "extra_info": {k: v for k, v in e.items() if k != "stats"} | {"status": "ok"}}

    return {"machine_info": {"cs336_systems": {"gpu_name": "NVIDIA H100 80GB HBM3"}}, "perf_profile": profile,
            "benchmarks": [record(e) | {"stats": e["stats"]} for e in entries],
            "oom": [record(e) | {"error": error} for e, error in ooms],
            "perf_not_timed": [record(e) | {"reason": reason} for e, reason in not_timed], **extra}


def _cli(tmp_path, run, matrix_path=ROOT / "benchmarks.json"):
    (tmp_path / "run.json").write_text(json.dumps(run))
    return gates.main([str(tmp_path / "run.json"), "--matrix", str(matrix_path)])


def test_cli_exit_code(tmp_path):
    (tmp_path / "benchmarks.json").write_text(json.dumps(_matrix_with(GATE)))
    run = _saved_run([_entry("flash-triton", "forward-backward", 5.0, compile_=True),
                      _entry("sdpa-flash", "forward-backward", 7.0)])
    (tmp_path / "run.json").write_text(json.dumps(run))
    args = [str(tmp_path / "run.json"), "--matrix", str(tmp_path / "benchmarks.json")]
    assert gates.main(args) == 0
    run["benchmarks"][0]["stats"]["median"] = 6.5
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert gates.main(args) == 1
    twin = copy.deepcopy(run["benchmarks"][1])
    twin["extra_info"]["warmup"] = 0
    run["benchmarks"].append(twin)
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert gates.main(args) == 2  # ambiguous pairing: an error, not a verdict
    run["benchmarks"].pop()
    run["benchmarks"][1]["stats"]["median"] = 0.0
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert gates.main(args) == 2  # no ratio to a zero time


def test_cli_refuses_what_is_not_a_run_of_this_project(tmp_path, capsys):
    """A CI gate fed the wrong file must not pass with every gate "not measured"."""
    matrix_args = ["--matrix", str(ROOT / "benchmarks.json")]
    for name, content in (("empty.json", ""), ("list.json", "[]"), ("object.json", "{}"),
                          ("foreign.json", json.dumps({"benchmarks": [], "machine_info": {"node": "x"}}))):
        (tmp_path / name).write_text(content)
        assert gates.main([str(tmp_path / name), *matrix_args]) == 2, name
    assert gates.main([str(tmp_path / "missing.json"), *matrix_args]) == 2
    assert gates.main([str(tmp_path), *matrix_args]) == 2  # a directory
    assert gates.main([str(tmp_path / "foreign.json"), "--matrix", str(tmp_path / "object.json")]) == 2
    out = capsys.readouterr().out
    assert "not saved by this project's perf suite" in out and "not a pytest-benchmark run" in out
    assert "Traceback" not in out


# --- a gate whose cases did not run fails; a gate the run did not select is not applicable ----------------

def test_a_selected_pair_without_a_time_fails_with_the_reason():
    flash = _entry("flash-triton", "forward-backward", 5.0, compile_=True)
    sdpa = _entry("sdpa-flash", "forward-backward", 7.0)
    selected = [{k: v for k, v in e.items() if k != "stats"} for e in (flash, sdpa)]
    reasons = {gates.case_key(flash): "OOM: CUDA out of memory. Tried to allocate 2.00 GiB"}
    (check,) = gates.evaluate([GATE], gates.RunCases(selected, [sdpa], reasons), FIELDS)
    assert check.applicable and check.ratio is None and not check.ok and check.verdict == "NOT MEASURED"
    assert check.problem.startswith("numerator flash-triton-b1-h16-n16384") and "OOM: CUDA out of memory" in check.problem
    assert "NOT MEASURED: numerator flash-triton" in gates.table([check])
    (check,) = gates.evaluate([GATE], gates.RunCases(selected, [sdpa]), FIELDS)
    assert not check.ok and "not run" in check.problem  # selected, yet neither timed nor skipped: still a failure
    assert gates.summary([check]) == "ratio gates: 1 not measured"


def test_a_gate_of_groups_the_run_did_not_select_is_not_applicable_and_names_them():
    m = matrix.load(ROOT / "benchmarks.json")
    profile_cases = [{**c, "suite": s} for s in m.suites for c in m.cases(s, "gpu")]
    other = {**_entry("naive", "forward", 1.0), "suite": "flash", "group": "flash-bf16-graph"}
    checks = gates.evaluate(m.gates, _run([other]), gates.case_fields_of(m), profile_cases)
    assert [c.verdict for c in checks] == ["not applicable"] * len(m.gates) and all(c.ok for c in checks)
    assert checks[0].case == checks[1].case == "needs group leaderboard, not selected"  # sdpa-flash, cuDNN
    assert checks[2].case == "needs group ddp-bf16 or ddp-fp32, not selected"
    # own (AdamWMaster) vs HF Llama (AdamW): the groups that list both sides are e2e-hf and e2e-fp8 (its bf16 cells)
    assert checks[3].case == "needs group e2e-fp8 or e2e-hf, not selected"
    assert checks[4].case == "needs group e2e-fp8 or e2e-hf, not selected"
    assert gates.summary(checks) == "ratio gates: none applies to this run"


def test_cli_fails_a_gate_whose_case_ran_out_of_memory_or_was_skipped(tmp_path, capsys):
    flash = _entry("flash-triton", "forward-backward", 5.0, compile_=True)
    sdpa = _entry("sdpa-flash", "forward-backward", 7.0)
    assert _cli(tmp_path, _saved_run([sdpa], ooms=[(flash, "CUDA out of memory. Tried to allocate 9 GiB")])) == 1
    out = capsys.readouterr().out
    assert "NOT MEASURED: numerator flash-triton" in out and "OOM: CUDA out of memory" in out
    assert _cli(tmp_path, _saved_run([flash], not_timed=[(sdpa, "skipped: sdpa-flash is not available")])) == 1
    assert "denominator sdpa-flash-b1-h16-n16384-d64-forward-backward-bf16-causal-eager-w5: skipped: sdpa-flash is " \
           "not available" in capsys.readouterr().out


def test_cli_derives_the_selection_of_runs_saved_without_one_from_the_matrix(tmp_path, capsys):
    """A run saved before runs recorded their selection: its profile's cases in the groups it names."""
    m = matrix.load(ROOT / "benchmarks.json")
    board = [{**c, "suite": "leaderboard"} for c in m.cases("leaderboard", "gpu")]
    entries = [{**c, "stats": {"median": 1.0, "mean": 1.0, "min": 1.0}} for c in board]
    run = _saved_run(entries)
    del run["perf_not_timed"]
    assert _cli(tmp_path, run) == 0
    idle = len(m.gates) - 2  # every gate but the leaderboard's two
    # against sdpa-flash: two leaderboard shapes (d 64, d 128) x host and device timing; against cuDNN: the
    # two shapes in device timing
    assert f"ratio gates: all 6 measured pairs hold ({idle} gate(s) not applicable)" in capsys.readouterr().out
    run["benchmarks"] = [b for b in run["benchmarks"]
                         if not (b["extra_info"]["impl"] == "flash-triton" and b["extra_info"]["compile"])]
    assert _cli(tmp_path, run) == 1  # the compiled flash-triton cases are missing from a leaderboard run
    assert "numerator flash-triton-b1-h16-n16384-d64-forward-backward-bf16-causal-compiled-w10-l2flush: not run" \
           in capsys.readouterr().out


def test_cli_on_a_cpu_run_lists_the_gates_as_not_applicable_and_fails_unless_allowed(tmp_path, capsys):
    """A run that no gate applies to checked nothing: exit 1, unless --allow-empty says that is expected."""
    naive = {**_entry("naive", "forward", 1.0), "group": "leaderboard-cpu"}
    run = _saved_run([naive], profile="cpu", perf_groups=["leaderboard-cpu"])
    assert _cli(tmp_path, run) == 1
    out = capsys.readouterr().out
    assert out.count("| not applicable |") == len(matrix.load(ROOT / "benchmarks.json").gates) and "ok |" not in out
    assert "profile cpu, groups leaderboard-cpu" in out and "no gate applies to this run" in out
    assert gates.main([str(tmp_path / "run.json"), "--matrix", str(ROOT / "benchmarks.json"), "--allow-empty"]) == 0


def test_a_gate_comparing_a_case_with_itself_is_refused():
    same = {**GATE, "denominator": dict(GATE["numerator"])}
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]: numerator and denominator name the same cases"):
        matrix.parse(_matrix_with(same))
    moved = {**GATE, "where": {"mode": "forward-backward", "impl": "flash-triton"},
             "numerator": {"compile": True}, "denominator": {"impl": "flash-triton", "compile": True}}
    with pytest.raises(matrix.MatrixError, match="the same cases"):
        matrix.parse(_matrix_with(moved))


def test_cli_refuses_a_run_with_no_benchmarks_or_without_statistics(tmp_path, capsys):
    assert _cli(tmp_path, _saved_run([])) == 2
    assert "no benchmarks; an empty run cannot pass or fail a gate" in capsys.readouterr().out
    run = _saved_run([_entry("sdpa-flash", "forward-backward", 7.0)])
    del run["benchmarks"][0]["stats"]
    assert _cli(tmp_path, run) == 2
    out = capsys.readouterr().out
    assert "has no statistics" in out and "Traceback" not in out
    run = _saved_run([_entry("sdpa-flash", "forward-backward", 7.0)], profile=None)
    assert _cli(tmp_path, run) == 2 and "perf_profile is None" in capsys.readouterr().out


# --- gate values are checked against the suite's grids ----------------------------------------------------

DDP_GATE = {"name": "bucketed near torch DDP", "suite": "data_parallel",
            "numerator": {"variant": "bucketed", "bucket_size_mb": 100},
            "denominator": {"variant": "torch-ddp", "bucket_size_mb": None}, "max_ratio": 1.1}


@pytest.mark.parametrize("side, field, value, match", [
    ("numerator", "variant", "buckted",
     r"gates\[0\]\.numerator\.variant: unknown value 'buckted'; valid: none, .* \(gate 'bucketed near torch DDP'\)"),
    ("numerator", "bucket_size_mb", "0.05",
     r"gates\[0\]\.numerator\.bucket_size_mb: expected a positive number, got '0\.05' \(gate 'bucketed near"),
    ("numerator", "bucket_size_mb", 200,
     r"gates\[0\]\.numerator\.bucket_size_mb: value 200 occurs in no grid of suite 'data_parallel' \(values "
     r"there: null, 0\.05, 1, 10, 25, 100, 1000\); the gate would match no case"),
    ("denominator", "precision", "fp23", r"gates\[0\]\.denominator\.precision: unknown value 'fp23'"),
    ("denominator", "world_size", True, r"gates\[0\]\.denominator\.world_size: expected a positive integer, got True"),
    ("where", "backend", "mpi", r"gates\[0\]\.where\.backend: unknown value 'mpi'"),
    ("where", "context", 4096, r"gates\[0\]\.where\.context: value 4096 occurs in no grid"),
])
def test_gate_values_are_validated_against_the_grids(side, field, value, match):
    matrix.parse(_matrix_with(DDP_GATE))
    bad = copy.deepcopy(DDP_GATE)
    bad.setdefault(side, {})[field] = value
    with pytest.raises(matrix.MatrixError, match=match):
        matrix.parse(_matrix_with(bad))


@pytest.mark.parametrize("ratio", [float("nan"), float("inf"), 0, -1.0, True, "1.1"])
def test_max_ratio_must_be_finite_and_positive(ratio):
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.max_ratio: expected a finite positive number"):
        matrix.parse(_matrix_with({**DDP_GATE, "max_ratio": ratio}))


def test_a_float_gate_value_matches_an_integer_grid_value():
    """Pairing compares with ==, so 100.0 selects the cases of bucket size 100; validation agrees."""
    matrix.parse(_matrix_with({**DDP_GATE, "numerator": {"variant": "bucketed", "bucket_size_mb": 100.0}}))


# --- our LM against the hf-llama baseline: eager with eager, compiled with compiled, in one run -------------

def _e2e_gates_and_cases(statistic="median"):
    m = matrix.load(ROOT / "benchmarks.json")
    e2e = [g for g in m.gates if g["suite"] == "end_to_end" and g.get("statistic", "median") == statistic]
    cases = [{**c, "suite": "end_to_end"} for c in m.cases("end_to_end", "gpu", {"e2e-hf"})]
    return m, e2e, cases


def test_own_vs_hf_gates_judge_each_size_eager_and_compiled_against_the_same_mode_of_hf():
    m, e2e, cases = _e2e_gates_and_cases()
    assert {g["where"]["size"] for g in e2e} == {"xl", "2.7B"} and all(g["max_ratio"] == 0.90 for g in e2e)
    own_ms = {("xl", False): 85.0, ("xl", True): 95.0, ("2.7B", False): 91.0, ("2.7B", True): 80.0}

    def timed(case):
        ms = 100.0 if case["impl"] == "hf-llama" else own_ms.get((case["size"], case["compile"]), 50.0)  # small: no gate
        return {**case, "stats": {"median": ms / 1e3, "mean": ms / 1e3, "min": ms / 1e3}}

    checks = gates.evaluate(e2e, gates.RunCases(cases, [timed(c) for c in cases]), gates.case_fields_of(m))
    assert len(checks) == 4
    got = {(c.gate.split(" at ")[1].split(",")[0], "compile=True" in c.case): (round(c.ratio, 6), c.verdict)
           for c in checks}
    assert got == {("xl", False): (0.85, "ok"), ("xl", True): (0.95, "VIOLATED"),
                   ("2.7B", False): (0.91, "VIOLATED"), ("2.7B", True): (0.8, "ok")}
    assert all("context=512" in c.case and "mode" not in c.case for c in checks)  # forward cases are not judged


def test_own_vs_hf_memory_gates_judge_each_size_and_mode_on_peak_memory():
    m, e2e, cases = _e2e_gates_and_cases("peak_memory_gib")
    assert {g["where"]["size"] for g in e2e} == {"xl", "2.7B"} and all(g["max_ratio"] == 1.0 for g in e2e)

    def timed(case):
        gib = 51.39 if case["impl"] == "hf-llama" else (51.40 if case["size"] == "2.7B" and case["compile"] else 45.0)
        return {**case, "stats": {"median": 0.1, "mean": 0.1, "min": 0.1}, "peak_memory_gib": gib}

    checks = gates.evaluate(e2e, gates.RunCases(cases, [timed(c) for c in cases]), gates.case_fields_of(m))
    verdicts = sorted((c.gate.split(" at ")[1].split(",")[0], "compile=True" in c.case, c.verdict) for c in checks)
    assert verdicts == [("2.7B", False, "ok"), ("2.7B", True, "VIOLATED"), ("xl", False, "ok"), ("xl", True, "ok")]


def test_a_baseline_skipped_for_want_of_transformers_fails_its_gate_with_the_reason():
    m, e2e, cases = _e2e_gates_and_cases()
    own = [{**c, "stats": {"median": 0.08, "mean": 0.08, "min": 0.08}} for c in cases if c["impl"] == "own"]
    reason = "skipped: transformers not installed: pip install -e .[baselines]"
    reasons = {gates.case_key(c): reason for c in cases if c["impl"] == "hf-llama"}
    checks = gates.evaluate(e2e, gates.RunCases(cases, own, reasons), gates.case_fields_of(m))
    assert len(checks) == 4 and all(c.verdict == "NOT MEASURED" and not c.ok for c in checks)
    assert all(c.problem.startswith("denominator hf-llama-") and c.problem.endswith(reason) for c in checks)


def test_e2e_gate_values_are_checked_against_the_end_to_end_grids():
    _, e2e, _ = _e2e_gates_and_cases()
    bad = copy.deepcopy(e2e[0])
    bad["denominator"]["impl"] = "hf-lama"
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.denominator\.impl: unknown value 'hf-lama'; valid: "
                                                 r"own, hf-llama"):
        matrix.parse(_matrix_with(bad))
    bad = copy.deepcopy(e2e[0])
    bad["where"]["size"] = "tiny"  # a size the end-to-end grids have, so it validates...
    matrix.parse(_matrix_with(bad))
    bad["where"]["size"] = "7B"  # ...and one they do not
    with pytest.raises(matrix.MatrixError, match=r"gates\[0\]\.where\.size: unknown value '7B'"):
        matrix.parse(_matrix_with(bad))
