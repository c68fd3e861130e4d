"""Whether a benchmark case got slower between two runs, decided from their per-round samples.

    decide(old, new, settings) -> Verdict
    old, new: the case's per-round times (seconds) in the baseline and in this run (MIN_ROUNDS or more each)

One percentage against one earlier median cries wolf on noisy cells and misses small slowdowns on stable
ones.  The decision here asks two questions of the rounds, as airspeed velocity does with its Mann-Whitney
test, and adds an interval so that "no change" is a finding too:

    ratio      median(new) / median(old)
    interval   a bootstrap confidence interval of that ratio (`scipy.stats.bootstrap`, percentile method,
               each run's rounds resampled on their own; a fixed seed, so a verdict is reproducible)
    p_slower   the one-sided Mann-Whitney U p-value that a round of the new run tends to be slower than a
               round of the old one (`scipy.stats.mannwhitneyu`); p_faster the other side

    effect        max(min_effect, min_abs_effect_s / median(old)): the relative change that counts here
    regressed     p_slower < alpha and ratio > 1 + effect
    improved      p_faster < alpha and ratio < 1 - effect
    unchanged     the whole interval inside [1 - effect, 1 + effect]
    inconclusive  anything else: too few or too noisy rounds to tell a change of effect from none

``min_effect``, ``min_abs_effect_s`` and ``alpha`` are per perf group (benchmarks.json "regression";
`bench.matrix.GateSettings`): the smallest change worth failing a merge on, above the group's run-to-run
spread (relative, and in seconds for calls so short that their medians move by a fixed amount between
runs), and the significance level.  The test assumes each run's rounds are exchangeable draws; a shift that moves every round of a
run (another host, clocks, a neighbour on the machine) is not noise to it, which is what ``min_effect``
absorbs (docs/regression-gating.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cs336_systems.bench.matrix import GateSettings

VERDICTS = ("regressed", "improved", "unchanged", "inconclusive")
# fewer rounds than this on either side: inconclusive.  The smallest p-value a one-sided Mann-Whitney test
# reaches with n rounds a side is 1 / C(2n, n): 0.004 at 5, 0.0011 at 6, so below 6 it could never pass
# the default alpha (0.002)
MIN_ROUNDS = 6
CONFIDENCE = 0.95  # of the ratio's interval
RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class Verdict:
    """One case's decision.  ``ratio``, ``low``, ``high``: the median ratio new / old and its interval (nan
    when a side has no rounds); ``note`` says why a case is inconclusive when it is not the noise."""

    case: str
    group: str
    verdict: str
    ratio: float
    low: float
    high: float
    p_slower: float
    p_faster: float
    n_old: int
    n_new: int
    settings: GateSettings
    note: str = ""


def _samples(values: Iterable[float], what: str) -> np.ndarray:
    array = np.asarray(list(values), dtype=float)
    if array.ndim != 1 or not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{what}: expected per-round times, finite and >= 0; got {list(values)[:5]!r}...")
    return array


def decide(old: Sequence[float], new: Sequence[float], settings: GateSettings, case: str = "",
           group: str = "") -> Verdict:
    """The verdict on one case from its baseline rounds ``old`` and this run's rounds ``new`` (module
    docstring)."""
    from scipy import stats  # scipy is the dev extra's (the perf suite's); the rest of this package needs none

    a, b = _samples(old, f"{case or 'case'}: baseline rounds"), _samples(new, f"{case or 'case'}: new rounds")
    nan = math.nan
    if len(a) < MIN_ROUNDS or len(b) < MIN_ROUNDS:
        ratio = float(np.median(b) / np.median(a)) if len(a) and len(b) and np.median(a) > 0 else nan
        return Verdict(case, group, "inconclusive", ratio, nan, nan, nan, nan, len(a), len(b), settings,
                       f"fewer than {MIN_ROUNDS} rounds on a side")
    if np.median(a) <= 0:
        return Verdict(case, group, "inconclusive", nan, nan, nan, nan, nan, len(a), len(b), settings,
                       "the baseline's median is 0")
    ratio = float(np.median(b) / np.median(a))
    p_slower = float(stats.mannwhitneyu(b, a, alternative="greater").pvalue)
    p_faster = float(stats.mannwhitneyu(b, a, alternative="less").pvalue)

    def median_ratio(new_rounds, old_rounds, axis=-1):
        return np.median(new_rounds, axis=axis) / np.maximum(np.median(old_rounds, axis=axis), 1e-300)

    if np.all(a == a[0]) and np.all(b == b[0]):  # no spread on either side: the interval is the point
        low = high = ratio
    else:
        interval = stats.bootstrap((b, a), median_ratio, paired=False, vectorized=True, n_resamples=RESAMPLES,
                                   confidence_level=CONFIDENCE, method="percentile",
                                   random_state=np.random.default_rng(SEED)).confidence_interval
        low, high = float(interval.low), float(interval.high)
    effect = settings.threshold(float(np.median(a)))
    if p_slower < settings.alpha and ratio > 1 + effect:
        verdict = "regressed"
    elif p_faster < settings.alpha and ratio < 1 - effect:
        verdict = "improved"
    elif 1 - effect <= low and high <= 1 + effect:
        verdict = "unchanged"
    else:
        verdict = "inconclusive"
    return Verdict(case, group, verdict, ratio, low, high, p_slower, p_faster, len(a), len(b), settings)


def compare(baseline: Mapping[str, Sequence[float]], run: Mapping[str, Sequence[float]],
            fields: Mapping[str, Mapping], settings_for: Callable[[str, Mapping], GateSettings]) -> list[Verdict]:
    """A verdict for every case of ``run`` (name -> rounds) that ``baseline`` has, in ``run``'s order;
    ``fields``: case -> its extra_info (its perf group under "group"), whose settings ``settings_for(group,
    fields)`` gives (`bench.matrix.Matrix.gate_settings`: the group's, or a per-case override's)."""
    verdicts = []
    for case, new in run.items():
        if case in baseline:
            info = fields.get(case, {})
            group = info.get("group") or ""
            verdicts.append(decide(baseline[case], new, settings_for(group, info), case, group))
    return verdicts


def failures(verdicts: Iterable[Verdict], strict: bool = False) -> list[Verdict]:
    """The verdicts that fail a gate: regressions, and with ``strict`` the inconclusive ones too."""
    bad = ("regressed", "inconclusive") if strict else ("regressed",)
    return [v for v in verdicts if v.verdict in bad]


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def table(verdicts: Sequence[Verdict]) -> str:
    """Markdown: one row per case, regressions first, then inconclusive, improved and unchanged."""
    order = {"regressed": 0, "inconclusive": 1, "improved": 2, "unchanged": 3}
    rows = ["| case | verdict | new / old (median) | 95% interval | p (slower) | p (faster) | rounds old / new | "
            "min effect, alpha |", "|---|---|---|---|---|---|---|---|"]
    for v in sorted(verdicts, key=lambda v: order[v.verdict]):
        verdict = f"**{v.verdict}**" if v.verdict == "regressed" else v.verdict
        if v.note:
            verdict += f" ({v.note})"
        rows.append(f"| {v.case} | {verdict} | {_fmt(v.ratio, '.3f')} | {_fmt(v.low, '.3f')}-{_fmt(v.high, '.3f')} | "
                    f"{_fmt(v.p_slower, '.2g')} | {_fmt(v.p_faster, '.2g')} | {v.n_old} / {v.n_new} | "
                    f"{v.settings.label()} |")
    return "\n".join(rows)


def summary(verdicts: Sequence[Verdict]) -> str:
    """One line: how many cases got each verdict."""
    counts = {name: sum(v.verdict == name for v in verdicts) for name in VERDICTS}
    return f"{len(verdicts)} case(s) compared: " + ", ".join(f"{counts[name]} {name}" for name in VERDICTS)


def rounded(values: Iterable[float], digits: int = 4) -> list[float]:
    """Per-round times kept to ``digits`` significant digits (0.01% at 4, far below any effect a gate
    decides on): what a baseline stores, so its samples fit the results' size budget."""
    return [float(f"{float(x):.{digits}g}") for x in values]
