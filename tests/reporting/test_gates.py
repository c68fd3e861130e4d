"""In-run ratio gates: pairing, verdicts, validation, the CLI, and failing a perf session."""

import copy
import json
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
    (check,) = gates.evaluate([GATE], entries, FIELDS)
    assert check.ratio == pytest.approx(5 / 7) and check.ok
    assert "seq_len=16384" in check.case and "mode" not in check.case

    entries[0]["stats"]["median"] = 6.0
    (check,) = gates.evaluate([GATE], entries, FIELDS)
    assert check.ratio == pytest.approx(6 / 7) and not check.ok
    assert "VIOLATED" in gates.table([check])


def test_cases_that_differ_elsewhere_are_not_paired():
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True, seq_len=8192),
               _entry("sdpa-flash", "forward-backward", 7.0)]
    (check,) = gates.evaluate([GATE], entries, FIELDS)
    assert check.ratio is None and check.ok and "not measured" in gates.table([check])


def test_ambiguous_denominators_raise_instead_of_taking_the_last():
    """A denominator side that leaves out a field the numerator names (here compile) matches two cases."""
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True),
               _entry("sdpa-flash", "forward-backward", 7.0),
               _entry("sdpa-flash", "forward-backward", 9.0, compile_=True)]
    loose = {**GATE, "denominator": {"impl": "sdpa-flash"}}
    with pytest.raises(ValueError, match=r"gate 'flash beats FA2': several denominator cases .* differ only in "
                                         r"\['compile'\]"):
        gates.evaluate([loose], entries, FIELDS)
    # a bookkeeping field (warm-up) is not compared either: two runs of one case at different warm-ups
    entries[2] = _entry("sdpa-flash", "forward-backward", 9.0, warmup=0)
    with pytest.raises(ValueError, match=r"differ only in \['warmup'\]"):
        gates.evaluate([GATE], entries, FIELDS)
    (check,) = gates.evaluate([GATE], entries[:2], FIELDS)
    assert check.ratio == pytest.approx(5 / 7)


def test_statistic_is_selectable():
    entries = [_entry("flash-triton", "forward-backward", 5.0, compile_=True), _entry("sdpa-flash", "forward-backward", 7.0)]
    entries[0]["stats"]["min"] = 1.0
    (check,) = gates.evaluate([{**GATE, "statistic": "min"}], entries, FIELDS)
    assert check.ratio == pytest.approx(1 / 7)


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


def test_cli_exit_code(tmp_path):
    (tmp_path / "benchmarks.json").write_text(json.dumps(_matrix_with(GATE)))
    run = {"machine_info": {"cs336_systems": {"gpu_name": "NVIDIA H100 80GB HBM3"}}, "benchmarks": [
        {"name": "a", "extra_info": {k: v for k, v in e.items() if k != "stats"} | {"status": "ok"},
         "stats": e["stats"]}
        for e in (_entry("flash-triton", "forward-backward", 5.0, compile_=True),
                  _entry("sdpa-flash", "forward-backward", 7.0))
    ]}
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
