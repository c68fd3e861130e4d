"""cli_args: argparse types and the output-path check the CLIs run before their work."""

import argparse
import os

import pytest

from cs336_systems.cli_args import int_at_least, positive_float, unwritable_reason


def test_int_at_least():
    assert int_at_least(0)("0") == 0 and int_at_least(1)("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        int_at_least(1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer, got '1.5'"):
        int_at_least(1)("1.5")


def test_positive_float():
    assert positive_float("989.5") == 989.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive finite"):
            positive_float(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number"):
        positive_float("x")


def test_unwritable_reason_neither_truncates_nor_removes(tmp_path):
    existing = tmp_path / "existing.md"
    existing.write_text("keep me")
    assert unwritable_reason(existing) is None and existing.read_text() == "keep me"  # not truncated
    new = tmp_path / "new.md"
    assert unwritable_reason(new) is None and not new.exists()  # created to check, then removed
    dangling = tmp_path / "link.md"
    os.symlink(tmp_path / "missing-target.md", dangling)
    assert unwritable_reason(dangling) is None
    assert os.path.islink(dangling)  # the link stays (its target was created by the check: harmless)
    assert "is a directory" in unwritable_reason(tmp_path)
    assert "cannot write" in unwritable_reason(tmp_path / "no-such-dir" / "x.md")
