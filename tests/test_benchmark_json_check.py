"""The root conftest's early check of --benchmark-json (a run must not be lost after its last case)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_for_test", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Config:
    def __init__(self, value):
        self.value = value

    def getoption(self, name, default=None):
        assert name == "benchmark_json"
        return self.value


def test_an_already_opened_json_file_passes_and_an_unwritable_path_fails(tmp_path):
    """pytest-benchmark releases that parse --benchmark-json with argparse.FileType hand over an open file
    (which once crashed the check with a TypeError); a path string is checked for writability."""
    check = _root_conftest()._check_benchmark_json
    with open(tmp_path / "run.json", "wb") as opened:
        check(_Config(opened))  # nothing to check: it is open for writing
    check(_Config(str(tmp_path / "new.json")))
    assert not (tmp_path / "new.json").exists()  # the probe leaves no file behind
    check(_Config(None))
    with pytest.raises(pytest.UsageError, match=r"--benchmark-json=.*: cannot write there"):
        check(_Config(str(tmp_path / "missing-dir" / "run.json")))
