"""Replays of eager flash-triton calls: the table of call signatures whose launches were recorded
(`kernels.replay.Recorder`), the signature of a call, and the environment switches a recording depends on.

From the second eager call of a signature on (shapes, strides, dtypes and devices of the tensors, their
16-byte alignment and aliasing, ``is_causal``, the current device, the launch switches, the options and the
autotune memo's generation), `flash_calls` replays the launches the first call recorded: no validation, no
plan, no launcher Python and no Triton JIT binding.  ``CS336_FLASH_REPLAY=0`` turns replays off.
"""

from __future__ import annotations

import os

import torch

from cs336_systems import switches
from cs336_systems.attention.kernels.portable import autotune as flash_autotune
from cs336_systems.attention.kernels.portable import kernels as flash_kernels
from cs336_systems.attention.kernels.replay import REPLAY_TRITON, Recorder, hooks_idle

# Whether the @triton.jit kernels were built for Triton's interpreter: decided once, when flash_kernels was
# imported (TRITON_INTERPRET=1 at that moment), whatever the environment says later.
KERNELS_INTERPRETED = type(flash_kernels.flash_fwd_kernel).__name__ == "InterpretedFunction"

REPLAY_ENV = "CS336_FLASH_REPLAY"
# Every environment variable the launch path reads (the registry's kernel switches; TRITON_INTERPRET:
# `flash_autotune.select` asks it per call; TRITON_DEBUG: Triton's JIT compiles with it): a recorded call
# replays only under the values it was recorded with.  Triton knobs set from Python after a recording (debug,
# instrumentation, JIT pre-run hooks) are not seen by its replays; Triton's launch hooks are
# (`kernels.replay.hooks_idle`).
SWITCHES = (REPLAY_ENV,) + tuple(n for n in switches.KERNEL_SWITCHES if n != REPLAY_ENV) + ("TRITON_INTERPRET",
                                                                                            "TRITON_DEBUG")
MAX_RECORDED = 512  # call signatures kept (then the table starts over): shapes that vary call by call
# Call signature -> the Recorder to replay, or None (validated, but launched the ordinary way: a workspace,
# or a descriptor over a view at another address).  Only validated, non-empty signatures are ever entered.
recorded: dict[tuple, Recorder | None] = {}
# Backward signatures recorded on the fused kernel (kernels/hopper/backward), whose replays take an 11th slot: the
# float32 dQ accumulator, allocated per call like the outputs.
fused_keys: set[tuple] = set()
_UNSEEN = object()
_ENCODED = tuple(os.environ.encodekey(name) for name in SWITCHES) if hasattr(os.environ, "encodekey") else ()


def switch_values() -> tuple:
    """The values of `SWITCHES` (str or bytes, None where unset).  os.environ keeps its encoded items in
    `_data` (CPython, every platform), which its writes (and pytest's monkeypatch) update: read there, the
    switches cost ~0.4 us instead of ~8 through os.environ.get."""
    data = getattr(os.environ, "_data", None)
    if data is not None:
        return tuple(map(data.get, _ENCODED))
    return tuple(os.environ.get(name) for name in SWITCHES)  # pragma: no cover - an os.environ stand-in


def replays_off(value) -> bool:
    """Whether REPLAY_ENV's value (as `switch_values` reads it) is "0"."""
    return value == "0" or value == b"0"


def replay_key(kind: str, is_causal: bool, tensors: tuple[torch.Tensor, ...], options: str = "") -> tuple | None:
    """The signature under which an eager call's launches are recorded and replayed (`kernels.replay`), or None
    where calls are never replayed: not a plain CUDA tensor, the interpreter, a Triton release whose launcher
    `kernels.replay` was not checked against, Triton launch hooks installed, or ``CS336_FLASH_REPLAY=0``.
    Everything the launch path decides from is in it: each tensor's shape, strides, dtype and device, the
    inputs' 16-byte alignment and which of them share an address, ``is_causal``, the current device, the
    launch switches, the call's options (`FlashOptions.text`) and the autotune memo's generation."""
    if (KERNELS_INTERPRETED or not REPLAY_TRITON or (is_causal is not True and is_causal is not False)
            or type(tensors[0]) is not torch.Tensor or not tensors[0].is_cuda):
        return None  # (before asking CUDA for its current device: a CPU call gets validation's ValueError)
    env = switch_values()
    if replays_off(env[0]) or not hooks_idle():
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


def replayed(key: tuple | None, slots: tuple[torch.Tensor, ...]) -> bool | None:
    """Launch the calls recorded under ``key`` on ``slots``: True if replayed; None if ``key`` is new (the
    caller records this call); False otherwise (no key, or a signature that launches the ordinary way)."""
    if key is None:
        return False
    recorder = recorded.get(key, _UNSEEN)
    if recorder is _UNSEEN:
        return None
    if recorder is None:
        return False
    # the current device's current stream, where Triton's JIT launched the recorded call (key[2]: that device)
    recorder.replay(slots, torch._C._cuda_getCurrentRawStream(key[2]))
    return True


def remember(key: tuple, recorder: Recorder | None) -> None:
    """Keep ``recorder`` for ``key`` if it recorded a replayable call, else None (the ordinary path)."""
    if len(recorded) >= MAX_RECORDED:
        recorded.clear()
        fused_keys.clear()
    if recorder is not None:
        recorder.slots = ()  # the recording's tensors are not kept alive
        if not (recorder.ok and recorder.launches):
            recorder = None
    recorded[key] = recorder
