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


class _StorageConfig:
    def __init__(self, storage, autosave=True, save=None):
        self.options = {"benchmark_storage": storage, "benchmark_autosave": autosave, "benchmark_save": save}

    def getoption(self, name, default=None):
        return self.options.get(name, default)


def test_autosave_storage_is_checked_before_any_case(tmp_path):
    """--benchmark-autosave / --benchmark-save to a storage path that is a file (or cannot be made) is a usage
    error at once, not a NotADirectoryError after every case was measured."""
    check = _root_conftest()._check_benchmark_storage
    a_file = tmp_path / "baselines"
    a_file.write_text("not a folder")
    with pytest.raises(pytest.UsageError, match=r"--benchmark-storage=file://.*: cannot save runs there"):
        check(_StorageConfig(f"file://{a_file}"))
    with pytest.raises(pytest.UsageError, match="cannot save runs there"):
        check(_StorageConfig(f"file://{a_file}/under", autosave=False, save="name"))
    check(_StorageConfig(f"file://{a_file}", autosave=False))  # nothing saved: nothing to check
    fresh = tmp_path / "new" / "storage"
    check(_StorageConfig(f"file://{fresh}"))
    assert fresh.is_dir() and not list(fresh.iterdir())  # made, and the probe leaves nothing behind
    check(_StorageConfig("elasticsearch+http://host:9200/index/doctype"))  # not a file storage: not ours
