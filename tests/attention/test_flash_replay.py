"""Replayed launches (flash_replay, flash_triton's eager path): the recorder on stand-in kernels (CPU), and on
a GPU replayed calls against the ordinary launch path, bit for bit, with everything that must change the
recorded signature changed in turn."""

import dataclasses
import inspect

import pytest
import torch
from attention_reference import random_qkv, token_major_view
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cs336_systems import switches
from cs336_systems.attention import flash_calls
from cs336_systems.attention import flash_triton
from cs336_systems.attention import flash_replays
from cs336_systems.attention import plan as planning
from cs336_systems.attention.flash_triton import REPLAY_ENV, FlashAttentionTriton
from cs336_systems.attention.kernels import replay as flash_replay
from cs336_systems.attention.kernels.replay import Recorder
from triton.tools.tensor_descriptor import TensorDescriptor


class _Compiled:
    """Stands in for Triton's CompiledKernel: `run` keeps what it was launched with."""

    def __init__(self):
        self.function, self.packed_metadata, self.launched = "fn", "meta", []

    def run(self, *args):
        self.launched.append(args)


class _Kernel:
    """Stands in for a @triton.jit function of (X, Y, n, stride, SCALE, BLOCK: constexpr = 16)."""

    def __init__(self):
        def kernel(X, Y, n, stride, SCALE, BLOCK=16):
            pass
        self.signature = inspect.signature(kernel)
        self.arg_names = list(self.signature.parameters)
        self.__name__ = "kernel"
        self.compiled = _Compiled()
        self.jit_launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled
        return launch


def test_recorder_replays_each_launch_with_the_new_tensors_in_their_slots():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    recorder(kernel)[(3, 2)](x, y, 32, 8, SCALE=0.5, num_warps=4)  # num_warps: a launch option, not an argument
    recorder(kernel)[(5,)](y, x, 32, 8, 0.25, BLOCK=32)
    assert recorder.ok and len(kernel.jit_launches) == 2  # recording launches through the JIT
    assert recorder.slots == (x, y)
    x2, y2 = torch.ones(4, 8), torch.ones(4, 8)
    recorder.replay((x2, y2), stream=7)
    first, second = kernel.compiled.launched
    assert first[:7] == (3, 2, 1, 7, "fn", "meta", None) and first[7:9] == (None, None)
    assert first[9] is x2 and first[10] is y2 and first[11:] == (32, 8, 0.5, 16)
    assert second[:3] == (5, 1, 1) and second[9] is y2 and second[10] is x2 and second[11:] == (32, 8, 0.25, 32)


def test_slots_that_share_memory_take_the_first():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, x.view(4, 8), y))  # as k is v: the key records the sharing
    recorder(kernel)[(1,)](x.view(4, 8), y, 32, 8, 1.0)
    x2, y2 = torch.ones(4, 8), torch.ones(4, 8)
    recorder.replay((x2, x2, y2), stream=0)
    assert recorder.ok and kernel.compiled.launched[0][9] is x2 and kernel.compiled.launched[0][10] is y2


def test_descriptors_over_slots_are_rebuilt_on_the_new_tensors():
    """A host-side TMA descriptor whose base is a slot, or a view of one at its address (the portable
    launchers' 2-D K/V descriptors), replays as a copy of the recorded one on the new slot tensor: same
    shape, strides and box; the recording itself keeps no tensor."""
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    over_y = TensorDescriptor.from_tensor(y, [2, 8])
    over_x_view = TensorDescriptor(x.view(32), [32], [1], [16])
    recorder(kernel)[(1,)](x, over_y, 32, over_x_view, 1.0)
    assert recorder.ok, recorder.why
    (recorded,) = recorder.launches
    assert all(template.base is None for _, _, template in recorded.desc_of)
    x2, y2 = torch.ones(4, 8), torch.ones(4, 8)
    recorder.replay((x2, y2), stream=0)
    args = kernel.compiled.launched[0][9:]
    assert args[0] is x2 and args[2] == 32 and args[4] == 1.0
    for replayed, recorded_desc, base in ((args[1], over_y, y2), (args[3], over_x_view, x2)):
        assert type(replayed) is TensorDescriptor and replayed.base is base
        assert (replayed.shape, replayed.strides, replayed.block_shape) == (
            recorded_desc.shape, recorded_desc.strides, recorded_desc.block_shape)
    assert over_y.base is y  # the recorded call's own descriptor is left as it was


def test_a_descriptor_over_other_memory_is_refused():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    workspace = torch.zeros(4, 8)
    recorder(kernel)[(1,)](x, TensorDescriptor.from_tensor(workspace, [2, 8]), 32, 8, 1.0)
    assert not recorder.ok and "descriptor Y" in recorder.why
    recorder = Recorder((x, y))
    recorder(kernel)[(1,)](x, TensorDescriptor.from_tensor(y[1:], [2, 8]), 32, 8, 1.0)  # a view at another address
    assert not recorder.ok and not recorder.launches


# TMA metadata of two descriptors, as Triton 3.6 keeps it per descriptor (`make_tensordesc_arg` reads these keys)
M128, M64 = {"swizzle": 128, "fp4_padded": False}, {"swizzle": 64, "fp4_padded": False}


class _Launcher:
    """Stands in for Triton 3.6's CudaLauncher of a kernel with host descriptors: `launch` is a closure over
    the C launcher, the descriptors' positions and their metadata, as `wrap_handle_tensordesc` builds it."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, tensordesc_indices, tensordesc_meta):
        self.direct_calls = []

        def launcher(*args):
            self.direct_calls.append(args)

        def inner(*args):
            return launcher, tensordesc_indices, tensordesc_meta

        self.launch = inner

    def __call__(self, *args):
        raise AssertionError("a direct replay does not go through the launcher's wrapper")


def _direct_setup(monkeypatch, metas):
    """A recorded launch of kernel(X, Y: descriptor, n, stride: descriptor, SCALE) whose compiled launcher has
    Triton 3.6's form; `_encode` counts its calls and returns a tagged map."""
    monkeypatch.setattr(flash_replay, "DIRECT_TRITON", True)
    encoded = []

    def encode(descriptor, meta):
        encoded.append((descriptor.base.data_ptr(), meta))
        return [("map", descriptor.base.data_ptr(), meta), *descriptor.shape, *descriptor.strides]

    monkeypatch.setattr(flash_replay, "_encode", encode)
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    kernel.compiled.run = _Launcher({1, 3}, metas)
    recorder(kernel)[(3, 2)](x, TensorDescriptor.from_tensor(y, [2, 8]), 32,
                             TensorDescriptor(x.view(32), [32], [1], [16]), 0.5)
    assert recorder.ok, recorder.why
    return kernel, recorder, encoded


def test_direct_replays_hand_the_c_launcher_pre_expanded_arguments(monkeypatch):
    """On Triton 3.6 a replay skips the launcher's per-launch descriptor expansion: the C launcher gets the
    grid, stream, launch options and metadata, then each argument, descriptors expanded as the wrapper
    expands them (a CUtensorMap then shape and strides; a descriptor lowered to a pointer as its base, shape
    and strides twice and the padding flag), with the new slot tensors in place."""
    kernel, recorder, encoded = _direct_setup(monkeypatch, [M128, None])
    (recorded,) = recorder.launches
    assert recorded.direct is not None
    x2, y2 = torch.ones(4, 8), torch.ones(4, 8)
    recorder.replay((x2, y2), stream=7)
    (args,) = kernel.compiled.run.direct_calls
    assert args[:13] == (3, 2, 1, 7, "fn", False, True, None, None, "meta", None, None, None)
    rest = list(args[13:])
    assert rest[0] is x2
    assert rest[1:6] == [("map", y2.data_ptr(), M128), 4, 8, 8, 1]  # Y: map, shape, strides
    assert rest[6] == 32
    assert rest[7] is x2 and rest[8:13] == [32, 1, False, 32, 1]  # stride: base, shape, strides, padding, again
    assert rest[13:] == [0.5, 16]
    assert encoded == [(y2.data_ptr(), M128)] and not kernel.compiled.launched


def test_direct_replays_encode_each_address_once(monkeypatch):
    kernel, recorder, encoded = _direct_setup(monkeypatch, [M128, M64])
    x2, y2 = torch.ones(4, 8), torch.ones(4, 8)
    for _ in range(3):
        recorder.replay((x2, y2), stream=0)
    assert len(encoded) == 2 and len(kernel.compiled.run.direct_calls) == 3
    x3 = torch.ones(4, 8)
    recorder.replay((x3, y2), stream=0)
    assert encoded[2:] == [(x3.data_ptr(), M64)]  # a new address: encoded, the other one reused
    maps = [call[14] for call in kernel.compiled.run.direct_calls]  # Y's map: the same object every time
    assert all(m is maps[0] for m in maps)
    monkeypatch.setattr(flash_replay, "MAX_MAPS", 2)
    x4 = torch.ones(4, 8)
    recorder.replay((x4, y2), stream=0)  # the table holds x2's and x3's maps: at the limit it starts over
    recorder.replay((x3, y2), stream=0)
    assert encoded[3:] == [(x4.data_ptr(), M64), (x3.data_ptr(), M64)]


@pytest.mark.parametrize("case", ["scratch", "other wrapper", "other descriptors", "fp4", "release"])
def test_launchers_of_another_form_keep_the_ordinary_replay(monkeypatch, case):
    monkeypatch.setattr(flash_replay, "DIRECT_TRITON", case != "release")
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    run = _Launcher({1}, [M128])
    if case == "scratch":
        run.global_scratch_size = 256
    elif case == "other wrapper":
        run.launch = lambda *args: None
    elif case == "other descriptors":
        run = _Launcher({3}, [M128])  # the wrapper expands a position that holds no descriptor
    elif case == "fp4":
        run = _Launcher({1}, [{"swizzle": 128, "fp4_padded": True}])  # the wrapper doubles its last dim
    kernel.compiled.run = run
    recorder(kernel)[(1,)](x, TensorDescriptor.from_tensor(y, [2, 8]), 32, 8, 1.0)
    assert recorder.ok and recorder.launches[0].direct is None


@pytest.mark.parametrize("case", ["workspace", "descriptor", "grid function", "other strides",
                                  "still compiling", "interpreted"])
def test_recorder_refuses_launches_it_cannot_replay(case):
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel = _Kernel()
    slots, args, grid = (x, y), (x, y, 32, 8, 1.0), (1,)
    if case == "workspace":
        args = (x, torch.zeros(4, 8), 32, 8, 1.0)
    elif case == "descriptor":
        args = (x, y, object(), 8, 1.0)
    elif case == "grid function":
        grid = lambda meta: (1,)
    elif case == "other strides":
        args = (x.t(), y, 32, 8, 1.0)
        slots = (torch.as_strided(x, (8, 4), (4, 1)), y)  # x.t()'s memory, dtype and shape; other strides
    elif case == "still compiling":
        kernel.compiled.result = lambda: None
    elif case == "interpreted":
        kernel.compiled = None
    recorder = Recorder(slots)
    recorder(kernel)[grid](*args)
    assert not recorder.ok and recorder.why and not recorder.launches


def test_kernels_with_jit_pre_run_hooks_are_not_recorded():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    kernel, recorder = _Kernel(), Recorder((x, y))
    kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    recorder(kernel)[(1,)](x, y, 32, 8, 1.0)
    assert not recorder.ok and "pre-run hooks" in recorder.why


def test_launch_hooks_keep_calls_on_the_ordinary_path(monkeypatch):
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Runtime:
        launch_enter_hook, launch_exit_hook = Chain([]), Chain([])

    class Knobs:
        runtime = Runtime

    monkeypatch.setattr(flash_replay, "_knobs", Knobs)
    assert flash_replay.hooks_idle()
    monkeypatch.setattr(Runtime, "launch_exit_hook", Chain([print]))
    assert not flash_replay.hooks_idle()
    monkeypatch.setattr(Runtime, "launch_exit_hook", None)
    assert flash_replay.hooks_idle()


def test_switches_follow_the_environment(monkeypatch):
    for name in flash_replays.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert flash_replays.switch_values() == (None,) * len(flash_replays.SWITCHES)
    monkeypatch.setenv("CS336_FLASH_TMA", "0")
    monkeypatch.setenv(REPLAY_ENV, "0")
    switches = flash_replays.switch_values()
    values = {name: value for name, value in zip(flash_replays.SWITCHES, switches) if value is not None}
    assert {name: (v.decode() if isinstance(v, bytes) else v) for name, v in values.items()} == {
        "CS336_FLASH_TMA": "0", REPLAY_ENV: "0"}
    assert flash_replays.replays_off(switches[0])


def test_every_switch_the_launch_path_reads_is_in_the_signature():
    import pathlib
    import re

    root = pathlib.Path(flash_triton.__file__).parent
    read = set()
    for path in [*sorted(root.glob("flash_*.py")), root / "plan.py", *sorted((root / "kernels").rglob("*.py"))]:
        read |= set(re.findall(r'"(CS336_FLASH_[A-Z0-9_]+)"', path.read_text()))
    assert read | {"TRITON_INTERPRET", "TRITON_DEBUG"} == set(flash_replays.SWITCHES)
    # and the registry marks exactly those as part of a recorded call's signature
    assert read == set(switches.KERNEL_SWITCHES)


def test_recorded_table_keeps_no_tensors_and_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(flash_replays, "recorded", {})
    monkeypatch.setattr(flash_replays, "MAX_RECORDED", 3)
    x = torch.zeros(2)
    refused = Recorder((x,))
    refused.refuse("a workspace")
    flash_replays.remember(("a",), refused)
    kept = Recorder((x,))
    kept(_Kernel())[(1,)](x, x.clone(), 1, 1, 1.0)  # refused too: the second tensor is no slot
    flash_replays.remember(("b",), kept)
    good = Recorder((x, torch.ones(2)))
    good(_Kernel())[(1,)](good.slots[0], good.slots[1], 1, 1, 1.0)
    flash_replays.remember(("c",), good)
    assert flash_replays.recorded == {("a",): None, ("b",): None, ("c",): good} and good.slots == ()
    flash_replays.remember(("d",), None)
    assert flash_replays.recorded == {("d",): None}


def test_interpreted_cpu_or_other_calls_are_never_recorded():
    q = torch.zeros(1, 1, 4, 16)
    assert flash_replays.replay_key("fwd", True, (q, q, q)) is None
    assert flash_replays.replay_key("fwd", True, (q, [1.0], q)) is None  # no AttributeError: validation names it


# ---------------------------------------------------------------------------------------------------------
# GPU: replayed calls against the ordinary path


def _outputs(q, k, v, is_causal, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = FlashAttentionTriton.apply(q, k, v, is_causal)
    o.backward(grad_out)
    return [o.detach(), q.grad, k.grad, v.grad]


def _ordinary(monkeypatch, *args):
    with monkeypatch.context() as patch:
        patch.setenv(REPLAY_ENV, "0")
        return _outputs(*args)


def _replays(monkeypatch):
    """Count Recorder.replay calls."""
    count = []
    real = Recorder.replay
    monkeypatch.setattr(Recorder, "replay", lambda self, *a: count.append(1) or real(self, *a))
    return count


def _assert_replays_match_the_ordinary_path(q, k, v, is_causal, grad_out, calls=3, table=None):
    """Run the call with replays off, then ``calls`` times from an empty table: each result equals the
    ordinary path's bit for bit, and each call after the first replays every signature the first recorded.
    Returns the ordinary results and the number of replays; ``table`` (a dict) receives the recordings.
    The fused Hopper backward stays off: its dQ is summed in run-dependent order, so no two of its calls
    are bit-equal (its replays: test_flash_hopper's test_gpu_fused_backward_is_recorded_and_replayed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CS336_FLASH_FUSED_BWD", "0")
        expected = _ordinary(patch, q, k, v, is_causal, grad_out)
        patch.delenv(REPLAY_ENV, raising=False)
        patch.setattr(flash_replays, "recorded", {} if table is None else table)
        count = _replays(patch)
        for call in range(calls):
            for got, want in zip(_outputs(q, k, v, is_causal, grad_out), expected):
                assert torch.equal(got, want)
            replayable = sum(plan is not None for plan in flash_replays.recorded.values())
            assert len(count) == call * replayable, (call, len(count), flash_replays.recorded)
    return expected, len(count)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([(4, 4), (8, 2), (3, 1)]), nq=st.integers(1, 1100), nk=st.integers(1, 1100),
    d=st.sampled_from([16, 32, 64, 80, 96, 128]), is_causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), token_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(heads=(25, 25), nq=512, nk=512, d=64, is_causal=True, dtype=torch.bfloat16, token_major=True, seed=0)
@example(heads=(32, 32), nq=512, nk=512, d=80, is_causal=True, dtype=torch.bfloat16, token_major=True, seed=1)
def test_gpu_replayed_calls_match_the_ordinary_path_bit_for_bit(heads, nq, nk, d, is_causal, dtype, token_major,
                                                              seed):
    """The first call of a signature records its launches and the next ones replay them: all give exactly
    the ordinary path's O, dQ, dK and dV (that path is checked against float64 elsewhere), and every
    recorded signature (forward, backward) is replayed by the next call."""
    hq, hkv = heads
    if token_major:
        q, k, v = (token_major_view(2, h, n, d, dtype, seed + i) for i, (h, n) in enumerate(((hq, nq), (hkv, nk), (hkv, nk))))
    else:
        q = random_qkv((2, hq), nq, nk, d, dtype, "cuda", seed)[0]
        _, k, v = random_qkv((2, hkv), nq, nk, d, dtype, "cuda", seed + 1)
    _assert_replays_match_the_ordinary_path(q, k, v, is_causal, torch.randn_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["3-d", "5-d", "2-d", "strided d"])
def test_gpu_other_ranks_and_layouts_replay_like_the_ordinary_path(layout):
    """(BH, N, d), (B, G, H, N, d) and (N, d) inputs, and a q whose last dim is strided (copied before the
    kernels): the replayed calls against the ordinary path, bit for bit, with the gradients in the inputs'
    shapes."""
    g = torch.Generator("cuda").manual_seed(5)
    shape = {"3-d": (24, 300, 64), "5-d": (2, 3, 4, 300, 64), "2-d": (300, 64), "strided d": (2, 4, 300, 64)}[layout]
    q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if layout == "strided d":
        q = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, device="cuda", dtype=torch.bfloat16)[..., ::2]
    grad_out = torch.randn(q.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    expected, replays = _assert_replays_match_the_ordinary_path(q, k, v, True, grad_out)
    assert [t.shape for t in expected] == [q.shape, q.shape, k.shape, v.shape]
    assert replays and replays % 2 == 0  # the second and third calls replayed the same plans


@pytest.mark.gpu
def test_gpu_a_signature_that_cannot_be_replayed_is_recorded_once(monkeypatch):
    """Forced key splits need a workspace, which a recording refuses: the signature then launches the
    ordinary way from its second call on, without being recorded again."""
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    monkeypatch.setenv("CS336_FLASH_SPLITS", "2")
    monkeypatch.setattr(flash_replays, "recorded", {})
    made = []
    real_init = Recorder.__init__
    monkeypatch.setattr(Recorder, "__init__", lambda self, slots: made.append(1) or real_init(self, slots))
    q, k, v = (token_major_view(1, 2, 700, 64, torch.float16, i) for i in range(3))
    with torch.no_grad():
        for _ in range(4):
            FlashAttentionTriton.apply(q, k, v, True)
    assert len(made) == 1 and list(flash_replays.recorded.values()) == [None]


@pytest.mark.gpu
def test_gpu_model_shapes_replay_every_launch(monkeypatch):
    """At the models' context 512 (B 4, token-major views) every launch of forward and backward is replayed
    from the second call on: one forward launch, then dQ and dK/dV (xl, d 64), or the fused backward's three
    where the plan takes it (2.7B, d 80, on the devices its rule was measured on)."""
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    for heads, d in ((25, 64), (32, 80)):
        q, k, v = (token_major_view(4, heads, 512, d, torch.bfloat16, i) for i in range(3))
        backward = 3 if _fused(q, k, v) else 2
        grad_out = torch.randn_like(q)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(flash_replays, "recorded", {})
            _outputs(q, k, v, True, grad_out)
            count = _replays(patch)
            _outputs(q, k, v, True, grad_out)
            assert len(count) == 2
            recorded = flash_replays.recorded
            assert sorted((key[0], len(plan.launches)) for key, plan in recorded.items()) == [("bwd", backward),
                                                                                               ("fwd", 1)]


def _fused(q, k, v) -> bool:
    """Whether the default plan takes the fused backward for these causal inputs on their device."""
    return planning.plan(planning.Problem.of(q, k, True, (q, k, v)), planning.Device.of(q.device)).backward == "fused"


@pytest.mark.gpu
def test_gpu_replays_on_inputs_at_new_addresses_match_the_ordinary_path(monkeypatch):
    """A replay encodes a launch's TMA descriptors once per address (Triton 3.6's direct launches): calls on
    inputs at other addresses, with the earlier inputs alive so that no address comes back, give the ordinary
    path's results bit for bit (dQ of the fused backward, where the plan takes it at d 80, within a unit in
    the last place: its float32 sums arrive in run-dependent order); at the model shapes every launch is a
    direct one on Triton 3.6."""
    for heads, d in ((25, 64), (32, 80)):
        inputs = [[token_major_view(4, heads, 512, d, torch.bfloat16, 3 * i + j) for j in range(3)]
                  for i in range(3)]
        fused = _fused(*inputs[0])
        launched = 4 if fused else 3
        grad_out = torch.randn_like(inputs[0][0])
        expected = [_ordinary(monkeypatch, *qkv, True, grad_out) for qkv in inputs]
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv(REPLAY_ENV, raising=False)
            patch.setattr(flash_replays, "recorded", {})
            count = _replays(patch)
            for qkv, want in zip(inputs, expected):
                for i, (got, ordinary) in enumerate(zip(_outputs(*qkv, True, grad_out), want)):
                    if i == 1 and fused:  # dQ of the fused backward
                        torch.testing.assert_close(got, ordinary, rtol=2 ** -7, atol=1e-3)
                    else:
                        assert torch.equal(got, ordinary)
            assert len(count) == 4  # the second and third calls replayed the forward and the backward
            launches = [launch for plan in flash_replays.recorded.values() for launch in plan.launches]
            assert len(launches) == launched
            if flash_replay.DIRECT_TRITON:
                assert all(launch.direct is not None for launch in launches)


@pytest.mark.gpu
def test_gpu_calls_without_a_graph_replay_the_functions_recording(monkeypatch):
    """The registry entry under torch.no_grad shares the Function's recordings (one signature, one table):
    its call replays the forward the Function recorded, with the same output, and compiles with fullgraph."""
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    monkeypatch.setattr(flash_replays, "recorded", {})
    q, k, v = (token_major_view(4, 25, 512, 64, torch.bfloat16, i) for i in range(3))
    with torch.no_grad():
        expected = FlashAttentionTriton.apply(q, k, v, True)
        count = _replays(monkeypatch)
        assert torch.equal(flash_triton.flash_attention(q, k, v, True), expected)
        assert len(count) == 1 and len(flash_replays.recorded) == 1
        torch._dynamo.reset()
        compiled = torch.compile(flash_triton.flash_attention, fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v, True), expected)


@pytest.mark.gpu
def test_gpu_signature_changes_take_a_new_recording(monkeypatch):
    """What the launch path decides from changes the signature: ``is_causal``, an input's alignment, aliased
    inputs, a switch (here forced key splits, which need a workspace and so are not recorded); every call
    matches the ordinary path."""
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    monkeypatch.delenv("CS336_FLASH_SPLITS", raising=False)
    monkeypatch.setenv("CS336_FLASH_TMA", "0")  # pointer loads whatever the table says: every call recordable
    monkeypatch.setattr(flash_replays, "recorded", {})
    g = torch.Generator("cuda").manual_seed(3)
    shape = (2, 16, 257, 64)  # enough programs that the forward splits no keys by default
    size = 2 * 16 * 257 * 64
    q = torch.randn(shape, generator=g, device="cuda", dtype=torch.float16)
    q_odd = torch.randn(size + 1, generator=g, device="cuda", dtype=torch.float16)[1:].view(shape)  # 2 bytes off
    k, v = (torch.randn(shape, generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
    grad_out = torch.randn_like(q)
    cases = [(q, k, v, True), (q, k, v, False), (q_odd, k, v, True), (q, k, k, True)]
    for args in cases:
        expected = _ordinary(monkeypatch, *args, grad_out)
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_outputs(*args, grad_out), expected))
    keys = [flash_replays.replay_key("fwd", c, (a, b, w)) for a, b, w, c in cases]
    assert len(set(keys)) == len(cases) and all(flash_replays.recorded[key] is not None for key in keys)
    monkeypatch.setenv("CS336_FLASH_SPLITS", "2")
    expected = _ordinary(monkeypatch, q, k, v, True, grad_out)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(_outputs(q, k, v, True, grad_out), expected))
    key = flash_replays.replay_key("fwd", True, (q, k, v))
    assert key not in keys and flash_replays.recorded[key] is None  # partials: launched the ordinary way


@pytest.mark.gpu
def test_gpu_recorded_signatures_still_refuse_bad_calls():
    """A signature seen before skips validation only for the same valid call: ``is_causal`` that is no
    bool, and double backward, are still refused."""
    q, k, v = (token_major_view(2, 4, 64, 32, torch.bfloat16, i) for i in range(3))
    for _ in range(2):
        FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    with pytest.raises(ValueError, match="is_causal must be a bool"):
        FlashAttentionTriton.apply(q, k, v, 1)
    o = FlashAttentionTriton.apply(q, k, v, True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)


@pytest.mark.gpu
def test_gpu_compiled_graphs_replay_the_custom_ops(monkeypatch):
    """A compiled graph runs the custom ops (here forced: the plan's traced path "custom_op") on plain tensors, so they
    record and replay their launches as eager calls do, under signatures of their own ("fwd op", "bwd op");
    every call's outputs match the eager ones."""
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    real_plan = flash_calls.plan_call
    monkeypatch.setattr(flash_calls, "plan_call", lambda *args, traced=False: dataclasses.replace(
        real_plan(*args, traced=traced), traced="custom_op") if traced else real_plan(*args))
    q, k, v = (token_major_view(4, 8, 512, 64, torch.bfloat16, i) for i in range(3))
    grad_out = torch.randn_like(q)
    expected = _ordinary(monkeypatch, q, k, v, True, grad_out)
    monkeypatch.setattr(flash_replays, "recorded", {})
    count = _replays(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    for _ in range(3):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = compiled(*leaves, True)
        o.backward(grad_out)
        for got, want in zip([o.detach()] + [t.grad for t in leaves], expected):
            torch.testing.assert_close(got, want)
    assert sorted(key[0] for key in flash_replays.recorded) == ["bwd op", "fwd op"]
    assert all(plan is not None for plan in flash_replays.recorded.values()) and len(count) == 4
    torch._dynamo.reset()


def test_compiled_calls_do_not_guard_on_the_recorded_table(monkeypatch):
    """A traced call never reads the table of recorded signatures, so eager calls that add to it later do
    not make torch.compile recompile (a guard on the table would, and past the cache limit fall back to
    eager)."""
    from attention_reference import random_qkv as qkv

    torch._dynamo.reset()
    monkeypatch.setattr(flash_replays, "recorded", {})
    compiled = torch.compile(FlashAttentionTriton.apply, fullgraph=True, backend="aot_eager")
    q, k, v = qkv((1, 2), 40, 40, 16, torch.float32, "cpu", seed=3)
    compiled(q, k, v, True)
    flash_replays.recorded[("an eager signature",)] = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(q, k, v, True)
