"""Memory snapshots: the parser against a simulated caching allocator, and (GPU) real recordings.

`FakeAllocator` runs a program of allocs/frees/empty_cache calls, knows the true bytes allocated at
every moment, and emits what torch's allocator would: trace events while recording is on (requested sizes,
free_requested then free_completed, segment events) and the final segments/blocks (512-rounded block sizes,
requested sizes, stacks only for blocks allocated while recording).  `summarize` sees only that snapshot;
the reference answers come from the simulation's ground truth.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs336_systems.tools import memory
from cs336_systems.tools.memory import Frame

MiB = 2**20
SEGMENT = 256 * MiB  # one allocation per segment slot: the layout does not matter to the parser

PLUMBING = [
    {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1775, "name": "_call_impl"},
    {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1764, "name": "_wrapped_call_impl"},
    {"filename": "/usr/lib/python3.11/site-packages/_pytest/python.py", "line": 159, "name": "pytest_pyfunc_call"},
    {"filename": "/usr/lib/python3.11/runpy.py", "line": 88, "name": "_run_code"},
]


def cpp(name: str) -> dict:
    return {"filename": "??", "line": 0, "name": name}


def site_frames(site: int) -> list[dict]:
    """A stack as the allocator stores it, innermost first: C++ frames, the Python call site, plumbing."""
    return [
        cpp("c10::cuda::CUDACachingAllocator::malloc"),
        cpp("at::native::empty_cuda"),
        {"filename": f"/work/main/cs336_systems/site{site}.py", "line": 10 + site, "name": f"op{site}"},
        *PLUMBING,
    ]


def round512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


class FakeAllocator:
    def __init__(self, device: int = 0, base: int = 0x7F00_0000_0000) -> None:
        self.device = device
        self.next_addr = base
        self.blocks: dict[int, dict | None] = {}  # segment address -> live block or None (free, cached)
        self.free_slots: list[int] = []
        self.recording = False
        self.trace: list[dict] = []
        self.allocated = 0  # ground truth: requested bytes live
        self.reserved = 0
        self.live: dict[int, tuple[int, int | None, bool]] = {}  # addr -> (size, site, allocated_while_recording)
        # Ground truth after each trace event (and when recording started), for the references.
        self.start_allocated = self.start_reserved = 0
        self.after: list[tuple[int, int, Counter]] = []  # (allocated, reserved, live multiset) per event

    def _event(self, action: str, addr: int, size: int, frames: list[dict]) -> None:
        if self.recording:
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames,
                               "device_free": 0} if action == "oom" else
                              {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames})
            self.after.append((self.allocated, self.reserved, Counter(self.live.values())))

    def start_recording(self) -> None:
        self.recording = True
        self.start_allocated, self.start_reserved = self.allocated, self.reserved
        self.start_live = Counter(self.live.values())

    def alloc(self, size: int, site: int) -> int:
        if self.free_slots:
            addr = self.free_slots.pop()
        else:
            addr, self.next_addr = self.next_addr, self.next_addr + SEGMENT
            self.reserved += SEGMENT
            self.blocks[addr] = None
            self._event("segment_alloc", addr, SEGMENT, [])
        frames = site_frames(site)
        self.blocks[addr] = {"size": size, "frames": frames if self.recording else []}
        self.allocated += size
        self.live[addr] = (size, site, self.recording)
        self._event("alloc", addr, size, frames)
        return addr

    def free(self, addr: int) -> None:
        size = self.blocks[addr]["size"]
        self.blocks[addr] = None
        self.allocated -= size
        del self.live[addr]
        free_stack = [{"filename": "/work/main/cs336_systems/train.py", "line": 99, "name": "zero_grad"}]
        self._event("free_requested", addr, size, free_stack)
        self._event("free_completed", addr, size, free_stack)
        self.free_slots.append(addr)

    def empty_cache(self) -> None:
        for addr in self.free_slots:
            del self.blocks[addr]
            self.reserved -= SEGMENT
            self._event("segment_free", addr, SEGMENT, [])
        self.free_slots = []

    def snapshot(self) -> dict:
        segments = []
        for addr, block in sorted(self.blocks.items()):
            if block is None:
                blocks = [{"address": addr, "size": SEGMENT, "requested_size": 0, "state": "inactive", "frames": []}]
            else:
                used = round512(block["size"])
                blocks = [
                    {"address": addr, "size": used, "requested_size": block["size"],
                     "state": "active_allocated", "frames": block["frames"]},
                    {"address": addr + used, "size": SEGMENT - used, "requested_size": 0,
                     "state": "inactive", "frames": []},
                ]
            segments.append({
                "device": self.device, "address": addr, "total_size": SEGMENT, "stream": 0,
                "segment_type": "large", "segment_pool_id": (0, 0),
                "allocated_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                "requested_size": block["size"] if block else 0, "blocks": blocks,
            })
        traces: list[list] = [[] for _ in range(self.device + 1)]
        traces[self.device] = list(self.trace)
        return {"segments": segments, "device_traces": traces}


# --------------------------------------------------------------------------------------------------------
# The parser against the simulation (property test)
# --------------------------------------------------------------------------------------------------------

SIZES = [512, 1000, 4096, 5 * MiB, 5 * MiB + 3, 128 * MiB]
op = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from(SIZES), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("empty_cache")),
)


def run_program(before, after) -> FakeAllocator:
    """Run ``before``, turn recording on, run ``after``."""
    fake = FakeAllocator()
    for i, o in enumerate([*before, *after]):
        if i == len(before):
            fake.start_recording()
        if o[0] == "alloc":
            fake.alloc(o[1], o[2])
        elif o[0] == "free" and fake.live:
            fake.free(sorted(fake.live)[o[1] % len(fake.live)])
        elif o[0] == "empty_cache":
            fake.empty_cache()
    if not fake.recording:
        fake.start_recording()
    return fake


def reference(fake: FakeAllocator, cut: int):
    """Peak allocated / reserved, the peak's event index and what was live there, for trace[cut:]."""
    before = (fake.start_allocated, fake.start_reserved, fake.start_live) if cut == 0 else fake.after[cut - 1]
    states = [before] + fake.after[cut:]
    peak = max(s[0] for s in states)
    first = next(i for i, s in enumerate(states) if s[0] == peak)  # 0 means "before the first event"
    return peak, max(s[1] for s in states), first - 1, states[first][2]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(op, max_size=15), after=st.lists(op, max_size=30))
def test_replay_matches_the_simulated_allocator(before, after):
    fake = run_program(before, after)
    summary = memory.summarize(fake.snapshot(), top=100)
    peak, peak_reserved, peak_event, live = reference(fake, cut=0)
    assert summary.peak_bytes == peak
    assert summary.peak_event == peak_event
    assert summary.peak_reserved_bytes == peak_reserved
    assert summary.baseline_bytes == fake.start_allocated
    assert summary.final_bytes == fake.allocated
    assert summary.final_reserved_bytes == fake.reserved
    assert summary.n_events == len(fake.trace)
    assert summary.alloc_counts == dict(Counter(e["size"] for e in fake.trace if e["action"] == "alloc"))
    # What was live at the peak: sizes, call sites (only known for allocations made while recording).
    got = Counter()
    for group in summary.largest:
        site = int(group.frames[0].name[2:]) if group.frames else None
        got[group.size, site, group.before_recording] += group.count
    want = Counter()
    for (size, site, recorded), n in live.items():
        # An allocation alive at the peak predates the recording iff it was not made while recording.
        want[size, site if recorded else None, not recorded] += n
    assert got == want
    assert [g.size for g in summary.largest] == sorted((g.size for g in summary.largest), reverse=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(op, max_size=15), after=st.lists(op, max_size=30), cut=st.integers(0, 100),
       completed_only=st.booleans())
def test_replay_of_a_truncated_trace_or_without_free_requested(before, after, cut, completed_only):
    """A ring buffer that overflowed keeps only the newest events; some traces skip free_requested."""
    fake = run_program(before, after)
    cut = min(cut, len(fake.trace))
    if cut < len(fake.trace) and fake.trace[cut]["action"] == "free_completed":
        # A cut between a free's request and its completion is undecidable from the kept events alone
        # (a lone free_completed reads the same as in a trace that never records free_requested), so
        # the ring buffer is taken to end on event pairs, as it does for back-to-back frees.
        cut += 1
    snapshot = fake.snapshot()
    snapshot["device_traces"][0] = fake.trace[cut:]
    if completed_only:
        # Frees are requested and completed back to back here, so dropping one of the pair keeps the truth.
        snapshot["device_traces"][0] = [e for e in snapshot["device_traces"][0] if e["action"] != "free_requested"]
    summary = memory.summarize(snapshot, top=100)
    peak, peak_reserved, _, live = reference(fake, cut)
    assert summary.peak_bytes == peak
    assert summary.peak_reserved_bytes == peak_reserved
    want_sizes = Counter()
    for (size, _site, _recorded), n in live.items():
        want_sizes[size] += n
    got_sizes = Counter()
    for group in summary.largest:
        got_sizes[group.size] += group.count
    assert got_sizes == want_sizes


def test_allocations_from_before_the_recording_that_are_freed_during_it():
    fake = FakeAllocator()
    grads = fake.alloc(1000, 0)
    fake.alloc(4096, 0)
    fake.start_recording()
    fake.free(grads)  # e.g. zero_grad(set_to_none=True) in the first recorded step
    fake.alloc(512, 1)
    fake.alloc(700, 1)
    summary = memory.summarize(fake.snapshot(), top=100)
    assert (summary.baseline_bytes, summary.peak_bytes, summary.peak_event, summary.final_bytes) == (
        5096, 5308, 4, 5308)
    assert [(g.size, g.count, g.before_recording) for g in summary.largest] == [
        (4096, 1, True), (700, 1, False), (512, 1, False)]
    # Without free_requested events the free_completed ones stand in.
    snapshot = fake.snapshot()
    snapshot["device_traces"][0] = [e for e in snapshot["device_traces"][0] if e["action"] != "free_requested"]
    assert memory.summarize(snapshot).peak_bytes == 5308


# --------------------------------------------------------------------------------------------------------
# The report: largest allocations and their frames
# --------------------------------------------------------------------------------------------------------


def attention_program(n_layers: int = 2) -> FakeAllocator:
    """Parameters, then a forward pass whose per-layer softmax scores (128 MiB) are saved for backward."""
    fake = FakeAllocator()
    for _ in range(3):
        fake.alloc(40 * MiB, 0)  # parameters: allocated before recording
    fake.start_recording()
    softmax_stack = [
        cpp("at::native::softmax_cuda"),
        {"filename": "/work/main/cs336_systems/attention/naive.py", "line": 41, "name": "naive_attention"},
        *PLUMBING[:2],
        {"filename": "/work/main/cs336_systems/model.py", "line": 131, "name": "forward"},
        *PLUMBING,
    ]
    for layer in range(n_layers):
        qkv = fake.alloc(15 * MiB, 1)
        scores = fake.alloc(128 * MiB, 2)  # QK^T, freed once softmax has its output
        fake.blocks[fake.alloc(128 * MiB, 9)]["frames"] = softmax_stack
        fake.trace[-1]["frames"] = softmax_stack
        fake.free(scores)
        fake.free(qkv)
    return fake


def test_largest_allocations_name_their_source():
    fake = attention_program(n_layers=2)
    summary = memory.summarize(fake.snapshot(), top=3)
    assert summary.baseline_bytes == 120 * MiB
    # Peak: parameters + layer 0's softmax output + layer 1's qkv, scores and softmax output.
    assert summary.peak_bytes == 120 * MiB + 128 * MiB + 15 * MiB + 2 * 128 * MiB
    first = summary.largest[0]
    assert (first.size, first.count, first.before_recording) == (128 * MiB, 2, False)
    # Innermost useful frames: the attention code and the model line calling it; C++ frames, module
    # call wrappers, pytest and runpy are filtered out.
    assert first.frames == (
        Frame("/work/main/cs336_systems/attention/naive.py", 41, "naive_attention"),
        Frame("/work/main/cs336_systems/model.py", 131, "forward"),
    )
    second = summary.largest[1]
    assert (second.size, second.count) == (128 * MiB, 1) and second.frames[0].name == "op2"
    assert summary.largest[2].size == 40 * MiB and summary.largest[2].before_recording
    text = summary.format()
    assert "128.00 MiB x 2" in text and "attention/naive.py:41 naive_attention" in text
    assert "allocated before recording" in text and "peak allocated" in text


def test_top_frames_filtering():
    python_site = {"filename": "/work/main/cs336_systems/model.py", "line": 7, "name": "forward"}
    assert memory.top_frames([cpp("at::native::mm"), python_site, *PLUMBING]) == (
        Frame(python_site["filename"], 7, "forward"),
    )
    # Torch's own Python frames are kept: they say which op allocated.
    functional = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 2100, "name": "softmax"}
    assert memory.top_frames([functional, python_site], n=1) == (Frame(functional["filename"], 2100, "softmax"),)
    # Backward-pass allocations have no Python frames: fall back to autograd node / ATen kernel names.
    backward = [cpp("c10::cuda::CUDACachingAllocator::malloc"),
                cpp("at::native::softmax_backward_cuda"),
                cpp("torch::autograd::generated::SoftmaxBackward0::apply"), cpp("PyEval_EvalFrame")]
    assert [f.name for f in memory.top_frames(backward)] == [
        "at::native::softmax_backward_cuda", "torch::autograd::generated::SoftmaxBackward0::apply"]
    assert memory.top_frames([]) == ()
    with pytest.raises(ValueError, match="stack frame"):
        memory.top_frames([{"filename": "a.py"}])


def test_blocks_without_addresses_are_laid_out_from_their_segment():
    fake = FakeAllocator()
    fake.alloc(3000, 0)
    fake.start_recording()
    fake.alloc(5000, 1)
    snapshot = fake.snapshot()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            del block["address"]
    summary = memory.summarize(snapshot)
    assert (summary.baseline_bytes, summary.peak_bytes) == (3000, 8000)


def test_device_selection():
    zero, one = FakeAllocator(device=0), FakeAllocator(device=1, base=0x7E00_0000_0000)
    for fake, size in ((zero, 1000), (one, 7000)):
        fake.start_recording()
        fake.alloc(size, 0)
    snapshot = zero.snapshot()
    snapshot["segments"] += one.snapshot()["segments"]
    snapshot["device_traces"] = [zero.trace, one.trace]
    with pytest.raises(ValueError, match="pass device="):
        memory.summarize(snapshot)
    assert memory.summarize(snapshot, device=0).peak_bytes == 1000
    assert memory.summarize(snapshot, device=1).peak_bytes == 7000
    with pytest.raises(ValueError, match="device"):
        memory.summarize(snapshot, device=-1)
    empty = memory.summarize({"segments": [], "device_traces": []})
    assert (empty.peak_bytes, empty.n_events, empty.largest) == (0, 0, ())


# --------------------------------------------------------------------------------------------------------
# Malformed input
# --------------------------------------------------------------------------------------------------------


def small_snapshot() -> dict:
    fake = FakeAllocator()
    fake.alloc(4096, 0)
    fake.start_recording()
    a = fake.alloc(1000, 1)
    fake.free(a)
    fake.alloc(2000, 2)
    return fake.snapshot()


def corrupt(edit):
    snapshot = small_snapshot()
    edit(snapshot)
    return snapshot


@pytest.mark.parametrize(
    "snapshot, match",
    [
        ([], "is a dict"),
        ({"segments": []}, "lacks key"),
        ({"segments": {}, "device_traces": []}, "must be lists"),
        ({"segments": [], "device_traces": [{}]}, "per-device event lists"),
        ({"segments": [3], "device_traces": []}, "list of dicts"),
        (corrupt(lambda s: s["device_traces"][0][1].pop("action")), "lacks 'action'"),
        (corrupt(lambda s: s["device_traces"][0][1].update(action="teleport")), "unknown action"),
        (corrupt(lambda s: s["device_traces"][0][1].update(size=-5)), "non-negative integer"),
        # the same address allocated twice without a free in between
        (corrupt(lambda s: s["device_traces"][0].insert(2, dict(s["device_traces"][0][1]))), "already allocated"),
        # an address freed twice
        (corrupt(lambda s: s["device_traces"][0].insert(3, dict(s["device_traces"][0][2]))), "twice"),
        # the trace says the last allocation is live, the segments say it is not
        (corrupt(lambda s: s["segments"][-1]["blocks"][0].update(state="inactive")), "not active_allocated"),
        (corrupt(lambda s: s["segments"][0]["blocks"][0].pop("state")), "lacks 'size' or 'state'"),
        (corrupt(lambda s: s["segments"][0].pop("blocks")), "lacks 'blocks'"),
    ],
)
def test_malformed_snapshots_raise_value_error(snapshot, match):
    with pytest.raises(ValueError, match=match):
        memory.summarize(snapshot)


def test_summarize_rejects_bad_options():
    with pytest.raises(ValueError, match="top"):
        memory.summarize(small_snapshot(), top=0)
    with pytest.raises(ValueError, match="frames"):
        memory.summarize(small_snapshot(), frames=0)


def test_load_snapshot_round_trip_and_errors(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(small_snapshot()))
    assert memory.summarize(memory.load_snapshot(path)) == memory.summarize(small_snapshot())
    with pytest.raises(FileNotFoundError, match="no snapshot file"):
        memory.load_snapshot(tmp_path / "missing.pickle")
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="not a memory snapshot pickle"):
        memory.load_snapshot(garbage)
    wrong = tmp_path / "list.pickle"
    wrong.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match="is a dict"):
        memory.load_snapshot(wrong)
    with pytest.raises(TypeError, match="path"):
        memory.load_snapshot(3)


def test_record_snapshot_argument_errors(tmp_path):
    def step():
        return None

    good = dict(warmup=0, rounds=1, path=tmp_path / "s.pickle", device="cuda")
    with pytest.raises(ValueError, match="does not exist"):
        memory.record_snapshot(step, **{**good, "path": tmp_path / "no" / "such" / "s.pickle"})
    with pytest.raises(ValueError, match="is a directory"):
        memory.record_snapshot(step, **{**good, "path": tmp_path})
    with pytest.raises(ValueError, match="rounds"):
        memory.record_snapshot(step, **{**good, "rounds": 0})
    with pytest.raises(ValueError, match="warmup"):
        memory.record_snapshot(step, **{**good, "warmup": -1})
    with pytest.raises(ValueError, match="stacks"):
        memory.record_snapshot(step, **{**good, "stacks": "cpp"})
    with pytest.raises(TypeError, match="callable"):
        memory.record_snapshot(None, **good)


def test_record_snapshot_on_cpu_is_a_clear_runtime_error(tmp_path, capsys):
    calls = []
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        memory.record_snapshot(lambda: calls.append(1), warmup=1, rounds=1, path=tmp_path / "s.pickle", device="cpu")
    assert calls == [] and not (tmp_path / "s.pickle").exists()
    # The CLI refuses before it builds the model: usage errors (exit 2) naming the problem.
    for argv, message in ((["--device", "cpu"], "not a CUDA device"), (["--device", "bogus"], "bogus"),
                          (["--out", str(tmp_path / "missing" / "s.pickle")], "does not exist"),
                          (["--out", str(tmp_path)], "is a directory")):
        argv = ["--size", "2.7B", "--out", str(tmp_path / "s.pickle"), *argv]
        with pytest.raises(SystemExit) as exc:
            memory.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    # Bad counts are usage errors (exit 2, the argument named), also before any model is built.
    for flag, value in (("--rounds", "0"), ("--warmup", "-1"), ("--top", "0"), ("--context", "x")):
        with pytest.raises(SystemExit) as exc:
            memory.main(["--size", "2.7B", flag, value, "--device", "cpu", "--out", str(tmp_path / "s.pickle")])
        assert exc.value.code == 2, flag


def test_residual_stream_bytes():
    # 2.7B (d_model 2560), batch 4, context 128: 4 * 128 * 2560 floats = 5 MiB.
    assert memory.residual_stream_bytes(4, 128, 2560, torch.float32) == 5 * MiB
    assert memory.residual_stream_bytes(4, 512, 2560, torch.bfloat16) == 10 * MiB
    assert memory.residual_stream_bytes(1, 1, 3, torch.float64) == 24
    with pytest.raises(ValueError, match="context"):
        memory.residual_stream_bytes(4, 0, 2560, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        memory.residual_stream_bytes(4, 128, 2560, "float32")


def test_format_bytes():
    assert memory.format_bytes(100) == "100 B"
    assert memory.format_bytes(3 * 2**10) == "3.00 KiB"
    assert memory.format_bytes(128 * MiB) == "128.00 MiB"
    assert memory.format_bytes(int(2.5 * 2**30)) == "2.50 GiB"


# --------------------------------------------------------------------------------------------------------
# Real recordings (GPU)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["forward", "train-step"])
def test_real_snapshot_of_the_tiny_model(tmp_path, mode):
    from cs336_systems.bench.workloads import lm as workloads
    from cs336_systems.model import config

    batch, context, rounds = 2, 32, 2
    step = workloads.lm_step(size="tiny", context=context, batch_size=batch, mode=mode,
                             attention="naive", device="cuda")
    path = tmp_path / f"{mode}.pickle"
    recording = memory.record_snapshot(step, warmup=2, rounds=rounds, path=path, device="cuda")
    assert path.is_file() and not recording.truncated
    assert recording.snapshot["device_traces"][recording.device], "no events recorded"
    summary = memory.summarize(memory.load_snapshot(path), device=recording.device, top=50)
    # The replay reproduces torch's own requested-bytes peak for the window, and is below the rounded one.
    assert summary.peak_bytes == recording.max_requested_bytes
    assert summary.peak_bytes <= recording.max_allocated_bytes
    # The parameters (and in train-step the optimizer state) predate the recording.
    assert summary.baseline_bytes > 0
    # Every round builds the embedding output and two residual sums per layer, all (B, T, d) float32.
    cfg = config("tiny")
    residual = memory.residual_stream_bytes(batch, context, cfg.d_model, torch.float32)
    assert summary.alloc_counts.get(residual, 0) >= rounds * (1 + 2 * cfg.n_layers)
    # Some live allocation at the peak is attributed to the project's code.
    project = [f for g in summary.largest for f in g.frames if "cs336_systems" in f.filename]
    assert project, summary.format()


@pytest.mark.gpu
def test_cli_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "cli.pickle"
    code = memory.main(["--size", "tiny", "--context", "32", "--batch-size", "2", "--mode", "train-step",
                        "--precision", "bf16", "--warmup", "1", "--out", str(out)])
    assert code == 0 and out.is_file()
    text = capsys.readouterr().out
    assert "peak allocated" in text and "residual stream" in text
    assert "0 allocations of exactly that size" not in text
