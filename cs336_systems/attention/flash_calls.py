"""One flash-triton call's launches: the plan's kernels for a forward or a backward on (Z, H, N, d) views,
recorded for replay the first time a signature is seen and replayed after (`flash_replays`).

    forward(q, k, v, is_causal, ...) -> (o, lse)
    backward(q, k, v, o, lse, do, is_causal, ...) -> (dq, dk, dv)

The Function (`flash_triton`) calls them for eager calls, the registered ops (`flash_ops`) for traced ones.
Which kernels run is `plan_call`'s answer (`cs336_systems.attention.plan.plan`); the portable kernels' tile
configurations come from `select_configs` (`kernels.portable.autotune.select`).
"""

from __future__ import annotations

import functools
import threading

import torch

from cs336_systems import switches
from cs336_systems.attention import flash_replays as replays
from cs336_systems.attention.kernels.portable import launch
from cs336_systems.attention.kernels.portable.autotune import interpreter_active, select
from cs336_systems.attention.kernels.portable.launch import direct
from cs336_systems.attention.kernels.replay import Recorder
from cs336_systems.attention.plan import Device, FlashOptions, Plan, Problem, plan

try:  # the Hopper kernels need Triton's experimental Gluon API; without it the portable kernels run
    from cs336_systems.attention.kernels.hopper import backward as bwd_hopper
    from cs336_systems.attention.kernels.hopper import dkdv as dkdv_hopper
    from cs336_systems.attention.kernels.hopper import dq as dq_hopper
    from cs336_systems.attention.kernels.hopper import forward as hopper
    from cs336_systems.attention.kernels.hopper import forward_ws as hopper_ws
except ImportError:  # pragma: no cover - depends on the installed Triton
    hopper = hopper_ws = dq_hopper = dkdv_hopper = bwd_hopper = None


# per thread: the CUDA device whose primary context this thread has bound (`_bind_context`)
_bound = threading.local()


def _bind_context(device_index: int) -> None:
    """Bind the device's primary CUDA context to this thread, once per thread and device.

    The Gluon kernels' TMA descriptors are encoded on the host, a driver call that needs a current context,
    before Triton's launcher binds one itself.  A thread can reach this call with none bound: autograd's
    device threads (their first CUDA work may be this backward, whose allocations the caching allocator
    serves without any CUDA call), or a new thread of the caller's.  The encode then fails with "invalid
    device context".  cudaMemGetInfo is a runtime call, so it binds the context, and it is allowed while a
    CUDA graph is captured."""
    if getattr(_bound, "device", None) != device_index:
        torch.cuda.mem_get_info(device_index)
        _bound.device = device_index


def available(device: torch.device) -> bool:
    """CUDA tensors, or CPU tensors under the Triton interpreter."""
    return (device.type == "cuda" and torch.cuda.is_available()) or (device.type == "cpu" and interpreter_active())


def select_configs(q: torch.Tensor, k: torch.Tensor, is_causal: bool, may_tune: bool = False):
    """The portable kernels' tile configurations for this call (kernel -> `TileConfig`)."""
    n_queries, d = q.shape[-2:]
    return select(launch.slices(q), n_queries, k.shape[-2], d, q.dtype, is_causal, q.device, may_tune=may_tune)


@functools.lru_cache(maxsize=64)
def _parsed(options: str) -> FlashOptions:
    return FlashOptions.parse(options)


def plan_call(q: torch.Tensor, k: torch.Tensor, is_causal: bool, tensors: tuple[torch.Tensor, ...], options: str,
              traced: bool = False) -> Plan:
    """`plan.plan` for (Z, H, N, d) views: ``tensors`` are those whose layout the kernels need (q, k, v; and o, do
    for a backward); the options string with the environment's switches over it.  ``traced``: also decide
    the traced path (at trace time: no base addresses to check)."""
    switches.warn_unknown()  # a misspelt CS336_FLASH_* switch would otherwise do nothing, in silence
    problem = Problem.of(q, k, is_causal, tensors, addresses=not traced)
    return plan(problem, Device.of(q.device), _parsed(options).with_env(), traced=traced)


def forward(q, k, v, is_causal: bool, wrap=direct, may_tune: bool = False, tma: int | None = None,
            key: tuple | None = None, options: str = ""):
    """O and L for (Z, H, N, d) views; ``key`` (eager calls, `flash_replays.replay_key`): replay the launches recorded
    under it, or record them.  The kernel is the plan's (`plan.plan`); launches through ``wrap`` other than
    `direct` (inductor's `wrap_triton`) and ``tma`` 0 take the portable kernel with pointer loads."""
    if wrap is direct and hopper is not None and q.is_cuda:
        _bind_context(q.get_device())
    o = torch.empty_like(q)  # q's strides (a token-major view gives a token-major output)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    slots = (q, k, v, o, lse)
    replayed = replays.replayed(key, slots)
    if replayed:
        return o, lse
    record = replayed is None  # a new signature: record it (once; a refused one is not tried again)
    recorder = Recorder(slots) if record else None
    kernel = "portable"
    if wrap is direct and tma != 0 and hopper is not None:
        kernel = plan_call(q, k, is_causal, (q, k, v), options).forward
    if kernel != "portable":  # the Gluon forward (sm_90): same L as the portable one
        (hopper_ws if kernel == "hopper-ws" else hopper).launch(q, k, v, o, lse, is_causal, recorder or wrap)
    else:
        cfg = select_configs(q, k, is_causal, may_tune)
        launch.forward(q, k, v, o, lse, is_causal, cfg["fwd"], recorder or wrap, tma=tma)
    if record:
        replays.remember(key, recorder)
    return o, lse


def backward(q, k, v, o, lse, do, is_causal: bool, wrap=direct, tma: int | None = None, key: tuple | None = None,
             options: str = ""):
    """dQ, dK, dV; ``key`` and the kernels' choice as in `forward`."""
    if wrap is direct and hopper is not None and q.is_cuda:
        _bind_context(q.get_device())
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    slots = (q, k, v, o, lse, do, delta, dq, dk, dv)
    if key is not None and key in replays.fused_keys:  # a recorded fused backward: its dQ accumulator is a slot too
        slots += (torch.empty(q.shape, device=q.device, dtype=torch.float32),)
    replayed = replays.replayed(key, slots)
    if replayed:
        return dq, dk, dv
    record = replayed is None
    chosen = None  # Gluon kernels: eager launches only
    if wrap is direct and tma != 0 and hopper is not None:
        chosen = plan_call(q, k, is_causal, (q, k, v, o, do), options)
    fused = chosen is not None and chosen.backward == "fused"
    if fused and len(slots) == 10:  # the fused pass's float32 dQ accumulator
        slots += (torch.empty(q.shape, device=q.device, dtype=torch.float32),)
    recorder = Recorder(slots) if record else None
    if fused:  # one pass (kernels/hopper/backward): dQ accumulated in float32 through TMA reductions
        bwd_hopper.launch(q, k, v, o, do, lse, delta, slots[10], dq, dk, dv, is_causal, recorder or wrap)
    else:
        _two_kernel_backward(q, k, v, o, lse, do, delta, dq, dk, dv, is_causal, recorder or wrap, tma,
                             gluon_dq=chosen is not None and chosen.dq == "hopper",
                             gluon_dkdv=chosen is not None and chosen.dkdv == "hopper")
    if record:
        replays.remember(key, recorder)
        if fused:
            replays.fused_keys.add(key)  # after `replays.remember`, which may start the tables over
    return dq, dk, dv


def _two_kernel_backward(q, k, v, o, lse, do, delta, dq, dk, dv, is_causal: bool, wrap, tma: int | None,
                         gluon_dq: bool, gluon_dkdv: bool) -> None:
    """dQ, then dK/dV, each on its Gluon kernel where the plan chose it."""
    cfg = select_configs(q, k, is_causal)
    # dQ first: its kernel computes D = rowsum(O * dO) for its own query rows and stores it for dK/dV, so
    # the backward is two launches, not three (a launch is ~0.1 ms of host time on the H100 machine).
    if gluon_dq:
        dq_hopper.launch(q, k, v, o, do, lse, delta, dq, is_causal, wrap)  # Gluon, sm_90; also delta
    else:
        launch.dq(q, k, v, do, lse, delta, dq, is_causal, cfg["dq"], wrap, o=o, tma=tma)
    if gluon_dkdv:
        dkdv_hopper.launch(q, k, v, do, lse, delta, dk, dv, is_causal, wrap)  # Gluon
    else:
        launch.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal, cfg["dkdv"], wrap)
