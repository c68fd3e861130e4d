"""The switches registry (cs336_systems.switches): every CS336_* name in the tree is registered, values are
validated naming the switch, unknown CS336_FLASH_* variables warn with the closest name, saved runs record
the switches that are set."""

import re
import warnings
from pathlib import Path

import pytest

from cs336_systems import switches
from cs336_systems.bench import machine

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("cs336_systems", "perf", "tests", "docs", ".github", "README.md", "conftest.py", "benchmarks.json")


def test_every_cs336_name_in_the_tree_is_registered():
    names = set()
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix in
                                               (".py", ".md", ".yml", ".yaml", ".json", ".toml")]
        for file in files:
            names |= set(re.findall(r"\bCS336_[A-Z0-9_]*[A-Z0-9]\b", file.read_text(errors="replace")))
    # names that tests make up on purpose to check the unknown-switch warning
    invented = {"CS336_FLASH_FUSED_BWDD", "CS336_FLASH_REPLAYS", "CS336_FLASH_UNKNOWN", "CS336_FLASH_TYPO", "CS336_X"}
    assert names - invented - {"CS336_FLASH"} <= set(switches.REGISTRY), sorted(names - set(switches.REGISTRY))
    assert set(switches.REGISTRY) <= names  # and nothing registered that the tree never names


def test_read_validates_and_names_the_switch(monkeypatch):
    monkeypatch.setenv("CS336_FLASH_TMA", "2")
    with pytest.raises(ValueError, match=r"CS336_FLASH_TMA must be one of 0, 1 \(or unset\), got '2'"):
        switches.read("CS336_FLASH_TMA")
    monkeypatch.setenv("CS336_FLASH_SPLITS", "0")
    with pytest.raises(ValueError, match=r"CS336_FLASH_SPLITS must be a positive integer \(or unset\), got '0'"):
        switches.read("CS336_FLASH_SPLITS")
    monkeypatch.setenv("CS336_FLASH_SPLITS", "4")
    assert switches.read("CS336_FLASH_SPLITS") == "4"
    monkeypatch.delenv("CS336_FLASH_TMA")
    assert switches.read("CS336_FLASH_TMA") == ""
    with pytest.raises(KeyError, match="CS336_FLASH_TYPO is not a registered switch"):
        switches.read("CS336_FLASH_TYPO")


def test_registry_entries_are_checked():
    with pytest.raises(ValueError, match="must start with 'CS336_'"):
        switches.Switch("FLASH_X", ("0",), "", "")
    with pytest.raises(ValueError, match="exactly one of values and pattern"):
        switches.Switch("CS336_X", None, "", "")


def test_unknown_flash_variables_warn_with_the_closest_name(monkeypatch):
    monkeypatch.setattr(switches, "_warned", set())
    env = {"CS336_FLASH_FUSED_BWDD": "0", "CS336_FLASH_REPLAYS": "1", "CS336_FLASH_TMA": "0", "HOME": "/"}
    assert switches.unknown(env) == {"CS336_FLASH_FUSED_BWDD": "CS336_FLASH_FUSED_BWD",
                                     "CS336_FLASH_REPLAYS": "CS336_FLASH_REPLAY"}
    with pytest.warns(UserWarning, match="CS336_FLASH_FUSED_BWDD is set but is not a cs336_systems switch.*"
                                         "did you mean CS336_FLASH_FUSED_BWD"):
        switches.warn_unknown(env)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        switches.warn_unknown(env)  # once per name


def test_saved_runs_record_the_switches_that_are_set(monkeypatch):
    for name in list(switches.REGISTRY):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CS336_FLASH_FUSED_BWD", "0")
    monkeypatch.setenv("CS336_FLASH_UNKNOWN", "1")  # kept, so that a typo shows in the record
    recorded = machine.switches()
    assert recorded["CS336_FLASH_FUSED_BWD"] == "0" and recorded["CS336_FLASH_UNKNOWN"] == "1"


def test_markdown_table_lists_every_switch():
    table = switches.markdown_table()
    assert all(f"`{name}`" in table for name in switches.REGISTRY)
