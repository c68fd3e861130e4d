"""CUDA memory snapshots: record them for the measured steps only, and read them back in Python.

Recording (`record_snapshot`) runs the warm-up steps first, then turns on the caching allocator's history
(`torch.cuda.memory._record_memory_history`), runs the measured steps, and writes
`torch.cuda.memory._dump_snapshot` -- the pickle that https://pytorch.org/memory_viz opens.  Warm-up stays
out of the trace, so the timeline shows steady-state steps (optimizer state already allocated, caches warm).

Reading (`load_snapshot`, `summarize`) answers "what held the memory at the peak" without the viewer.  The
snapshot (format: `torch.cuda.memory._snapshot`'s docstring) holds

  segments       the allocator's state at dump time: cudaMalloc'd segments, each split into blocks
                 {address, size, requested_size, state: active_allocated | active_awaiting_free | inactive,
                 frames}; ``frames`` is the allocation's stack when history was on at allocation time
  device_traces  per device, the events recorded while history was on, oldest first:
                 {action, addr, size, frames, stream, ...} with action in alloc, free_requested,
                 free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom, snapshot

The allocator records an event's ``size`` as the *requested* size (before its rounding to 512-byte blocks),
and drops a block from its allocated/requested counters at ``free_requested`` (``free_completed`` only says
the block may be reused once other streams are done with it).  So the replay below follows the same rules
and its peak is torch's ``requested_bytes.all.peak`` for the recorded window; ``max_memory_allocated``
(rounded block sizes) is at most a few hundred bytes per live tensor above it.

Replay algorithm (one device):
  1. Walk the trace, keeping a map addr -> live allocation.  A free of an address the map does not hold is
     an allocation that predates the recording; so is an ``active_allocated`` block at the end that the map
     does not hold.  Their sizes sum to the bytes already allocated when recording started (``baseline``).
  2. Walk again from ``baseline``: +size at alloc, -size at free_requested; the maximum is the peak (the
     state before the first event counts too).  Reserved memory replays the same way from the segment events
     and the segments' total sizes.
  3. Replay up to the peak's event: the allocations live there, grouped by (size, top stack frames) and
     sorted by size, are the report's "largest live allocations".

Frames are filtered to the ones worth reading (`top_frames`): Python frames of the project, torch and other
libraries, without the interpreter's and pytest's plumbing or nn.Module's call wrappers; C++ frames only
when no Python frame is left (e.g. an autograd node's name for allocations made by the backward pass).
"""

from __future__ import annotations

import argparse
import inspect
import os
import pickle
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_MAX_ENTRIES = 1_000_000  # trace events kept (a ring buffer): several KB each with stacks
STACKS = ("python", "all")

_ALLOC = "alloc"
_FREES = ("free_requested", "free_completed")
_SEGMENT_GROW = ("segment_alloc", "segment_map")
_SEGMENT_SHRINK = ("segment_free", "segment_unmap")
_KNOWN_ACTIONS = {_ALLOC, *_FREES, *_SEGMENT_GROW, *_SEGMENT_SHRINK, "oom", "snapshot"}


# ---------------------------------------------------------------------------------------------------------
# Recording (CUDA only)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """What `record_snapshot` wrote and torch's own counters for the same window (cross-checks)."""

    path: Path
    snapshot: dict
    device: int
    max_allocated_bytes: int  # torch.cuda.max_memory_allocated over the recorded rounds (rounded blocks)
    max_requested_bytes: int  # memory_stats()["requested_bytes.all.peak"]: what the trace replay reproduces
    max_entries: int

    @property
    def truncated(self) -> bool:
        """True if the trace filled its ring buffer, so its oldest events (maybe the peak) were dropped."""
        return len(self.snapshot["device_traces"][self.device]) >= self.max_entries


def _check_count(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_output_path(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path={str(path)!r} is a directory; give a file name for the snapshot pickle")
    if not path.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: directory {str(path.parent)!r} does not exist")
    return path


def _cuda_index(device: torch.device | str) -> int:
    """The CUDA device index of ``device``; RuntimeError if it is not a usable CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            f"memory snapshots record the CUDA caching allocator; device={str(device)!r} is not a CUDA device"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("memory snapshots need CUDA, and torch.cuda.is_available() is False here")
    return device.index if device.index is not None else torch.cuda.current_device()


def record_snapshot(
    step: Callable[[], object],
    *,
    warmup: int,
    rounds: int,
    path: str | os.PathLike,
    device: torch.device | str,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stacks: str = "python",
) -> Recording:
    """Run ``step`` ``warmup`` times unrecorded, then ``rounds`` times with memory history on; dump to ``path``.

    ``stacks="python"`` records Python frames only (cheap); ``"all"`` adds C++ frames, which name the
    autograd node behind each backward-pass allocation but make the dump slow to symbolize on long traces.
    If a recorded round runs out of memory the snapshot (with its "oom" event) is still written, then the
    error is re-raised.  Raises ValueError for bad arguments, RuntimeError off CUDA.
    """
    if not callable(step):
        raise TypeError(f"step must be callable, got {step!r}")
    _check_count("warmup", warmup, 0)
    _check_count("rounds", rounds, 1)
    _check_count("max_entries", max_entries, 1)
    if stacks not in STACKS:
        raise ValueError(f"stacks={stacks!r}; valid: {', '.join(STACKS)}")
    path = _check_output_path(path)
    index = _cuda_index(device)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize(index)
    torch.cuda.reset_peak_memory_stats(index)
    options: dict[str, Any] = {"max_entries": max_entries, "stacks": stacks}
    if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        options["clear_history"] = True  # drop events from any earlier recording (e.g. of the warm-up)
    torch.cuda.memory._record_memory_history(**options)
    try:
        try:
            for _ in range(rounds):
                step()
        finally:
            # Dump on success and on OOM alike: the trace up to the failure is what explains it.
            torch.cuda.synchronize(index)
            torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats(index)
    return Recording(
        path=path,
        snapshot=load_snapshot(path),
        device=index,
        max_allocated_bytes=int(stats["allocated_bytes.all.peak"]),
        max_requested_bytes=int(stats["requested_bytes.all.peak"]),
        max_entries=max_entries,
    )


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def load_snapshot(path: str | os.PathLike) -> dict:
    """Unpickle a snapshot written by `_dump_snapshot` (only open files you trust: this is pickle)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot file at path={str(path)!r}")
    try:
        with path.open("rb") as f:
            snapshot = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, ValueError) as exc:
        raise ValueError(f"path={str(path)!r} is not a memory snapshot pickle: {exc}") from exc
    _check_snapshot(snapshot)
    return snapshot


def _check_snapshot(snapshot: Any) -> None:
    if not isinstance(snapshot, Mapping):
        raise ValueError(f"a memory snapshot is a dict, got {type(snapshot).__name__}")
    missing = [key for key in ("segments", "device_traces") if key not in snapshot]
    if missing:
        raise ValueError(f"memory snapshot lacks key(s) {missing}; has {sorted(map(str, snapshot))}")
    if not isinstance(snapshot["segments"], list) or not isinstance(snapshot["device_traces"], list):
        raise ValueError("memory snapshot's 'segments' and 'device_traces' must be lists")
    if not all(isinstance(trace, list) for trace in snapshot["device_traces"]):
        raise ValueError("memory snapshot's 'device_traces' must be a list of per-device event lists")
    if not all(isinstance(segment, Mapping) for segment in snapshot["segments"]):
        raise ValueError("memory snapshot's 'segments' must be a list of dicts")


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        # The last two path components are enough to tell model.py from torch/nn/functional.py.
        short = "/".join(self.filename.replace("\\", "/").split("/")[-2:])
        return f"{short}:{self.line} {self.name}"


@dataclass(frozen=True)
class AllocationGroup:
    """``count`` allocations of ``size`` bytes each with the same top frames, live at the peak."""

    size: int
    count: int
    frames: tuple[Frame, ...]  # innermost first; empty when the allocator recorded no usable stack
    before_recording: bool  # allocated before history was turned on (parameters, optimizer state, ...)

    @property
    def total(self) -> int:
        return self.size * self.count


@dataclass(frozen=True)
class MemorySummary:
    """The replay of one device's trace; byte counts are requested sizes (see the module docstring)."""

    device: int
    n_events: int
    baseline_bytes: int  # allocated when recording started
    peak_bytes: int  # most bytes allocated at once during the recording
    peak_event: int  # index of the trace event that reached the peak first (-1: before any event)
    final_bytes: int  # allocated at dump time
    peak_reserved_bytes: int  # most bytes held in cudaMalloc'd segments
    final_reserved_bytes: int
    largest: tuple[AllocationGroup, ...]  # live at the peak, largest size first (``top`` of them)
    alloc_counts: dict[int, int]  # size -> number of "alloc" events of that size in the trace
    n_ooms: int

    def format(self) -> str:
        lines = [
            f"device cuda:{self.device}: {self.n_events} trace events"
            + (f", {self.n_ooms} out-of-memory" if self.n_ooms else ""),
            f"peak allocated   {format_bytes(self.peak_bytes)} (at event {self.peak_event}; "
            f"{format_bytes(self.baseline_bytes)} when recording started, "
            f"{format_bytes(self.final_bytes)} at the end)",
            f"peak reserved    {format_bytes(self.peak_reserved_bytes)}",
            "largest allocations live at the peak:",
        ]
        for group in self.largest:
            if group.frames:
                where = "  <-  ".join(str(frame) for frame in group.frames)
            elif group.before_recording:
                where = "(allocated before recording: parameters, gradients, optimizer state, inputs)"
            else:
                where = "(no Python frame: allocated by C++, e.g. the autograd engine's backward pass)"
            lines.append(f"  {format_bytes(group.size):>10} x {group.count:<4} = {format_bytes(group.total):>10}  {where}")
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# Python frames that say nothing about *what* allocated: the interpreter, test runners, module-call glue.
_PLUMBING_FILES = ("/_pytest/", "/pluggy/", "/runpy.py", "/site-packages/IPython/", "<frozen ")
_PLUMBING_FUNCTIONS = {
    ("torch/nn/modules/module.py", "_call_impl"),
    ("torch/nn/modules/module.py", "_wrapped_call_impl"),
    ("torch/utils/_contextlib.py", "decorate_context"),
}
# C++ frames worth showing when nothing else is left: autograd nodes (e.g. SoftmaxBackward0) and ATen kernels.
_CPP_KEYWORDS = ("autograd::generated::", "at::native::")


def _is_stdlib(filename: str) -> bool:
    return "/lib/python3" in filename and "-packages/" not in filename


def _is_useful_python_frame(frame: Frame) -> bool:
    name = frame.filename.replace("\\", "/")
    if not name.endswith(".py") or _is_stdlib(name) or any(p in name for p in _PLUMBING_FILES):
        return False
    return not any(name.endswith(f) and frame.name == fn for f, fn in _PLUMBING_FUNCTIONS)


def top_frames(frames: Iterable[Mapping[str, Any]], n: int = 3) -> tuple[Frame, ...]:
    """The ``n`` innermost useful frames of an allocator stack (innermost first, as the snapshot stores it)."""
    parsed = [_frame(f) for f in frames]
    python = [f for f in parsed if _is_useful_python_frame(f)]
    if python:
        return tuple(python[:n])
    return tuple(f for f in parsed if any(k in f.name for k in _CPP_KEYWORDS))[:n]


def _frame(raw: Any) -> Frame:
    if not isinstance(raw, Mapping) or not {"filename", "line", "name"} <= raw.keys():
        raise ValueError(f"a stack frame is a dict with filename, line and name; got {raw!r}")
    return Frame(str(raw["filename"]), int(raw["line"]), str(raw["name"]))


@dataclass
class _Live:
    size: int
    frames: Sequence[Mapping[str, Any]]
    before_recording: bool
    freed_at: int | None = None  # for pre-recording allocations: the event that freed them


def _event_field(event: Any, key: str, index: int) -> Any:
    if not isinstance(event, Mapping) or key not in event:
        raise ValueError(f"trace event {index} lacks {key!r}: {event!r}")
    value = event[key]
    if key in ("addr", "size") and (not isinstance(value, int) or value < 0):
        raise ValueError(f"trace event {index} has {key}={value!r}; expected a non-negative integer")
    return value


def _active_blocks(segments: Sequence[Mapping[str, Any]]) -> dict[int, _Live]:
    """addr -> block for the blocks allocated at dump time (``active_allocated``)."""
    blocks: dict[int, _Live] = {}
    for s, segment in enumerate(segments):
        if not isinstance(segment, Mapping) or "blocks" not in segment:
            raise ValueError(f"segment {s} lacks 'blocks': {segment!r}")
        address = segment.get("address")
        for b, block in enumerate(segment["blocks"]):
            if not isinstance(block, Mapping) or "size" not in block or "state" not in block:
                raise ValueError(f"segment {s} block {b} lacks 'size' or 'state': {block!r}")
            # Blocks tile their segment in order; the dump carries each block's address, older ones do not.
            addr = block.get("address", address)
            if block["state"] == "active_allocated":
                if addr is None:
                    raise ValueError(f"segment {s} block {b} has no address")
                blocks[addr] = _Live(int(block.get("requested_size", block["size"])), block.get("frames", []), True)
            address = None if addr is None else addr + block["size"]
    return blocks


def _pick_device(snapshot: Mapping[str, Any], device: int | None) -> int:
    traces = snapshot["device_traces"]
    used = {i for i, trace in enumerate(traces) if trace}
    used |= {int(seg.get("device", 0)) for seg in snapshot["segments"]}
    if device is not None:
        if not isinstance(device, int) or isinstance(device, bool) or device < 0:
            raise ValueError(f"device must be a non-negative device index, got {device!r}")
        if device not in used and device >= len(traces):
            raise ValueError(f"device={device} has no trace or segments; devices in the snapshot: {sorted(used)}")
        return device
    if len(used) > 1:
        raise ValueError(f"the snapshot covers devices {sorted(used)}; pass device= to choose one")
    return used.pop() if used else 0


def summarize(
    snapshot: Mapping[str, Any], *, device: int | None = None, top: int = 10, frames: int = 3
) -> MemorySummary:
    """Replay one device's trace (algorithm: module docstring); ValueError if the snapshot is inconsistent."""
    _check_snapshot(snapshot)
    _check_count("top", top, 1)
    _check_count("frames", frames, 1)
    device = _pick_device(snapshot, device)
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot["segments"] if int(s.get("device", 0)) == device]
    final_blocks = _active_blocks(segments)

    # An allocation stops counting at free_requested; traces recorded without those events only have
    # free_completed, which then has to stand in for it.
    actions = [_event_field(e, "action", i) for i, e in enumerate(trace)]
    free_action = "free_requested" if "free_requested" in actions else "free_completed"

    # Pass 1: which allocations predate the recording, and which end state the trace implies.
    live: dict[int, _Live] = {}
    freed_in_trace: set[int] = set()  # addresses freed and not reused since: a second free is an error
    early: list[_Live] = []  # pre-recording allocations, in the order the trace meets them
    allocs: Counter[int] = Counter()
    for i, (event, action) in enumerate(zip(trace, actions)):
        if action not in _KNOWN_ACTIONS:
            raise ValueError(f"trace event {i} has unknown action {action!r}")
        if action == _ALLOC:
            addr, size = _event_field(event, "addr", i), _event_field(event, "size", i)
            if addr in live:
                raise ValueError(f"trace event {i} allocates address {addr:#x}, which is already allocated")
            live[addr] = _Live(size, event.get("frames", []), False)
            freed_in_trace.discard(addr)
            allocs[size] += 1
        elif action == free_action:
            addr, size = _event_field(event, "addr", i), _event_field(event, "size", i)
            if addr in live:
                del live[addr]
            elif addr in freed_in_trace:
                raise ValueError(f"trace event {i} frees address {addr:#x} twice")
            else:
                # Its allocation stack was not recorded (the event's own frames are the *free* stack).
                early.append(_Live(size, [], True, freed_at=i))
            freed_in_trace.add(addr)
    for addr, block in final_blocks.items():
        if addr not in live:
            if addr in freed_in_trace:
                raise ValueError(f"block {addr:#x} is allocated at the end but the trace freed it and never reallocated it")
            early.append(block)
    missing = sorted(set(live) - set(final_blocks))
    if missing:
        raise ValueError(
            f"{len(missing)} allocation(s) live at the end of the trace (first: {missing[0]:#x}) are not "
            "active_allocated blocks in the segments"
        )
    baseline = sum(a.size for a in early)

    # Pass 2: the allocated and reserved curves.
    reserved_final = sum(int(s.get("total_size", 0)) for s in segments)
    reserved_net = 0
    for i, (event, action) in enumerate(zip(trace, actions)):
        if action in _SEGMENT_GROW:
            reserved_net += _event_field(event, "size", i)
        elif action in _SEGMENT_SHRINK:
            reserved_net -= _event_field(event, "size", i)
    reserved = reserved_final - reserved_net
    if reserved < 0:
        raise ValueError("segment events release more memory than the segments and events account for")
    current, peak, peak_event, peak_reserved = baseline, baseline, -1, reserved
    for i, (event, action) in enumerate(zip(trace, actions)):
        if action == _ALLOC:
            current += event["size"]
            if current > peak:
                peak, peak_event = current, i
        elif action == free_action:
            current -= event["size"]
        elif action in _SEGMENT_GROW:
            reserved += event["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in _SEGMENT_SHRINK:
            reserved -= event["size"]

    # Pass 3: what was live at the peak.
    at_peak: list[_Live] = [a for a in early if a.freed_at is None or a.freed_at > peak_event]
    replay: dict[int, _Live] = {}
    for i in range(peak_event + 1):
        event, action = trace[i], actions[i]
        if action == _ALLOC:
            replay[event["addr"]] = _Live(event["size"], event.get("frames", []), False)
        elif action == free_action:
            replay.pop(event["addr"], None)
    at_peak.extend(replay.values())
    if sum(a.size for a in at_peak) != peak:
        raise ValueError("inconsistent snapshot: the allocations live at the peak do not add up to the peak")

    groups: Counter[tuple[int, tuple[Frame, ...], bool]] = Counter()
    for allocation in at_peak:
        groups[allocation.size, top_frames(allocation.frames, frames), allocation.before_recording] += 1
    largest = sorted(
        (AllocationGroup(size, count, stack, early_) for (size, stack, early_), count in groups.items()),
        key=lambda g: (-g.size, -g.count, g.before_recording),
    )[:top]
    return MemorySummary(
        device=device,
        n_events=len(trace),
        baseline_bytes=baseline,
        peak_bytes=peak,
        peak_event=peak_event,
        final_bytes=current,
        peak_reserved_bytes=peak_reserved,
        final_reserved_bytes=reserved_final,
        largest=tuple(largest),
        alloc_counts=dict(allocs),
        n_ooms=actions.count("oom"),
    )


# ---------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------


def residual_stream_bytes(batch: int, context: int, d_model: int, dtype: torch.dtype) -> int:
    """Bytes of one residual-stream activation x: (batch, context, d_model) of ``dtype``.

    Under autocast the residual stream stays float32: the embedding is not autocast, and ``x + block(x)``
    adds a low-precision block output to a float32 x, which promotes to float32.
    """
    for name, value in (("batch", batch), ("context", context), ("d_model", d_model)):
        _check_count(name, value, 1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return batch * context * d_model * dtype.itemsize


# ---------------------------------------------------------------------------------------------------------
# CLI: python -m cs336_systems.memory --size 2.7B --context 128 --mode forward --precision bf16 --out s.pickle
# ---------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    from cs336_systems import amp
    from cs336_systems.bench.workloads import lm as workloads
    from cs336_systems import attention as attention_registry
    from cs336_systems.cli_args import int_at_least, unwritable_reason
    from cs336_systems.model import SIZES, config

    parser = argparse.ArgumentParser(
        prog="python -m cs336_systems.memory",
        description="Record a CUDA memory snapshot of LM steps (after warm-up) and print what held the peak.",
    )
    parser.add_argument("--size", default="2.7B", choices=list(SIZES))
    parser.add_argument("--context", type=int_at_least(1), default=128)
    parser.add_argument("--batch-size", type=int_at_least(1), default=4)
    parser.add_argument("--mode", default="forward", choices=list(workloads.MODES))
    parser.add_argument("--precision", default="fp32", choices=list(amp.PRECISIONS))
    # The handout's memory questions are about its own (naive) attention, whose softmax is visible.
    parser.add_argument("--attention", default="naive", choices=attention_registry.names())
    parser.add_argument("--warmup", type=int_at_least(0), default=2)
    parser.add_argument("--rounds", type=int_at_least(1), default=1)
    parser.add_argument("--stacks", default="python", choices=list(STACKS))
    parser.add_argument("--top", type=int_at_least(1), default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="snapshot pickle to write (open it at pytorch.org/memory_viz)")
    args = parser.parse_args(argv)

    # Fail before building a 2.7B model, with a usage error rather than a traceback.
    try:
        _check_output_path(args.out)
        _cuda_index(args.device)
    except (ValueError, RuntimeError) as exc:  # torch.device("bogus") raises RuntimeError too
        parser.error(str(exc))
    reason = unwritable_reason(args.out)  # e.g. a read-only or pseudo filesystem
    if reason is not None:
        parser.error(f"--out: {reason}")
    step = workloads.lm_step(
        size=args.size, context=args.context, batch_size=args.batch_size, mode=args.mode,
        precision=args.precision, attention=args.attention, device=args.device,
    )
    recording = record_snapshot(
        step, warmup=args.warmup, rounds=args.rounds, path=args.out, device=args.device, stacks=args.stacks
    )
    summary = summarize(recording.snapshot, device=recording.device, top=args.top)
    residual = residual_stream_bytes(args.batch_size, args.context, config(args.size).d_model, torch.float32)
    print(
        f"{args.size} context={args.context} batch={args.batch_size} {args.mode} {args.precision} "
        f"attention={args.attention}: {args.rounds} recorded round(s) after {args.warmup} warm-up -> {args.out}"
    )
    print(summary.format())
    print(
        f"torch counters: max_memory_allocated {format_bytes(recording.max_allocated_bytes)}, "
        f"requested peak {format_bytes(recording.max_requested_bytes)}"
        + ("  (trace truncated: raise max_entries)" if recording.truncated else "")
    )
    print(
        f"residual stream (B, T, d) fp32 = {format_bytes(residual)} ({residual} bytes): "
        f"{summary.alloc_counts.get(residual, 0)} allocations of exactly that size in the trace"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
