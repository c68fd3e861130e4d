"""benchmarks.json: the repository's matrix validates; malformed matrices fail naming the problem."""

import copy
import json
from pathlib import Path

import pytest

from cs336_systems import matrix
from cs336_systems.matrix import MatrixError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def data():
    return json.loads((ROOT / "benchmarks.json").read_text())


def test_repository_matrix_is_valid(data):
    m = matrix.parse(data)
    for suite in m.suites:
        assert m.cases(suite, "cpu"), f"{suite} has no cpu cases: CI would measure nothing"


def test_gpu_profile_covers_the_handout_sweep(data):
    cases = matrix.parse(data).cases("end_to_end", "gpu")
    eager = {
        (c["size"], c["context"], c["mode"], c["precision"])
        for c in cases
        if not c["compile"] and c["batch_size"] == 4 and c["warmup"] == 5 and c["rounds"] == 10
    }
    for size in ("small", "medium", "large", "xl", "2.7B"):
        for context in (128, 256, 512, 1024):
            for mode in ("forward", "forward-backward", "train-step"):
                for precision in ("fp32", "bf16"):
                    assert (size, context, mode, precision) in eager
    assert any(c["compile"] and c["size"] == "2.7B" and c["mode"] == "train-step" for c in cases)


def test_cpu_profile_is_small(data):
    cases = matrix.parse(data).cases("end_to_end", "cpu")
    assert {c["size"] for c in cases} == {"tiny"}


def test_cases_are_the_product_without_duplicates():
    grid = {"sizes": ["tiny", "small"], "contexts": [8, 16], "batch_sizes": [1], "modes": ["forward"],
            "precisions": ["fp32"], "compile": [False], "warmup": 1, "rounds": 2}
    data = {"suites": {"end_to_end": {"profiles": {"cpu": [grid, copy.deepcopy(grid)]}}}}
    cases = matrix.parse(data).cases("end_to_end", "cpu")
    assert len(cases) == 4
    assert cases[0] == {"size": "tiny", "context": 8, "batch_size": 1, "mode": "forward", "precision": "fp32",
                        "compile": False, "attention": "sdpa", "warmup": 1, "rounds": 2, "group": "default"}
    assert matrix.parse(data).cases("end_to_end", "gpu") == []


def _grid(data):
    return data["suites"]["end_to_end"]["profiles"]["gpu"][1]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: _grid(d).update(sizez=["small"]), r"profiles\.gpu\[1\]: unknown key 'sizez'"),
        (lambda d: _grid(d).update(sizes=["huge"]), r"gpu\[1\]\.sizes\[0\]: unknown value 'huge'; valid: tiny"),
        (lambda d: _grid(d).update(contexts=[128, 0]), r"gpu\[1\]\.contexts\[1\]: expected a positive integer, got 0"),
        (lambda d: _grid(d).update(contexts=[]), r"gpu\[1\]\.contexts: expected a non-empty list"),
        (lambda d: _grid(d).update(modes=["backward"]), r"modes\[0\]: unknown value 'backward'"),
        (lambda d: _grid(d).update(precisions=["fp8"]), r"precisions\[0\]: unknown value 'fp8'"),
        (lambda d: _grid(d).update(compile=["yes"]), r"compile\[0\]: expected true or false"),
        (lambda d: _grid(d).update(attention=["flashy"]), r"attention\[0\]: unknown value 'flashy'"),
        (lambda d: _grid(d).update(warmup=-1), r"gpu\[1\]\.warmup: expected an integer >= 0"),
        (lambda d: _grid(d).update(rounds=True), r"gpu\[1\]\.rounds: expected a positive integer, got True"),
        (lambda d: _grid(d).pop("rounds"), r"gpu\[1\]: missing required key 'rounds'"),
        (lambda d: d["suites"].update(bogus={"profiles": {}}), r"suites\.bogus: unknown suite 'bogus'"),
        (lambda d: d["suites"]["end_to_end"]["profiles"].update(laptop=[]), r"unknown key 'laptop'; valid: cpu"),
        (lambda d: d.update(extra=1), r"benchmarks\.json: unknown key 'extra'"),
        (lambda d: d.update(gates=[{"name": "g", "suite": "end_to_end", "numerator": {"compile": True},
                                     "denominator": {"compile": False}, "max_ratio": -1}]),
         r"gates\[0\]\.max_ratio: expected a positive number"),
        (lambda d: d.update(gates=[{"name": "g"}]), r"gates\[0\]: missing required key"),
    ],
)
def test_malformed_matrix_errors_name_the_problem(data, mutate, match):
    mutate(data)
    with pytest.raises(MatrixError, match=match):
        matrix.parse(data)


def test_valid_gate_is_accepted(data):
    data["gates"] = [{"name": "compile pays", "suite": "end_to_end", "numerator": {"compile": True},
                      "denominator": {"compile": False}, "max_ratio": 1.0}]
    assert matrix.parse(data).gates[0]["max_ratio"] == 1.0


def test_load_reports_invalid_json(tmp_path):
    path = tmp_path / "benchmarks.json"
    path.write_text("{ not json")
    with pytest.raises(MatrixError, match="invalid JSON"):
        matrix.load(path)


def test_unknown_suite_or_profile_in_cases(data):
    m = matrix.parse(data)
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        m.cases("nope", "cpu")
    with pytest.raises(ValueError, match="unknown profile 'laptop'"):
        m.cases("end_to_end", "laptop")
