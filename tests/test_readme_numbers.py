"""Every measured number in the README's prose comes from a committed run at a clean commit.

The prose outside code blocks and outside the generated Results block (which `readme_block` builds from
runs) is scanned for numbers with a unit (×, %, ms, µs, GiB, MiB, TFLOP/s).  Each must be a claim below,
recomputed here from the run the prose cites, or a setting (a gate's threshold, an option's example value)
named with where it comes from.  A number that is neither fails: a new figure in the README needs its run
and its claim here."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from cs336_systems.bench import matrix

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NUMBER = re.compile(r"(?<![\w.×])(\d+(?:\.\d+)?)\s?(×|%|ms\b|µs\b|GiB\b|MiB\b|TFLOP/s)(?!H\d)")


def prose(text: str) -> str:
    """The README without fenced code blocks and without the generated Results block."""
    start, end = text.index("<!-- results:start -->"), text.index("<!-- results:end -->")
    return re.sub(r"```.*?```", "", text[:start] + text[end:], flags=re.DOTALL)


def run(path: str) -> dict:
    data = json.loads((ROOT / path).read_text())
    info = data.get("commit_info") or {}
    assert info.get("id") and not info.get("dirty"), f"{path}: not saved at a clean commit"
    return data


def _median(data: dict, **fields) -> float:
    found = [b["stats"]["median"] for b in data["benchmarks"]
             if all(b["extra_info"].get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, len(found))
    return found[0]


def leaderboard_ratio(path: str, head_dim: int, other: str) -> float:
    """Compiled flash-triton's forward+backward over ``other``'s, device time, at the leaderboard shape."""
    data = run(path)
    common = dict(mode="forward-backward", head_dim=head_dim, timing="device")
    return (_median(data, impl="flash-triton", compile=True, **common)
            / _median(data, impl=other, compile=False, **common))


def model_spread(path: str) -> float:
    """The largest |flash-triton / sdpa - 1| over the model cells of an end-to-end run, in percent."""
    pairs: dict[tuple, dict[str, float]] = {}
    for b in run(path)["benchmarks"]:
        e = b["extra_info"]
        key = (e["size"], e["mode"], e["compile"], e["cuda_graphs"], e["precision"], e["context"])
        pairs.setdefault(key, {})[e["attention"]] = b["stats"]["median"]
    ratios = [v["flash-triton"] / v["sdpa"] for v in pairs.values() if {"flash-triton", "sdpa"} <= set(v)]
    assert ratios
    return 100 * max(abs(r - 1) for r in ratios)


def sweep_ratio(path: str, **fields) -> float:
    """flash-triton's forward+backward over sdpa-cudnn's, graph time, at one shape of a flash sweep."""
    data = run(path)
    common = dict(mode="forward-backward", timing="graph", **fields)
    return _median(data, impl="flash-triton", **common) / _median(data, impl="sdpa-cudnn", **common)


H100, H200 = "results/h100/leaderboard.json", "results/h200/leaderboard.json"
DIMS_H200, GQA_H200 = "results/h200/flash-bf16-head-dims-8192.json", "results/h200/flash-bf16-gqa.json"
E2E_H200 = "results/h200/e2e-flash-attention.json"
# (the number as written, its value recomputed, how the prose rounds it: "round" to the written digits, or
# "ceil" for a bound such as "within 1.7%"; the run the prose cites)
CLAIMS = [
    ("1.08×", lambda: leaderboard_ratio(H100, 64, "sdpa-cudnn"), "round", H100),
    ("1.01×", lambda: leaderboard_ratio(H100, 128, "sdpa-cudnn"), "round", H100),
    ("0.71×", lambda: leaderboard_ratio(H100, 64, "sdpa-flash"), "round", H100),
    ("0.58×", lambda: leaderboard_ratio(H100, 128, "sdpa-flash"), "round", H100),
    ("1.010×", lambda: leaderboard_ratio(H200, 64, "sdpa-cudnn"), "round", H200),
    ("1.008×", lambda: leaderboard_ratio(H200, 128, "sdpa-cudnn"), "round", H200),
    ("1.7%", lambda: model_spread(E2E_H200), "ceil", E2E_H200),
    ("0.951×", lambda: sweep_ratio(DIMS_H200, head_dim=80), "round", DIMS_H200),
    ("0.997×", lambda: sweep_ratio(DIMS_H200, head_dim=96), "round", DIMS_H200),
    ("1.145×", lambda: sweep_ratio(DIMS_H200, head_dim=256), "round", DIMS_H200),
    ("1.004×", lambda: sweep_ratio(GQA_H200, kv_heads=8), "round", GQA_H200),
    ("1.015×", lambda: sweep_ratio(GQA_H200, kv_heads=1), "round", GQA_H200),
]


def _gate_thresholds() -> set[str]:
    return {f"{gate['max_ratio']:.2f}×" for gate in matrix.load().gates}


# Numbers that are settings, not measurements, and where each comes from.
SETTINGS = {
    "10%": "an example value of pytest-benchmark's --benchmark-compare-fail",
}


@pytest.mark.parametrize("written, value, rounding, cited", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_each_claim_matches_its_run_and_the_prose_cites_it(written, value, rounding, cited):
    text = prose(README.read_text())
    digits = len(written.rstrip("×%").split(".")[1]) if "." in written else 0
    computed = value()
    shown = math.ceil(computed * 10 ** digits - 1e-9) / 10 ** digits if rounding == "ceil" else round(computed, digits)
    assert f"{shown:.{digits}f}" == written.rstrip("×%"), f"README says {written}, {cited} gives {computed:.4f}"
    paragraph = next(p for p in text.split("\n\n") if written in p)
    assert cited in paragraph, f"the paragraph with {written} does not cite {cited}"


def test_every_number_in_the_prose_is_a_claim_or_a_setting():
    claimed = {c[0] for c in CLAIMS} | set(SETTINGS) | _gate_thresholds()
    found = {f"{number}{unit}" for number, unit in NUMBER.findall(prose(README.read_text()))}
    assert found - claimed == set(), ("numbers in the README's prose with no committed run behind them (add the "
                                      f"claim to this test, or take them out): {sorted(found - claimed)}")


def test_the_scanner_finds_numbers_and_skips_code_devices_and_the_generated_block():
    text = ("A 1.5× gain and 3 ms.\n```\n9.9× in code\n```\n[2×H200](x) and B·H 4\n"
            "<!-- results:start -->\n7.7% generated\n<!-- results:end -->\nlast 12%")
    assert {f"{n}{u}" for n, u in NUMBER.findall(prose(text))} == {"1.5×", "3ms", "12%"}
