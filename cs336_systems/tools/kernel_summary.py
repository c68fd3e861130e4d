"""Per-phase kernel summaries from `torch.profiler` (the ranges come from `cs336_systems.nvtx.nvtx_range`).

`summarize_events(prof.events(), device=...)` turns a profile into a `KernelSummary`: for each named
range ("forward", "backward", "optimizer", "step", the attention sub-steps...) the time of the work done
inside it, per kernel and per category.  What an *item* of work is depends on ``device``:

  "cuda"  a GPU activity (kernel, memcpy, memset); its time is its duration on the GPU timeline.
  "cpu"   a CPU op (aten::mm, autograd nodes...); its time is its *self* CPU time (children excluded),
          so nested ops are not counted twice.  This is what the CPU-only tests exercise.

Attribution of an item to a range (the same code for both devices): an item belongs to every range that
contains its *CPU timestamp*, whatever the thread:

  cpu   the op's start time;
  cuda  the kernel's launch time: the CUDA runtime call (cudaLaunchKernel, ...) that shares the
        kernel's CUPTI correlation id (FunctionEvent.id).  If that call is missing from the trace, the
        start of the op that launched it (the kernel's ``linked_correlation_id``) stands in.  Kernels
        with neither are counted as "unattributed".

Launch time rather than GPU execution time, because kernels run asynchronously: a kernel launched at the
end of "forward" may execute while the CPU is already inside "backward".  And CPU ranges rather than the
"gpu_user_annotation" projections kineto puts on the GPU timeline, because the backward pass launches its
kernels from autograd's device thread, where the "backward" range (pushed on the main thread) is not open,
so the GPU projection of "backward" misses them; the main thread is blocked inside "backward" while
they launch, so time containment catches them.  Ranges with the same name that overlap (nested) are merged.

Categories (`categorize`), tested on kernel names from H100 traces; first match wins:

  softmax      "softmax" in the name (cunn_SoftMaxForward/Backward, softmax_warp_*, aten::_softmax,
               log-softmax of the loss included)
  matmul       GEMM libraries and fused attention: gemm, xmma, cutlass, cublas, nvjet (Hopper cuBLASLt),
               wgmma, s16816/s1688 (Ampere tensor-core GEMMs), matmul, flash, fmha, sdpa, attn, Triton
               templates (triton_tem_*); aten ops mm, bmm, addmm, baddbmm, matmul, linear, scaled-dot-
               product attention.  Fused attention kernels count here because their time is the two
               tensor-core GEMMs they contain.
  reduction    reduce_kernel, *norm* kernels (RMSNorm, LayerNorm), nll_loss, Triton reductions
               (triton_red_*, triton_per_*); aten ops sum, mean, norm, rms_norm, amax, nll_loss, ...
  elementwise  vectorized/unrolled elementwise kernels, multi_tensor_apply (fused AdamW), copies,
               Triton pointwise (triton_poi_*); aten ops add, mul, div, exp, silu, copy_, fill_, lerp_,
               addcmul_, cat, ..., their _backward, and _foreach_* / _fused_adam*
  other        everything else: Memcpy/Memset, embedding gathers, views, autograd bookkeeping.

Only the name before the template arguments is matched for C++ kernels ("void at::native::reduce_kernel
<512, 1, ReduceOp<... sum_functor ...>>" is a reduction however its functors are named).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from types import SimpleNamespace

import torch

PHASES = ("forward", "backward", "optimizer")
STEP_RANGE = "step"  # one whole profiled step
MEASURED_RANGE = "measured"  # all profiled steps, after warm-up: the nsys capture range
WARMUP_RANGE = "warmup"
ATTENTION_SUBSTEPS = ("attention scores", "softmax", "final matmul")  # naive attention's ranges
CATEGORIES = ("matmul", "softmax", "elementwise", "reduction", "other")
DEVICES = ("cuda", "cpu")


# ---- categories ------------------------------------------------------------------------------
_KERNEL_RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # (category, substrings of the lower-cased head, prefixes of it)
    ("softmax", ("softmax",), ()),
    (
        "matmul",
        ("gemm", "xmma", "cutlass", "cublas", "nvjet", "wgmma", "s16816", "s1688", "matmul", "flash",
         "fmha", "sdpa", "attn"),
        ("triton_tem_",),
    ),
    ("reduction", ("reduce", "norm", "nll_loss", "moments"), ("triton_red_", "triton_per_")),
    ("elementwise", ("elementwise", "multi_tensor_apply", "copy", "fill"), ("triton_poi_",)),
)
_ATEN_MATMUL = frozenset(
    "mm bmm addmm baddbmm addbmm matmul linear mv addmv dot vdot einsum scaled_mm".split()
)
_ATEN_REDUCTION = frozenset(
    "sum mean norm amax amin max min argmax argmin var std var_mean std_mean prod logsumexp cumsum "
    "linalg_vector_norm cross_entropy_loss any all".split()
)
_ATEN_ELEMENTWISE = frozenset(
    "add sub rsub mul div neg exp log log1p sqrt rsqrt pow silu sigmoid tanh gelu relu threshold where "
    "masked_fill copy to_copy fill zero clone lerp addcmul addcdiv maximum minimum clamp clamp_min "
    "clamp_max abs sign reciprocal cat stack contiguous cos sin square erf mish softplus".split()
)


def _aten_category(op: str) -> str:
    """Category of an aten op name without the ``aten::`` prefix (e.g. "_softmax", "mul_")."""
    base = op.strip("_")
    if "softmax" in base:
        return "softmax"
    if base in _ATEN_MATMUL or "scaled_dot_product" in base or "attention" in base:
        return "matmul"
    if base.startswith(("foreach_", "fused_adam", "fused_sgd")):
        return "elementwise"  # multi-tensor optimizer arithmetic
    stem = base.removesuffix("_backward").strip("_")
    if stem in _ATEN_REDUCTION or "norm" in stem or "nll_loss" in stem:
        return "reduction"
    if stem in _ATEN_ELEMENTWISE:
        return "elementwise"
    return "other"


def _split(name: str) -> tuple[str, str]:
    """(head, rest): the name before its template/argument list, without "void " and anonymous
    namespaces, and what follows it."""
    text = name.strip().removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (text.find("<"), text.find("(")) if i >= 0), default=len(text))
    return text[:cut].rstrip(), text[cut:]


def categorize(name: str) -> str:
    """One of CATEGORIES for a GPU kernel name or a CPU op name (rules in the module docstring)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return _categorize(name)


@functools.lru_cache(maxsize=4096)  # a profile repeats a few hundred names many thousand times
def _categorize(name: str) -> str:
    if name.startswith("aten::"):
        return _aten_category(name.removeprefix("aten::"))
    head = _split(name)[0].lower()
    for category, substrings, prefixes in _KERNEL_RULES:
        if any(s in head for s in substrings) or head.startswith(prefixes):
            return category
    return "other"


_GENERIC_FUNCTORS = frozenset({"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "UnaryFunctor"})
_HINT = re.compile(r"[A-Za-z_]\w*(?:Functor|functor|Epilogue|Ops|_kernel|_kernel_cuda)\b")


def short_name(name: str, width: int = 64) -> str:
    """A readable name for tables: namespaces dropped, template arguments reduced to the most telling
    functor/kernel identifier ("vectorized_elementwise_kernel<MulFunctor>"), cut to ``width`` chars."""
    head, rest = _split(name)
    head = head.removeprefix("at::native::")
    hints = [h for h in _HINT.findall(rest) if h not in _GENERIC_FUNCTORS]
    text = f"{head}<{hints[0]}>" if hints else (head or name)
    return text if len(text) <= width else text[: width - 1] + "…"


# ---- attribution -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Item:
    """One unit of work: a GPU activity (cuda) or one op's self time (cpu); times in microseconds."""

    name: str
    start: float  # on the item's own timeline (GPU for kernels, CPU for ops)
    end: float
    time: float  # GPU duration, or self CPU time
    at: float | None  # CPU timestamp that places it in ranges (launch time / op start); None: unknown


def _is_cpu(event) -> bool:
    return str(event.device_type).rsplit(".", 1)[-1] == "CPU"


def _activity(event) -> str:
    return str(getattr(event, "activity_type", "") or "").lower()


def _is_annotation(event) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or "annotation" in _activity(event)


def _items(events: Sequence, device: str) -> list[_Item]:
    """The work items of a profile (see the module docstring for what an item is per device)."""
    if device == "cpu":
        return [
            _Item(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total, e.time_range.start)
            for e in events
            if _is_cpu(e) and not _is_annotation(e) and not getattr(e, "is_async", False)
            and getattr(e, "linked_correlation_id", 0) == 0  # runtime calls (cudaLaunchKernel) are not ops
        ]
    launches: dict[int, float] = {}  # CUPTI correlation id -> CPU time of the runtime call
    op_starts: dict[int, float] = {}  # op correlation id -> CPU start of the op
    for e in events:
        if not _is_cpu(e):
            continue
        if getattr(e, "linked_correlation_id", 0) > 0:
            launches.setdefault(e.id, e.time_range.start)
        elif not _is_annotation(e):
            op_starts.setdefault(e.id, e.time_range.start)
    items = []
    for e in events:
        if _is_cpu(e) or _is_annotation(e) or "sync" in _activity(e):
            continue  # GPU projections of ranges and (optional) sync records are not work
        at = launches.get(e.id)
        if at is None:
            at = op_starts.get(getattr(e, "linked_correlation_id", 0))
        items.append(_Item(e.name, e.time_range.start, e.time_range.end, e.time_range.end - e.time_range.start, at))
    return items


def _ranges(events: Sequence, names: Iterable[str]) -> dict[str, list[tuple[float, float]]]:
    """CPU intervals of the user annotations named ``names`` (any thread), overlapping ones merged."""
    wanted = set(names)
    raw: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if _is_cpu(e) and _is_annotation(e) and e.name in wanted:
            raw[e.name].append((e.time_range.start, e.time_range.end))
    merged: dict[str, list[tuple[float, float]]] = {}
    for name, spans in raw.items():
        out: list[list[float]] = []
        for start, end in sorted(spans):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        merged[name] = [(s, e) for s, e in out]
    return merged


def _occurrence(spans: list[tuple[float, float]], starts: list[float], t: float) -> int | None:
    """Index of the (sorted, disjoint) interval containing t, or None."""
    i = bisect.bisect_right(starts, t) - 1
    return i if i >= 0 and t <= spans[i][1] else None


# ---- summary ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelStat:
    """One kernel (or op) within a range: totals over all occurrences of the range."""

    name: str
    short: str
    category: str
    calls: int
    total_ms: float
    share: float  # of the range's total time


@dataclass(frozen=True)
class RangeSummary:
    """Work attributed to one named range, summed over its ``occurrences`` (e.g. 3 profiled forwards).

    ``total_ms`` sums item times (GPU busy time, or self CPU time); ``span_ms`` is the mean, over the
    occurrences, of last item end - first item start (wall time on the items' timeline, gaps included).
    ``kernels`` lists the ``top_k`` largest by total time; ``distinct_kernels`` counts them all.
    """

    name: str
    occurrences: int
    total_ms: float
    span_ms: float
    calls: int
    distinct_kernels: int
    kernels: list[KernelStat]
    category_ms: dict[str, float]

    @property
    def per_occurrence_ms(self) -> float:
        return self.total_ms / self.occurrences if self.occurrences else 0.0

    @property
    def category_share(self) -> dict[str, float]:
        total = sum(self.category_ms.values())
        return {c: (ms / total if total > 0 else 0.0) for c, ms in self.category_ms.items()}

    def calls_per_occurrence(self, kernel: KernelStat) -> float:
        return kernel.calls / self.occurrences if self.occurrences else 0.0


@dataclass(frozen=True)
class KernelSummary:
    """Per-range kernel summaries of one profile; ``device`` says what the times are (module docstring)."""

    device: str
    ranges: dict[str, RangeSummary]
    unattributed_ms: float = 0.0  # cuda: kernels whose launch could not be found
    outside_ranges_ms: float = 0.0  # items inside no tracked range at all (e.g. profiler start-up)

    @property
    def time_kind(self) -> str:
        return "GPU kernel time" if self.device == "cuda" else "self CPU time of ops"

    def phases(self) -> list[RangeSummary]:
        """The phase ranges present in this profile, in PHASES order."""
        return [self.ranges[p] for p in PHASES if p in self.ranges]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KernelSummary:
        ranges = {
            name: RangeSummary(**{**r, "kernels": [KernelStat(**k) for k in r["kernels"]]})
            for name, r in data["ranges"].items()
        }
        return cls(**{**data, "ranges": ranges})

    def to_markdown(self, *, title: str = "Kernel summary", top_k: int | None = None) -> str:
        """Markdown: per range, a top-kernels table and a category table (times per occurrence)."""
        lines = [f"### {title} ({self.time_kind}, per occurrence of each range)", ""]
        order = [*PHASES, STEP_RANGE, *ATTENTION_SUBSTEPS]
        names = [n for n in order if n in self.ranges] + sorted(set(self.ranges) - set(order))
        if len(self.phases()) == 1 and STEP_RANGE in self.ranges:
            names.remove(STEP_RANGE)  # a one-phase step (forward only) would repeat that phase's tables
        for name in names:
            r = self.ranges[name]
            lines += [
                f"#### {name}: {r.per_occurrence_ms:.3f} ms over {r.calls / max(r.occurrences, 1):.0f} calls "
                f"(span {r.span_ms:.3f} ms; {r.occurrences} occurrences, {r.distinct_kernels} distinct kernels)",
                "",
                "| kernel | category | calls | ms | share |",
                "|---|---|---:|---:|---:|",
            ]
            for k in r.kernels[:top_k]:
                short = k.short.replace("|", "\\|")
                lines.append(
                    f"| `{short}` | {k.category} | {r.calls_per_occurrence(k):.1f} | "
                    f"{k.total_ms / max(r.occurrences, 1):.3f} | {k.share:.1%} |"
                )
            lines += ["", "| category | ms | share |", "|---|---:|---:|"]
            shares = r.category_share
            for c in CATEGORIES:
                lines.append(f"| {c} | {r.category_ms[c] / max(r.occurrences, 1):.3f} | {shares[c]:.1%} |")
            lines.append("")
        if self.unattributed_ms or self.outside_ranges_ms:
            lines.append(
                f"Unattributed: {self.unattributed_ms:.3f} ms; outside every range: {self.outside_ranges_ms:.3f} ms."
            )
        return "\n".join(lines).rstrip() + "\n"


def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    return device


def summarize_events(
    events: Sequence,
    *,
    device: str,
    ranges: Sequence[str] = (*PHASES, STEP_RANGE, *ATTENTION_SUBSTEPS),
    top_k: int = 10,
) -> KernelSummary:
    """Summarize profiler events (``prof.events()``: FunctionEvents, or objects with the same fields).

    Fields read: name, device_type, is_user_annotation (activity_type), id, linked_correlation_id,
    time_range.start/.end (us), self_cpu_time_total (cpu), is_async.  Ranges absent from the profile
    are left out of the result.
    """
    _check_device(device)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    events = list(events)
    spans = _ranges(events, ranges)
    starts = {name: [s for s, _ in v] for name, v in spans.items()}
    per_range: dict[str, list[tuple[int, _Item]]] = defaultdict(list)
    unattributed = outside = 0.0
    for item in _items(events, device):
        if item.at is None:
            unattributed += item.time
            continue
        placed = False
        for name, v in spans.items():
            occ = _occurrence(v, starts[name], item.at)
            if occ is not None:
                per_range[name].append((occ, item))
                placed = True
        if not placed:
            outside += item.time
    summaries = {name: _summarize_range(name, len(spans[name]), per_range.get(name, []), top_k) for name in spans}
    return KernelSummary(device, summaries, unattributed / 1e3, outside / 1e3)


def _summarize_range(name: str, occurrences: int, placed: list[tuple[int, _Item]], top_k: int) -> RangeSummary:
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, us]
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    bounds: dict[int, list[float]] = {}
    for occ, item in placed:
        stat = by_kernel[item.name]
        stat[0] += 1
        stat[1] += item.time
        by_category[categorize(item.name)] += item.time
        b = bounds.setdefault(occ, [item.start, item.end])
        b[0], b[1] = min(b[0], item.start), max(b[1], item.end)
    total = sum(us for _, us in by_kernel.values())
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top_k]
    kernels = [
        KernelStat(n, short_name(n), categorize(n), int(calls), us / 1e3, us / total if total > 0 else 0.0)
        for n, (calls, us) in ranked
    ]
    span = sum(e - s for s, e in bounds.values()) / len(bounds) if bounds else 0.0
    return RangeSummary(
        name=name,
        occurrences=occurrences,
        total_ms=total / 1e3,
        span_ms=span / 1e3,
        calls=len(placed),
        distinct_kernels=len(by_kernel),
        kernels=kernels,
        category_ms={c: us / 1e3 for c, us in by_category.items()},
    )


def _kineto_events(prof: torch.profiler.profile) -> list[SimpleNamespace] | None:
    """The raw Kineto events of a finished profile, in the fields `summarize_events` reads.

    On CUDA the kernel -> launching-call link (``linked_correlation_id``) is read from here rather than
    from ``prof.events()``: the FunctionEvents of some torch releases (2.11 on the H100 runner) do not carry
    it, which left every kernel unattributed.  The raw events have had it throughout torch 2.x.  Times are
    converted to microseconds; only differences and containment are used.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return None
    out = []
    for e in results.events():
        start_us, end_us = e.start_ns() / 1e3, e.end_ns() / 1e3
        # activity_type() exists from torch 2.12 on (2.11 on the H100 runner lacks it); is_user_annotation()
        # alone identifies the NVTX/record_function ranges there.
        activity = e.activity_type() if hasattr(e, "activity_type") else ""
        out.append(SimpleNamespace(
            name=e.name(), device_type=e.device_type(), id=e.correlation_id(),
            linked_correlation_id=e.linked_correlation_id(), is_async=e.is_async(),
            is_user_annotation=e.is_user_annotation(), activity_type=str(activity),
            time_range=SimpleNamespace(start=start_us, end=end_us), self_cpu_time_total=end_us - start_us,
        ))
    return out


def summarize_profile(prof: torch.profiler.profile, *, device: str, top_k: int = 10, **kwargs) -> KernelSummary:
    """`summarize_events` of a finished `torch.profiler.profile`: its raw Kineto events on CUDA (see
    `_kineto_events`), ``prof.events()`` on CPU (which needs their self CPU times)."""
    events = _kineto_events(prof) if _check_device(device) == "cuda" else None
    return summarize_events(events if events is not None else prof.events(), device=device, top_k=top_k, **kwargs)


def profiler_activities(device: str) -> list[torch.profiler.ProfilerActivity]:
    """CPU, plus CUDA when kernels are to be summarized."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if _check_device(device) == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


__all__ = [
    "ATTENTION_SUBSTEPS", "CATEGORIES", "DEVICES", "MEASURED_RANGE", "PHASES", "STEP_RANGE", "WARMUP_RANGE",
    "KernelStat", "KernelSummary", "RangeSummary", "categorize", "profiler_activities",
    "short_name", "summarize_events", "summarize_profile",
]
