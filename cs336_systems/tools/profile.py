"""Kernel summaries per phase of one LM case, and the handout's profiling answers from them.

    python -m cs336_systems.profile --size xl --context 512 --mode train-step --precision bf16 \\
        [--json out.json] [--md out.md] [--trace trace.json]

What it does, for the case (size, context, batch, mode, precision, attention):
  1. builds the workload with `workloads.lm_step` (same model, optimizer and batch as the benchmarks) and
     runs it as a *phased* step: ranges "step" > "forward" / "backward" / "optimizer" (and naive
     attention's "attention scores" / "softmax" / "final matmul" inside "forward"), each an NVTX range
     and a `record_function`; the device is synchronized at the end of each step, as the harness does
     between rounds.  The benchmark path (`lm_step`'s own step) is not touched.
  2. runs ``--warmup`` steps inside the range "warmup", then ``--steps`` steps inside "measured" under
     `torch.profiler`, and summarizes them per range (`profiling.summarize_profile`): top kernels by
     total time with calls and share, and category shares.  On CPU the "kernels" are aten ops and the
     times their self CPU time (see `cs336_systems.tools.kernel_summary`).
  3. times the same case with the harness (`benchmarking.measure`) and compares.
  4. when ``--mode`` is not "forward", does 1-3 again for the forward-only (inference) case, for the
     GEMM share of inference vs the full step (skip with ``--no-forward-case``).

The answers (Markdown "Answers" section and JSON "answers"):
  forward_time          profiled time per forward (GPU span of the step: first kernel start to last
                        kernel end; and kernel busy time) vs the harness median of the forward case;
  step_time             the same for ``--mode`` when it is not "forward";
  dominant_forward      the kernel with the most time in "forward", its calls per forward and share;
  dominant_step         the same over the whole step of ``--mode``;
  matmul_share          share of matmul-category time in the forward-only step and in the ``--mode`` step;
  attention             (naive attention only) per forward, all layers: time in the "softmax" range vs
                        matmul-category time in "attention scores" + "final matmul", beside the FLOP
                        ratio.  Matmul FLOPs: QK^T and PV over the full T x T score matrix (naive
                        attention computes the masked half too) = 4 B H T^2 d_head per layer
                        (`flops.attention_flops`, causal=False); softmax FLOPs assumed 5 per score
                        element (max, subtract, exp, sum, divide) = 5 B H T^2 per layer; ratio 0.8 d_head.

For Nsight Systems, ``--profiler nvtx`` runs only the ranges (no torch.profiler, no harness), so an
NVTX capture range isolates the measured steps:

    nsys profile -t cuda,nvtx --capture-range=nvtx --nvtx-capture=measured --capture-range-end=stop \\
        --env-var=NSYS_NVTX_PROFILER_REGISTER_ONLY=0 -o xl_ctx512 \\
        python -m cs336_systems.profile --size xl --context 512 --mode train-step --profiler nvtx

(torch's NVTX strings are not registered strings; nsys matches them only with that variable set to 0.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cs336_systems import amp
from cs336_systems.bench import harness as benchmarking
from cs336_systems.bench import flops
from cs336_systems.bench.workloads import lm as workloads
from cs336_systems.cli_args import int_at_least, unwritable_reason
from cs336_systems import attention as attention_registry
from cs336_systems.model import SIZES
from cs336_systems.model import config as model_config
from cs336_systems.nvtx import nvtx_range
from cs336_systems.tools.kernel_summary import (
    ATTENTION_SUBSTEPS,
    MEASURED_RANGE,
    STEP_RANGE,
    WARMUP_RANGE,
    KernelSummary,
    RangeSummary,
    profiler_activities,
    summarize_profile,
)

SOFTMAX_FLOPS_PER_SCORE = 5  # max, subtract, exp, sum, divide


# ---- the case and its phased step ------------------------------------------------------------
def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Case:
    """One LM workload, as `workloads.lm_step` takes it; validated on construction."""

    size: str
    context: int
    batch_size: int
    mode: str
    precision: str = "fp32"
    attention: str = "naive"
    compile: bool = False
    device: str = "cpu"
    vocab_size: int = 10_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; valid: {', '.join(SIZES)}")
        if self.mode not in workloads.MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid: {', '.join(workloads.MODES)}")
        amp.check_precision(self.precision)
        attention_registry.get(self.attention)
        for name in ("context", "batch_size", "vocab_size"):
            _positive_int(name, getattr(self, name))
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda (cuda:N), got {self.device!r}")

    @property
    def kind(self) -> str:
        """"cuda" or "cpu": what the profile summarizes (kernels or ops)."""
        return torch.device(self.device).type

    def with_mode(self, mode: str) -> Case:
        return dataclasses.replace(self, mode=mode)

    def lm_step(self) -> workloads.LMStep:
        """The benchmark path's step for this case."""
        return workloads.lm_step(**dataclasses.asdict(self))


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The (tokens, targets) batch `workloads.lm_step` draws for this case: same generator, same order."""
    generator = torch.Generator(case.device).manual_seed(case.seed)
    shape = (case.batch_size, case.context)
    tokens = torch.randint(0, case.vocab_size, shape, device=case.device, generator=generator)
    targets = torch.randint(0, case.vocab_size, shape, device=case.device, generator=generator)
    return tokens, targets


class PhasedStep:
    """`lm_step`'s step for ``case`` (same model, optimizer, batch and arithmetic), split into ranges.

    One call: "step" > ["forward" (loss included), "backward", "optimizer" (GradScaler step and
    update included)] as the mode has them, then a device synchronize inside "step".  Gradients are
    reset (set to None) before "forward", outside the phases: it launches no kernels.
    """

    def __init__(self, case: Case) -> None:
        built = case.lm_step()
        self.case = case
        self.model, self.optimizer = built.model, built.optimizer
        self.tokens, self.targets = _batch(case)
        self.scaler = amp.grad_scaler(case.precision, case.device) if case.mode != "forward" else None

    def __call__(self) -> None:
        case = self.case
        with nvtx_range(STEP_RANGE):
            if case.mode == "forward":
                with nvtx_range("forward"), torch.no_grad(), amp.autocast(case.precision, case.device):
                    self.model(self.tokens)
            else:
                self.model.zero_grad(set_to_none=True)
                with nvtx_range("forward"), amp.autocast(case.precision, case.device):
                    logits = self.model(self.tokens)  # (B, T, V)
                    loss = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())
                with nvtx_range("backward"):
                    (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                if self.optimizer is not None:
                    with nvtx_range("optimizer"):
                        if self.scaler is not None:
                            self.scaler.step(self.optimizer)
                            self.scaler.update()
                        else:
                            self.optimizer.step()
            benchmarking.synchronize(case.device)


def run_ranges(step: PhasedStep, *, warmup: int, steps: int, around_measured=None) -> None:
    """Warm-up steps inside "warmup", then the measured steps inside "measured" (the nsys capture range).

    ``around_measured``: a context manager entered just outside "measured" (the torch profiler), so it
    records the measured steps and not the warm-up.  The cyclic GC is paused throughout, as in the harness.
    """
    with benchmarking.gc_paused():
        with nvtx_range(WARMUP_RANGE):
            for _ in range(warmup):
                step()
        with around_measured if around_measured is not None else contextlib.nullcontext():
            with nvtx_range(MEASURED_RANGE):
                for _ in range(steps):
                    step()


# ---- one profiled case -----------------------------------------------------------------------
@dataclass(frozen=True)
class CaseResult:
    """The kernel summary of one case and the harness's timing of the same case (None if not timed)."""

    case: Case
    warmup: int
    steps: int
    summary: KernelSummary
    harness: dict | None  # Measurement.as_dict() plus "median_ms"

    @property
    def step(self) -> RangeSummary:
        return self.summary.ranges[STEP_RANGE]

    def to_dict(self) -> dict:
        return {
            "case": dataclasses.asdict(self.case),
            "warmup": self.warmup,
            "steps": self.steps,
            "summary": self.summary.to_dict(),
            "harness": self.harness,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CaseResult:
        return cls(Case(**data["case"]), data["warmup"], data["steps"], KernelSummary.from_dict(data["summary"]),
                   data["harness"])


def profile_case(
    case: Case,
    *,
    warmup: int = 3,
    steps: int = 3,
    rounds: int = 10,
    top_k: int = 10,
    trace: str | Path | None = None,
) -> CaseResult:
    """Profile ``steps`` phased steps of ``case`` after ``warmup``; then time it with the harness
    (``rounds`` rounds after ``warmup``; rounds=0 skips the harness)."""
    _positive_int("steps", steps)
    _positive_int("top_k", top_k)
    for name, value in (("warmup", warmup), ("rounds", rounds)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    step = PhasedStep(case)
    prof = torch.profiler.profile(activities=profiler_activities(case.kind))
    run_ranges(step, warmup=warmup, steps=steps, around_measured=prof)
    summary = summarize_profile(prof, device=case.kind, top_k=top_k)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        if not Path(trace).is_file():  # the exporter logs a failure to open the file and returns
            raise OSError(f"the Chrome trace could not be written to {trace}")
    del step, prof
    benchmarking.free_memory(case.device)
    harness = None
    if rounds:
        measurement = benchmarking.measure(case.lm_step, warmup=warmup, rounds=rounds, device=case.device)
        harness = measurement.as_dict()
        stats = measurement.stats
        harness["median_ms"] = stats.median * 1e3 if stats is not None else None
        benchmarking.free_memory(case.device)
    return CaseResult(case, warmup, steps, summary, harness)


# ---- the report ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileReport:
    """Profiled cases keyed by mode (the requested one first) and the answers computed from them."""

    mode: str
    cases: dict[str, CaseResult]
    answers: dict
    environment: dict

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "cases": {m: r.to_dict() for m, r in self.cases.items()},
            "answers": self.answers,
            "environment": self.environment,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProfileReport:
        cases = {m: CaseResult.from_dict(r) for m, r in data["cases"].items()}
        return cls(data["mode"], cases, data["answers"], data["environment"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_markdown(self, top_k: int | None = None) -> str:
        main = self.cases[self.mode].case
        lines = [
            f"# Profile: {main.size}, context {main.context}, batch {main.batch_size}, {main.mode}, "
            f"{main.precision}, attention {main.attention}{', compiled' if main.compile else ''}",
            "",
            f"Device: {self.environment.get('device_name')}; torch {self.environment.get('torch')}.",
            "",
            "## Answers",
            "",
            *_answer_lines(self.answers),
            "",
        ]
        for mode, result in self.cases.items():
            label = f"{mode} (inference)" if mode == "forward" and mode != self.mode else mode
            lines += [
                f"## {label}",
                "",
                f"{result.steps} profiled steps after {result.warmup} warm-up steps.",
                "",
                result.summary.to_markdown(title=f"Kernel summary: {mode}", top_k=top_k),
            ]
        return "\n".join(lines).rstrip() + "\n"


def _timing(result: CaseResult) -> dict:
    """Profiled time per step (span and busy) vs the harness median, and their ratio."""
    step = result.step
    median = result.harness.get("median_ms") if result.harness else None
    ratio = step.span_ms / median if median else None
    busy_share = step.per_occurrence_ms / step.span_ms if step.span_ms else None
    return {
        "mode": result.case.mode,
        "profiled_span_ms": step.span_ms,
        "profiled_busy_ms": step.per_occurrence_ms,
        "harness_median_ms": median,
        "ratio": ratio,
        "gpu_busy_share": busy_share,
        "verdict": _verdict(ratio, busy_share),
    }


AGREEMENT = 0.05  # "agree within a few percent"
HOST_BOUND_BUSY_SHARE = 0.8


def _verdict(ratio: float | None, busy_share: float | None) -> str:
    """Why the profiled step and the harness agree or not.

    The profiler costs CPU time per recorded op.  When the GPU waits for the host (kernels busy for a
    small share of the step), that cost lands on the critical path and the profiled span exceeds the
    harness's time; when the GPU is the bottleneck the host runs ahead and the two agree.
    """
    if ratio is None:
        return "no harness timing"
    if abs(ratio - 1.0) <= AGREEMENT:
        return f"agree within {AGREEMENT:.0%}"
    if busy_share is not None and busy_share < HOST_BOUND_BUSY_SHARE:
        return (f"differ: host-bound step (kernels busy {busy_share:.0%} of the span), so the profiler's per-op "
                "CPU cost inflates the profiled span; compare a GPU-bound case (larger batch or context) or use "
                "--profiler nvtx under nsys")
    return "differ although the GPU is busy: check clocks and contention"


def _dominant(r: RangeSummary) -> dict | None:
    if not r.kernels:
        return None
    k = r.kernels[0]
    return {
        "range": r.name,
        "name": k.name,
        "short": k.short,
        "category": k.category,
        "calls_per_occurrence": r.calls_per_occurrence(k),
        "ms_per_occurrence": k.total_ms / r.occurrences,
        "share": k.share,
    }


def _attention(result: CaseResult) -> dict:
    """Softmax vs attention matmuls per forward, all layers, with the FLOP ratio (module docstring)."""
    ranges = result.summary.ranges
    missing = [n for n in ATTENTION_SUBSTEPS if n not in ranges]
    if missing:
        advice = ("torch.compile fuses the naive attention's sub-steps, so their ranges are gone: run without "
                  "--compile" if result.case.compile else "run with --attention naive")
        return {"available": False, "reason": (
            f"attention {result.case.attention!r} has no {', '.join(map(repr, missing))} ranges; {advice}")}
    forwards = ranges["forward"].occurrences
    cfg = model_config(result.case.size, vocab_size=result.case.vocab_size, context_length=result.case.context)
    b, t = result.case.batch_size, result.case.context
    matmul_flops = cfg.n_layers * flops.attention_flops(b * cfg.n_heads, t, t, cfg.d_head, causal=False)
    softmax_flops = cfg.n_layers * SOFTMAX_FLOPS_PER_SCORE * b * cfg.n_heads * t * t
    softmax_ms = ranges["softmax"].total_ms / forwards
    matmul_ms = sum(ranges[n].category_ms["matmul"] for n in ("attention scores", "final matmul")) / forwards
    return {
        "available": True,
        "source_mode": result.case.mode,
        "softmax_ms": softmax_ms,
        "matmul_ms": matmul_ms,
        "scores_range_ms": ranges["attention scores"].total_ms / forwards,
        "final_matmul_range_ms": ranges["final matmul"].total_ms / forwards,
        "time_ratio_matmul_over_softmax": matmul_ms / softmax_ms if softmax_ms > 0 else None,
        "matmul_flops": matmul_flops,
        "softmax_flops": softmax_flops,
        "flop_ratio_matmul_over_softmax": matmul_flops / softmax_flops,
        "assumption": f"softmax {SOFTMAX_FLOPS_PER_SCORE} FLOPs per score element; matmuls over the full "
                      "T x T scores (naive attention computes the masked half)",
    }


def answers(cases: dict[str, CaseResult], mode: str) -> dict:
    """The handout's questions answered from the profiled cases (keys in the module docstring)."""
    main = cases[mode]
    fwd = cases.get("forward", main)  # forward-only case if profiled, else the main case's forward phase
    out: dict = {
        "forward_time": _timing(fwd) if fwd.case.mode == "forward" else None,
        "step_time": _timing(main) if mode != "forward" else None,
        "dominant_forward": _dominant(fwd.summary.ranges["forward"]),
        "dominant_step": _dominant(main.step),
        "matmul_share": {m: r.step.category_share["matmul"] for m, r in cases.items()},
        "attention": _attention(fwd),
    }
    return out


def _fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def _answer_lines(a: dict) -> list[str]:
    lines = []
    for key, label in (("forward_time", "Forward time (forward-only case)"), ("step_time", "Step time")):
        t = a.get(key)
        if t:
            ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}"
            lines.append(
                f"- {label}, {t['mode']}: profiled {_fmt_ms(t['profiled_span_ms'])} per step (span; busy "
                f"{_fmt_ms(t['profiled_busy_ms'])}) vs harness median {_fmt_ms(t['harness_median_ms'])}: "
                f"ratio {ratio} ({t.get('verdict', 'n/a')})"
            )
    dominant = (("dominant_forward", "Dominant kernel per forward"), ("dominant_step", "Dominant kernel per step"))
    for key, label in dominant:
        d = a.get(key)
        if d:
            short = d["short"].replace("|", "\\|")
            lines.append(
                f"- {label}: `{short}` ({d['category']}), {d['calls_per_occurrence']:.0f} calls, "
                f"{_fmt_ms(d['ms_per_occurrence'])}, {d['share']:.1%} of {d['range']}"
            )
    shares = ", ".join(f"{m} {s:.1%}" for m, s in a["matmul_share"].items())
    lines.append(f"- Matmul share of the step: {shares}")
    att = a["attention"]
    if att.get("available"):
        ratio = att["time_ratio_matmul_over_softmax"]
        lines.append(
            f"- Attention per forward ({att['source_mode']} case, all layers): "
            f"softmax {_fmt_ms(att['softmax_ms'])} vs matmuls (QK^T, PV) {_fmt_ms(att['matmul_ms'])}: "
            f"time ratio matmul/softmax {'n/a' if ratio is None else f'{ratio:.2f}'}; FLOP ratio {att['flop_ratio_matmul_over_softmax']:.1f} "
            f"({att['matmul_flops']:.3g} vs {att['softmax_flops']:.3g} FLOPs; {att['assumption']})"
        )
    else:
        lines.append(f"- Attention: n/a ({att['reason']})")
    return lines


def environment(device: str) -> dict:
    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else "cpu"
    return {"device": device, "device_name": name, "torch": torch.__version__}


def profile(
    case: Case,
    *,
    warmup: int = 3,
    steps: int = 3,
    rounds: int = 10,
    top_k: int = 10,
    forward_case: bool = True,
    trace: str | Path | None = None,
) -> ProfileReport:
    """Profile ``case`` (and its forward-only case when ``forward_case`` and the mode is not "forward").

    ``trace``: Chrome trace of the main case; the forward-only case's goes next to it with ".forward"
    before the suffix (trace.json -> trace.forward.json).
    """
    cases = {case.mode: profile_case(case, warmup=warmup, steps=steps, rounds=rounds, top_k=top_k, trace=trace)}
    if forward_case and case.mode != "forward":
        fwd_trace = None if trace is None else Path(trace).with_suffix(".forward" + (Path(trace).suffix or ".json"))
        cases["forward"] = profile_case(
            case.with_mode("forward"), warmup=warmup, steps=steps, rounds=rounds, top_k=top_k, trace=fwd_trace
        )
    return ProfileReport(case.mode, cases, answers(cases, case.mode), environment(case.device))


# ---- CLI -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cs336_systems.profile", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=list(SIZES), required=True)
    parser.add_argument("--context", type=int_at_least(1), required=True)
    parser.add_argument("--batch-size", type=int_at_least(1), default=4)
    parser.add_argument("--mode", choices=workloads.MODES, default="train-step")
    parser.add_argument("--precision", choices=list(amp.PRECISIONS), default="fp32")
    parser.add_argument("--attention", choices=attention_registry.names(), default="naive",
                        help="naive (default) has the attention sub-step ranges the softmax answer needs")
    parser.add_argument("--compile", action="store_true", help="compile each block (workloads.compile_blocks)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab-size", type=int_at_least(1), default=10_000)
    parser.add_argument("--warmup", type=int_at_least(0), default=3)
    parser.add_argument("--steps", type=int_at_least(1), default=3, help="profiled steps")
    parser.add_argument("--rounds", type=int_at_least(0), default=10, help="harness rounds (0: no harness)")
    parser.add_argument("--top-k", type=int_at_least(1), default=10)
    parser.add_argument("--no-forward-case", action="store_true",
                        help="do not also profile the forward-only case when --mode is not forward")
    parser.add_argument("--profiler", choices=("torch", "nvtx"), default="torch",
                        help="nvtx: only run the NVTX ranges, for nsys (no torch.profiler, no harness)")
    parser.add_argument("--json", type=Path, help="write the report as JSON")
    parser.add_argument("--md", type=Path, help="write the report as Markdown")
    parser.add_argument("--trace", type=Path, help="write the Chrome trace of the profiled steps")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        case = Case(
            size=args.size, context=args.context, batch_size=args.batch_size, mode=args.mode,
            precision=args.precision, attention=args.attention, compile=args.compile, device=args.device,
            vocab_size=args.vocab_size,
        )
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    if not attention_registry.get(case.attention).available(torch.device(case.device)):
        parser.error(f"--attention {case.attention} is not available on {case.device}")
    if case.kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {case.device}: CUDA is not available")
    for flag, path in (("--json", args.json), ("--md", args.md), ("--trace", args.trace)):
        reason = None if path is None else unwritable_reason(path)
        if reason is not None:  # now, not after profiling
            parser.error(f"{flag}: {reason}")
    try:
        if args.profiler == "nvtx":
            run_ranges(PhasedStep(case), warmup=args.warmup, steps=args.steps)
            print(f"ran {args.steps} steps inside NVTX range {MEASURED_RANGE!r} after {args.warmup} warm-up steps")
            return 0
        report = profile(
            case, warmup=args.warmup, steps=args.steps, rounds=args.rounds, top_k=args.top_k,
            forward_case=not args.no_forward_case, trace=args.trace,
        )
    except Exception as exc:  # noqa: BLE001 - only an OOM is turned into a message
        if not benchmarking.is_out_of_memory(exc):
            raise
        print(f"out of memory profiling {case}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    text = report.to_markdown()
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(report.to_json())
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
