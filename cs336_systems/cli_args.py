"""argparse helpers shared by the project's command-line tools."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum``: bad values end in argparse's usage error (exit 2),
    before any work starts, instead of a traceback after a model has been built."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def non_negative_float(text: str) -> float:
    """An argparse ``type`` for finite numbers >= 0."""
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type`` for positive finite numbers."""
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at ``path`` (None if it can), checked before a long run, not after it.

    Opens it for appending (creating it, then removing what this check created), so permissions, missing
    folders and pseudo-filesystems all show up now.
    """
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory"
    existed = os.path.lexists(path)  # a dangling symlink exists: never remove it
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    if not existed:
        path.unlink()
    return None
