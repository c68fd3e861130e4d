"""FlashAttention-2 in Triton: launchers, torch.library ops and the autograd.Function.

    FlashAttentionTriton.apply(q, k, v, is_causal=False) -> o
    q: (..., Nq, d)   k, v: (..., Nk, d)   o: (..., Nq, d)   d a multiple of 8, 8 <= d <= 256

Layouts: the kernels address a slice as z * stride_z + h * stride_h with a row stride, so (Z, H, N, d)
inputs with any strides but a unit one on d are read in place (a head-major view of token-major
(B, N, H, d) memory, as the model passes, costs no copy), and O, dQ, dK, dV come back in the layout of
q, k, v.  The portable kernels load unmasked K/V tiles through TMA descriptors only for contiguous K and V (the
Hopper kernels below take rank-4 descriptors over strided views).

Grouped-query attention: k and v may have fewer heads (dim -3) than q, Hkv dividing Hq; query head h reads
K/V head h // (Hq // Hkv) without K/V being repeated in memory, and dK, dV sum over each group's query heads
inside the dK/dV kernel (no atomics).  Head dims that are not a power of two run in the next power-of-two
register tile with the padding columns masked, or in two power-of-two tiles side by side where that saves columns
(80 = 64 + 16, 96 = 32 + 64; `flash_configs.d_tiles`): none by default or with CS336_FLASH_SPLIT_D=0, every
kernel with CS336_FLASH_SPLIT_D=1 (experimental: the split kernels fault under load on Hopper).

Forward: one fused kernel (grid: query tiles x batch*heads) with an online softmax over key tiles;
saves Q, K, V, O and L = logsumexp(Q K^T / sqrt(d)) (shape q.shape[:-1], float32).
Backward: a dQ kernel (Q, dO resident, loop over key tiles) that first computes D = rowsum(O * dO) for its
query rows and stores it, then a dK/dV kernel (K, V resident, loop over query tiles) that reads D: two
launches, every output tile has exactly one writer, no atomics.

On Hopper (compute capability 9.x, Triton 3.6, bf16/fp16) each launch may instead be a Gluon kernel with
asynchronous warpgroup MMAs (`kernels/flash_fwd_hopper`, `_fwd_hopper_ws`, `_dq_hopper`, `_dkdv_hopper`), or
the whole backward one fused Gluon pass (`kernels/flash_bwd_hopper`: five tile products instead of seven, dQ
summed in float32 by TMA reductions, so dQ is not bitwise reproducible run to run).  Which kernels run is
decided in one place, `cs336_systems.attention.plan.plan` (its table `RULES` holds every size rule with its
reason and measurement; `cs336-flash-autotune --explain B,H,N,d` prints the plan for a shape), from the
call's sizes, the device and the options (`plan.FlashOptions`, given to `flash_attention`; the
``CS336_FLASH_*`` switches of `cs336_systems.switches` override them, for debugging).

Under tracing (`torch.compile(FlashAttentionTriton.apply, fullgraph=True)`, AOTAutograd, a dispatch mode)
the Function calls two `torch.library.triton_op`s (cs336::flash_attn_fwd_inductor / _bwd_inductor), whose
bodies run as plain Python while the graph is traced and ask the plan for the traced path:
  * "triton_op": the portable kernels, launched through `wrap_triton` with pointer loads: inductor traces
    them into its graph and launches them with its own launcher, so a call pays no custom-op dispatch or
    Triton JIT binding (the models' short sequences);
  * "custom_op": the opaque operators cs336::flash_attn_fwd / _bwd (a `torch.library.Library` fragment with
    fake (shape-only) kernels), which plan each call on its concrete sizes and launch what an eager call
    launches: where a Gluon kernel runs or the portable configuration wants TMA descriptors (torch 2.11
    cannot trace host-side descriptors inside a `triton_op`), under the interpreter, and wherever the
    traced sizes are symbolic (automatic dynamic shapes after a shape change, ``dynamic=True``,
    ``mark_dynamic``): one graph then serves every size, each call with the kernels of its size.
    The price is the operators' dispatch and Python on the host, not device time
    (docs/flash-attention-experiments.md, Sections 3, 6, 13 and 14).
An eager call on plain tensors (nothing tracing) launches the same kernels directly, skipping any
dispatch: at small sizes that dispatch is most of the call.  From the second eager call of a signature
(shapes, strides, dtypes, device, ``is_causal``, input alignment, switches) on, its kernels'
launches are replayed as the first call recorded them (`kernels/flash_replay`): no validation, no
configuration lookup, no launcher Python and no Triton JIT binding, only the output allocations and one
launcher call per kernel (Gluon kernels and TMA descriptors included: a replay rebuilds each descriptor on
the new tensor).  Calls that take a workspace (key or group splits) launch the ordinary way.  The custom
ops replay the same way when a compiled graph runs them (their tensors are plain then), under signatures
of their own.  ``CS336_FLASH_REPLAY=0`` turns replays off.
The registry's entry, `flash_attention`, is ``FlashAttentionTriton.apply`` except for eager calls that record no
graph (``torch.no_grad()``, or no input requiring grad): those skip the autograd.Function and its context.
Tile configurations per kernel come from `flash_autotune.select` (autotune cache, the H100-measured
table in `flash_configs`, or a default); launchers live in `flash_launch`.

Double backward (``create_graph=True`` through this op) raises a RuntimeError, for eager calls and for calls
under a dispatch mode (under torch.compile, AOTAutograd rejects double backward itself): the kernels'
gradients carry no graph.

On a CPU tensor the kernels only run under Triton's interpreter (TRITON_INTERPRET=1 set before this
module is imported); otherwise a ValueError says so.  The interpreter's bf16 ``tl.dot`` is wrong (errors of
~1e8), so bfloat16 inputs under the interpreter are refused with a ValueError; float32 and float16 run there.
Empty problems: no queries or an empty batch give an empty output (and zero gradients for K and V); queries
with no keys (Nk = 0) are refused; ``is_causal`` must be a bool.  float32 inputs multiply with tf32x3 dots (three
TF32 tensor-core products per fp32 product, near-fp32 accuracy, as PyTorch's fp32 mem-efficient SDPA does),
or with IEEE FMA dots under ``CS336_FLASH_FP32_DOT=ieee`` (`flash_configs.fp32_dot`); never plain TF32.
"""

from __future__ import annotations

import functools
import os

import torch

from cs336_systems import switches
from cs336_systems.attention.checks import check_qkv, dims_text
from cs336_systems.attention.plan import Device, FlashOptions, Plan, Problem, plan
from cs336_systems.attention.kernels import flash_autotune, flash_kernels
from cs336_systems.attention.kernels import flash_launch as launch
from cs336_systems.attention.kernels.flash_autotune import interpreter_active, select
from cs336_systems.attention.kernels.flash_configs import HEAD_DIMS
from cs336_systems.attention.kernels.flash_launch import direct
from cs336_systems.attention.kernels.flash_replay import (
    REPLAY_TRITON,
    Recorder,
    hooks_idle,
)

try:  # the Hopper kernels need Triton's experimental Gluon API; without it the portable kernels run
    from cs336_systems.attention.kernels import flash_bwd_hopper as bwd_hopper
    from cs336_systems.attention.kernels import flash_dkdv_hopper as dkdv_hopper
    from cs336_systems.attention.kernels import flash_dq_hopper as dq_hopper
    from cs336_systems.attention.kernels import flash_fwd_hopper as hopper
    from cs336_systems.attention.kernels import flash_fwd_hopper_ws as hopper_ws
except ImportError:  # pragma: no cover - depends on the installed Triton
    hopper = hopper_ws = dq_hopper = dkdv_hopper = bwd_hopper = None

SUPPORTED_HEAD_DIMS = HEAD_DIMS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Whether the @triton.jit kernels were built for Triton's interpreter: decided once, when flash_kernels was
# imported (TRITON_INTERPRET=1 at that moment), whatever the environment says later.
KERNELS_INTERPRETED = type(flash_kernels.flash_fwd_kernel).__name__ == "InterpretedFunction"


def available(device: torch.device) -> bool:
    """CUDA tensors, or CPU tensors under the Triton interpreter."""
    return (device.type == "cuda" and torch.cuda.is_available()) or (device.type == "cpu" and interpreter_active())


def _select(q: torch.Tensor, k: torch.Tensor, is_causal: bool, may_tune: bool = False):
    n_queries, d = q.shape[-2:]
    return select(launch.slices(q), n_queries, k.shape[-2], d, q.dtype, is_causal, q.device, may_tune=may_tune)


REPLAY_ENV = "CS336_FLASH_REPLAY"
# Every environment variable the launch path reads (the registry's kernel switches; TRITON_INTERPRET:
# `flash_autotune.select` asks it per call; TRITON_DEBUG: Triton's JIT compiles with it): a recorded call
# replays only under the values it was recorded with.  Triton knobs set from Python after a recording (debug,
# instrumentation, JIT pre-run hooks) are not seen by its replays; Triton's launch hooks are
# (`flash_replay.hooks_idle`).
_SWITCHES = (REPLAY_ENV,) + tuple(n for n in switches.KERNEL_SWITCHES if n != REPLAY_ENV) + ("TRITON_INTERPRET",
                                                                                            "TRITON_DEBUG")
MAX_RECORDED = 512  # call signatures kept (then the table starts over): shapes that vary call by call
# Call signature -> the Recorder to replay, or None (validated, but launched the ordinary way: a workspace,
# or a descriptor over a view at another address).  Only validated, non-empty signatures are ever entered.
_recorded: dict[tuple, Recorder | None] = {}
# Backward signatures recorded on the fused kernel (flash_bwd_hopper), whose replays take an 11th slot: the
# float32 dQ accumulator, allocated per call like the outputs.
_fused_keys: set[tuple] = set()
_UNSEEN = object()
_ENCODED = tuple(os.environ.encodekey(name) for name in _SWITCHES) if hasattr(os.environ, "encodekey") else ()


def _switches() -> tuple:
    """The values of `_SWITCHES` (str or bytes, None where unset).  os.environ keeps its encoded items in
    `_data` (CPython, every platform), which its writes (and pytest's monkeypatch) update: read there, the
    switches cost ~0.4 us instead of ~8 through os.environ.get."""
    data = getattr(os.environ, "_data", None)
    if data is not None:
        return tuple(map(data.get, _ENCODED))
    return tuple(os.environ.get(name) for name in _SWITCHES)  # pragma: no cover - an os.environ stand-in


def _replays_off(value) -> bool:
    """Whether REPLAY_ENV's value (as `_switches` reads it) is "0"."""
    return value == "0" or value == b"0"


def _replay_key(kind: str, is_causal: bool, tensors: tuple[torch.Tensor, ...], options: str = "") -> tuple | None:
    """The signature under which an eager call's launches are recorded and replayed (`flash_replay`), or None
    where calls are never replayed: not a plain CUDA tensor, the interpreter, a Triton release whose launcher
    `flash_replay` was not checked against, Triton launch hooks installed, or ``CS336_FLASH_REPLAY=0``.
    Everything the launch path decides from is in it: each tensor's shape, strides, dtype and device, the
    inputs' 16-byte alignment and which of them share an address, ``is_causal``, the current device, the
    launch switches, the call's options (`FlashOptions.text`) and the autotune memo's generation."""
    if (KERNELS_INTERPRETED or not REPLAY_TRITON or (is_causal is not True and is_causal is not False)
            or type(tensors[0]) is not torch.Tensor or not tensors[0].is_cuda):
        return None  # (before asking CUDA for its current device: a CPU call gets validation's ValueError)
    env = _switches()
    if _replays_off(env[0]) or not hooks_idle():
        return None
    key = [kind, is_causal, torch.cuda.current_device(), flash_autotune.generation, env, options]
    ptrs = []
    for t in tensors:  # a plain loop over one flat list: half the time of per-field tuples (~2 us a call)
        if type(t) is not torch.Tensor or not t.is_cuda:
            return None  # (not a plain CUDA tensor: the ordinary path, whose validation names a bad input)
        p = t.data_ptr()
        # shape, strides, dtype, device, 16-byte alignment, and the first input at the same address
        key += (t.shape, t.stride(), t.dtype, t.device, p % 16 == 0, ptrs.index(p) if p in ptrs else len(ptrs))
        ptrs.append(p)
    return tuple(key)


def _replayed(key: tuple | None, slots: tuple[torch.Tensor, ...]) -> bool | None:
    """Launch the calls recorded under ``key`` on ``slots``: True if replayed; None if ``key`` is new (the
    caller records this call); False otherwise (no key, or a signature that launches the ordinary way)."""
    if key is None:
        return False
    recorder = _recorded.get(key, _UNSEEN)
    if recorder is _UNSEEN:
        return None
    if recorder is None:
        return False
    # the current device's current stream, where Triton's JIT launched the recorded call (key[2]: that device)
    recorder.replay(slots, torch._C._cuda_getCurrentRawStream(key[2]))
    return True


def _remember(key: tuple, recorder: Recorder | None) -> None:
    """Keep ``recorder`` for ``key`` if it recorded a replayable call, else None (the ordinary path)."""
    if len(_recorded) >= MAX_RECORDED:
        _recorded.clear()
        _fused_keys.clear()
    if recorder is not None:
        recorder.slots = ()  # the recording's tensors are not kept alive
        if not (recorder.ok and recorder.launches):
            recorder = None
    _recorded[key] = recorder


@functools.lru_cache(maxsize=64)
def _parsed(options: str) -> FlashOptions:
    return FlashOptions.parse(options)


def _plan(q: torch.Tensor, k: torch.Tensor, is_causal: bool, tensors: tuple[torch.Tensor, ...], options: str,
          traced: bool = False) -> Plan:
    """`plan.plan` for (Z, H, N, d) views: ``tensors`` are those whose layout the kernels need (q, k, v; and o, do
    for a backward); the options string with the environment's switches over it.  ``traced``: also decide
    the traced path (at trace time: no base addresses to check)."""
    switches.warn_unknown()  # a misspelt CS336_FLASH_* switch would otherwise do nothing, in silence
    problem = Problem.of(q, k, is_causal, tensors, addresses=not traced)
    return plan(problem, Device.of(q.device), _parsed(options).with_env(), traced=traced)


def _forward(q, k, v, is_causal: bool, wrap=direct, may_tune: bool = False, tma: int | None = None,
             key: tuple | None = None, options: str = ""):
    """O and L for (Z, H, N, d) views; ``key`` (eager calls, `_replay_key`): replay the launches recorded
    under it, or record them.  The kernel is the plan's (`plan.plan`); launches through ``wrap`` other than
    `direct` (inductor's `wrap_triton`) and ``tma`` 0 take the portable kernel with pointer loads."""
    o = torch.empty_like(q)  # q's strides (a token-major view gives a token-major output)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    slots = (q, k, v, o, lse)
    replayed = _replayed(key, slots)
    if replayed:
        return o, lse
    record = replayed is None  # a new signature: record it (once; a refused one is not tried again)
    recorder = Recorder(slots) if record else None
    kernel = "portable"
    if wrap is direct and tma != 0 and hopper is not None:
        kernel = _plan(q, k, is_causal, (q, k, v), options).forward
    if kernel != "portable":  # the Gluon forward (sm_90): same L as the portable one
        (hopper_ws if kernel == "hopper-ws" else hopper).forward(q, k, v, o, lse, is_causal, recorder or wrap)
    else:
        cfg = _select(q, k, is_causal, may_tune)
        launch.forward(q, k, v, o, lse, is_causal, cfg["fwd"], recorder or wrap, tma=tma)
    if record:
        _remember(key, recorder)
    return o, lse


def _backward(q, k, v, o, lse, do, is_causal: bool, wrap=direct, tma: int | None = None, key: tuple | None = None,
              options: str = ""):
    """dQ, dK, dV; ``key`` and the kernels' choice as in `_forward`."""
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    slots = (q, k, v, o, lse, do, delta, dq, dk, dv)
    if key is not None and key in _fused_keys:  # a recorded fused backward: its dQ accumulator is a slot too
        slots += (torch.empty(q.shape, device=q.device, dtype=torch.float32),)
    replayed = _replayed(key, slots)
    if replayed:
        return dq, dk, dv
    record = replayed is None
    chosen = None  # Gluon kernels: eager launches only
    if wrap is direct and tma != 0 and hopper is not None:
        chosen = _plan(q, k, is_causal, (q, k, v, o, do), options)
    fused = chosen is not None and chosen.backward == "fused"
    if fused and len(slots) == 10:  # the fused pass's float32 dQ accumulator
        slots += (torch.empty(q.shape, device=q.device, dtype=torch.float32),)
    recorder = Recorder(slots) if record else None
    if fused:  # one pass (flash_bwd_hopper): dQ accumulated in float32 through TMA reductions
        bwd_hopper.backward(q, k, v, o, do, lse, delta, slots[10], dq, dk, dv, is_causal, recorder or wrap)
    else:
        _two_kernel_backward(q, k, v, o, lse, do, delta, dq, dk, dv, is_causal, recorder or wrap, tma,
                             gluon_dq=chosen is not None and chosen.dq == "hopper",
                             gluon_dkdv=chosen is not None and chosen.dkdv == "hopper")
    if record:
        _remember(key, recorder)
        if fused:
            _fused_keys.add(key)  # after `_remember`, which may start the tables over
    return dq, dk, dv


def _two_kernel_backward(q, k, v, o, lse, do, delta, dq, dk, dv, is_causal: bool, wrap, tma: int | None,
                         gluon_dq: bool, gluon_dkdv: bool) -> None:
    """dQ, then dK/dV, each on its Gluon kernel where the plan chose it."""
    cfg = _select(q, k, is_causal)
    # dQ first: its kernel computes D = rowsum(O * dO) for its own query rows and stores it for dK/dV, so
    # the backward is two launches, not three (a launch is ~0.1 ms of host time on the H100 machine).
    if gluon_dq:
        dq_hopper.dq(q, k, v, o, do, lse, delta, dq, is_causal, wrap)  # Gluon, sm_90 (flash_dq_hopper); also delta
    else:
        launch.dq(q, k, v, do, lse, delta, dq, is_causal, cfg["dq"], wrap, o=o, tma=tma)
    if gluon_dkdv:
        dkdv_hopper.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal, wrap)  # Gluon (flash_dkdv_hopper)
    else:
        launch.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal, cfg["dkdv"], wrap)


def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   options: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The op cs336::flash_attn_fwd: q (Z, H, Nq, d), k, v (Z, H_kv, Nk, d), unit stride on d -> (o like q,
    L (Z, H, Nq) float32); ``options``: `FlashOptions.text`.  Its kernels are planned on the concrete sizes
    of each call (a compiled graph runs it on plain tensors, also where the graph's sizes are symbolic), and
    replayed like an eager call (`_replay_key`), under a signature of its own ("fwd op": it never tunes,
    where an eager call may)."""
    return _forward(q, k, v, is_causal, key=_replay_key("fwd op", is_causal, (q, k, v), options), options=options)


def _flash_attn_fwd_fake(q, k, v, is_causal, options=""):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def flash_attn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    is_causal: bool, options: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op cs336::flash_attn_bwd, gradients of flash_attn_fwd: all tensors (Z, H, N, d) with unit stride on
    d, lse (Z, H, Nq).  Planned and replayed as flash_attn_fwd is."""
    # lse in the key too: the op's caller may pass any lse (an eager backward's is the forward's fresh output)
    key = _replay_key("bwd op", is_causal, (q, k, v, o, lse, do), options)
    return _backward(q, k, v, o, lse, do, is_causal, key=key, options=options)


def _flash_attn_bwd_fake(q, k, v, o, lse, do, is_causal, options=""):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Registered as a `torch.library.Library` fragment (schema, a kernel per device type, a fake kernel), not
# with `torch.library.custom_op`: a compiled graph calls these ops on every attention call, and custom_op's
# Python wrappers (an autograd kernel, an aliasing check of the outputs) added ~11 µs a call at the 2.7B
# shape, a third of the forward op's host time (docs/flash-attention-experiments.md, Section 13).  The ops are
# internal and not differentiable themselves (no autograd kernel): they run inside `FlashAttentionTriton`,
# whose backward calls flash_attn_bwd and refuses double backward, and compiled graphs call them with grad off.
# Outputs are fresh tensors (no aliasing, no mutation), as the schemas say; pt2_compliant_tag, as custom_op
# sets, lets them run under dynamo's only_allow_pt2_compliant_ops.  CPU: the interpreter's tensors.
# The module registers them once per process: loading its file a second time under another name fails.
_LIBRARY = torch.library.Library("cs336", "FRAGMENT")
_LIBRARY.define('flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool is_causal, str options="") -> (Tensor, Tensor)',
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.define("flash_attn_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool is_causal, "
                'str options="") -> (Tensor, Tensor, Tensor)', tags=(torch.Tag.pt2_compliant_tag,))
for _dispatch_key in ("CUDA", "CPU"):
    _LIBRARY.impl("flash_attn_fwd", flash_attn_fwd, _dispatch_key)
    _LIBRARY.impl("flash_attn_bwd", flash_attn_bwd, _dispatch_key)
torch.library.register_fake("cs336::flash_attn_fwd", _flash_attn_fwd_fake, lib=_LIBRARY)
torch.library.register_fake("cs336::flash_attn_bwd", _flash_attn_bwd_fake, lib=_LIBRARY)


# What a traced call (torch.compile, AOTAutograd, a dispatch mode) runs: `torch.library.triton_op`s whose
# bodies run as plain Python when the graph is traced (dynamo does not trace into them: sizes that are
# symbolic there are `torch.SymInt`s the plan can see).  Each asks the plan (`_plan`, traced=True):
#   * "triton_op": the portable kernels with pointer loads, launched through `wrap_triton`, which inductor
#     traces into its own graph and launches with its generated launcher, as it launches its own kernels: no
#     custom-op dispatch and no Triton JIT argument binding per call at run time (the host cost that dominates
#     short sequences, e.g. the models at context 512); shapes, strides and configurations fixed at tracing;
#   * "custom_op": the opaque ops above, which plan on each call's concrete sizes and launch the eager path's
#     kernels, Gluon ones and TMA descriptors included (torch 2.11 cannot trace host-side descriptors inside
#     a triton_op): where a Gluon kernel runs, the portable configuration wants descriptors, the interpreter
#     runs the kernels, or the sizes are symbolic (dynamic shapes: one graph serves every size, and each call
#     still gets the kernels an eager call of its size gets; the price is the custom op's host dispatch).
@torch.library.triton_op("cs336::flash_attn_fwd_inductor", mutates_args=())
def flash_attn_fwd_inductor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                            options: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_fwd for traced calls: the portable kernels through inductor, or the custom op (see above)."""
    if _plan(q, k, is_causal, (q, k, v), options, traced=True).traced != "triton_op":
        return torch.ops.cs336.flash_attn_fwd(q, k, v, is_causal, options)
    return _forward(q, k, v, is_causal, wrap=torch.library.wrap_triton, tma=0, options=options)


@torch.library.triton_op("cs336::flash_attn_bwd_inductor", mutates_args=())
def flash_attn_bwd_inductor(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    is_causal: bool, options: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn_bwd for traced calls, chosen as flash_attn_fwd_inductor chooses."""
    if _plan(q, k, is_causal, (q, k, v, o, do), options, traced=True).traced != "triton_op":
        return torch.ops.cs336.flash_attn_bwd(q, k, v, o, lse, do, is_causal, options)
    return _backward(q, k, v, o, lse, do, is_causal, wrap=torch.library.wrap_triton, tma=0, options=options)


def _eager(t: torch.Tensor) -> bool:
    """True when nothing traces this call: a plain tensor, no dynamo, no dispatch mode (make_fx, fake).

    Then the kernels are launched directly, skipping the custom-op dispatch (tens of microseconds per
    call, which is most of the time of a small attention call); otherwise the registered ops run, so
    torch.compile and AOTAutograd see opaque, traceable ops.
    """
    return type(t) is torch.Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: object) -> bool:
    """ValueError naming what flash-triton cannot take; returns True for an empty problem (no queries or an
    empty batch: nothing to launch).  Plain Python on shapes, dtypes and devices: no device work."""
    check_qkv(q, k, v, allow_gqa=True)
    if is_causal is not True and is_causal is not False:
        raise ValueError(f"is_causal must be a bool (True or False), got {is_causal!r} ({type(is_causal).__name__})")
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash-triton supports head dims that are {dims_text(SUPPORTED_HEAD_DIMS)}; got d={d} "
                         f"(q shape {tuple(q.shape)})")
    dtype = q.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"flash-triton supports float32, bfloat16, float16; got dtype {dtype}")
    on_cuda = q.is_cuda  # a CUDA tensor exists only where CUDA is available
    if not on_cuda and not (q.device.type == "cpu" and interpreter_active()):
        raise ValueError(
            f"flash-triton needs CUDA tensors (q is on {q.device}); on CPU it runs only under the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing cs336_systems.attention.flash_triton"
        )
    if dtype is torch.bfloat16 and (KERNELS_INTERPRETED or not on_cuda):
        raise ValueError(
            f"flash-triton cannot compute dtype {dtype} under Triton's interpreter (TRITON_INTERPRET=1): the "
            "interpreter's bf16 tl.dot returns wrong results; use float32 or float16 there, or a CUDA device "
            "without the interpreter")
    if not q.numel():
        return True
    if not k.shape[-2]:
        raise ValueError(f"flash-triton needs Nk >= 1 when there are queries; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return False


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, N, d) -> (Z, H, N, d) with unit stride on d, a view whenever the layout allows: the kernels
    take any Z, H and N strides, so a head-major view of a token-major (B, N, H, d) tensor, as the model
    passes, is read in place.  (N, d) -> (1, 1, N, d); (BH, N, d) -> (1, BH, N, d)."""
    if t.dim() < 4:
        t = t.view((1,) * (4 - t.dim()) + tuple(t.shape))
    elif t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _other_autodiff() -> bool:
    """Whether a derivative other than reverse-mode autograd's could be asked of this call: a forward-mode
    dual level is open (dual tensors report requires_grad=False) or a functorch transform (vmap, grad, jvp)
    is active.  Those calls go through the Function, which refuses them with their own errors instead of
    returning an output without the derivative."""
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _forward_call(q, k, v, is_causal, eager: bool, options: str = ""):
    """One forward call, the Function's and the registry entry's: (o like q, L (q.shape[:-1]), replay key,
    empty).  An eager call (`_eager`) whose signature was seen before skips validation (it passed when it was
    recorded) and launches directly, replayed or recorded; a traced call takes the registered ops, which
    plan its kernels (`flash_attn_fwd_inductor`).  ``empty``: no queries or an empty batch, an empty output
    and no launch."""
    key = _replay_key("fwd", is_causal, (q, k, v), options) if eager else None
    empty = False if key is not None and key in _recorded else _validate(q, k, v, is_causal)
    if empty:
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32), key, True
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    if eager:
        o, lse = _forward(q4, k4, v4, is_causal, may_tune=True, key=key, options=options)
    else:
        o, lse = torch.ops.cs336.flash_attn_fwd_inductor(q4, k4, v4, is_causal, options)
    if q.dim() != 4:
        o = o.reshape(q.shape)  # a view unless q had more than 4 dims that do not merge
        lse = lse.view(q.shape[:-1])
    return o, lse, key, False


def _options_text(options: FlashOptions | str | None) -> str:
    if options is None:
        return ""
    if isinstance(options, str):  # already `FlashOptions.text` (a constant a compiled graph can hold)
        return options
    if not isinstance(options, FlashOptions):
        raise ValueError(f"options must be a FlashOptions, its text, or None; got {options!r}")
    return options.text()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    options: FlashOptions | str | None = None) -> torch.Tensor:
    """``FlashAttentionTriton.apply(q, k, v, is_causal, options.text())`` (shapes in the module docstring): the
    registry's "flash-triton" entry.  ``options``: explicit kernel choices (`plan.FlashOptions`, or its
    `text`; the environment's ``CS336_FLASH_*`` switches override them, for debugging).

    An eager call that records no autograd graph (grad mode off, or no input that requires grad: a forward
    under ``torch.no_grad()``, as in inference and the forward benchmarks) skips the autograd.Function, whose
    context and graph bookkeeping are most of what such a call costs on the host once its launches are
    replayed (about 10 us of 35 at the models' context 512); the validation, the launches and the output are
    the Function's (`_forward_call`).  A call that records a graph, a traced call, a tensor subclass, an open
    forward-mode dual level or a functorch transform goes through the Function.
    """
    text = _options_text(options)
    if (type(k) is torch.Tensor and type(v) is torch.Tensor and _eager(q) and not _other_autodiff()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return _forward_call(q, k, v, is_causal, True, text)[0]
    return FlashAttentionTriton.apply(q, k, v, is_causal, text)


class FlashAttentionTriton(torch.autograd.Function):
    """apply(q, k, v, is_causal=False, options="") -> o; ``options``: `FlashOptions.text` ("" for defaults)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, options=""):
        o, lse, ctx.key, ctx.empty = _forward_call(q, k, v, is_causal, _eager(q), options)
        ctx.is_causal = is_causal
        ctx.options = options
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.empty:  # no query saw any key: dQ is empty, dK and dV are zero
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
        q4 = _as_4d(q)
        lse4 = lse if lse.dim() == 3 else lse.reshape(q4.shape[:-1])
        args = (q4, _as_4d(k), _as_4d(v), _as_4d(o), lse4, _as_4d(grad_out), ctx.is_causal)
        if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and any(t.requires_grad for t in (q, k, v, grad_out))):
            # create_graph=True: the kernels' results would carry no graph, so a second derivative through
            # attention would silently be zero.  Checked on every path, the registered ops' included (a
            # dispatch mode such as FlopCounterMode sends an eager call there): they have no autograd kernel.
            raise RuntimeError(
                "flash-triton does not support double backward: its backward ran with create_graph=True "
                "and its gradients would not be differentiable; use the 'naive' attention for "
                "higher-order gradients")
        if _eager(grad_out):
            key = None if ctx.key is None else _replay_key("bwd", ctx.is_causal, args[:4] + args[5:6], ctx.options)
            dq, dk, dv = _backward(*args, key=key, options=ctx.options)
        else:
            dq, dk, dv = torch.ops.cs336.flash_attn_bwd_inductor(*args, ctx.options)
        if q.dim() == 4:  # (the reshapes would return views of the same shape: ~2 us each)
            return dq, dk, dv, None, None
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                           options: FlashOptions | None = None) -> torch.Tensor:
    return FlashAttentionTriton.apply(q, k, v, is_causal, _options_text(options))
