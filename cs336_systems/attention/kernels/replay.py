"""Replayed launches: the Triton launches of an eager flash-triton call, recorded once per call signature.

At the models' short sequences (B 4, N 512) one attention call is tens of microseconds of GPU work, and an
eager call's host time is what a training step pays: validation, the configuration lookup, the launchers'
Python (grids, strides, key splits, descriptors) and Triton's JIT launch (argument binding, specialization
key, cache lookup) cost several times SDPA's whole C++ call (docs/flash-attention-experiments.md,
Section 9).  All of that is a function of the call's signature: shapes, strides, dtypes, the device,
``is_causal``, the alignment of the input pointers, the environment switches and the autotune memo.  So the
first call of a signature runs the launchers under a `Recorder` (an ordinary launch through Triton's JIT that
also keeps the compiled kernel, the grid and every argument), and later calls of that signature only allocate
the outputs and hand the recorded arguments, with the new tensors in their slots, to each compiled kernel's
launcher:

    plan = Recorder(slots)            # slots: the call's tensors, inputs and freshly allocated outputs
    launch.forward(..., wrap=plan)    # launches as usual, and records each launch
    plan.replay(new_slots, stream)    # later: the same kernels, grids and scalars on new tensors

A host-side TMA descriptor (Triton's `TensorDescriptor`, or Gluon's) is recorded as a template and its slot:
the slot whose address and dtype its base has (the base may be a view of the slot, as the portable
launchers' 2-D K/V descriptors are).  A replay hands the launcher a copy of the template on the new slot's
tensor; the launcher encodes the TMA descriptor from the base's address and the template's shape, strides
and box, as it does at every ordinary launch, and the signature fixes all of those but the address.

A recording is refused (`Recorder.ok` False; the call keeps the ordinary path) when a launch takes an
argument it cannot replay: a tensor, or a descriptor's base, that is none of the slots (a workspace
allocated inside the launcher, e.g. the key-split partials, or a view at another address), another object
built per call, a grid given as a function, a kernel with JIT pre-run hooks, or a kernel still compiling.
Replays also keep Triton's launch hooks (profilers) on the ordinary path: `hooks_idle` must hold.  Triton specializes a kernel on its
integer arguments (equal to 1, divisible by 16) and on the 16-byte alignment of its pointers; the integers
are part of the signature, the inputs' alignment is part of the caller's key, and the outputs come from
PyTorch's allocator, which aligns every block to at least 512 bytes.

A replay calls the compiled kernel's launcher as Triton's JIT does (`JITFunction.run`: grid, stream,
function, packed metadata, launch metadata, the two launch hooks, then every argument, constexprs
included), which is Triton's internal interface: `REPLAY_TRITON` lists the releases it was checked against
(3.6 on the GPU, 3.9 by reading its source); on others, calls launch the ordinary way.

Direct launches (Triton 3.6, `DIRECT_TRITON`).  For a kernel that takes host-side descriptors, Triton 3.6's
launcher is a Python wrapper around the compiled C launcher that expands every descriptor at every launch:
it encodes a CUtensorMap from the base's address, shape, strides and box (`make_tensordesc_arg`), then
appends the shape and strides.  Within a signature only the address changes, so a recording also keeps,
where the launcher has exactly that form, the C launcher and each launch's arguments already expanded; a
replay fills in the slot tensors and each descriptor's CUtensorMap, encoded once per address (a small
table per descriptor) and reused after.  The map is passed by value (a kernel parameter), so reusing the
object is safe.  The C launcher then takes the arguments the wrapper would have built: the same launch.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon's host descriptor (the Hopper kernels'); absent from Triton releases without Gluon
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    GluonTensorDescriptor = TensorDescriptor

try:  # Triton >= 3.3 keeps the launch hooks in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    _knobs = None

REPLAY_TRITON = triton.__version__.startswith(("3.6.", "3.9."))
# The release whose launcher a replay may bypass (module docstring, "Direct launches"): read on the GPU
# image's Triton 3.6 (triton/backends/nvidia/driver.py: `wrap_handle_tensordesc`, `CudaLauncher`); 3.9's
# launcher has another form, and its replays keep the launcher.
DIRECT_TRITON = triton.__version__.startswith("3.6.")
# the expanding wrapper's free variables in Triton 3.6: the C launcher, the descriptors' positions, and their
# metadata (None: a descriptor the kernel lowered to a pointer, shape and strides, which needs no encoding)
_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")
MAX_MAPS = 64  # CUtensorMaps kept per recorded descriptor (then its table starts over)


def _fp4_padded(meta) -> bool:
    """Whether a descriptor's TMA metadata marks it fp4-padded (read as Triton 3.6's `make_tensordesc_arg` reads
    it; metadata that cannot be read so counts as padded, which keeps the launch on the ordinary replay)."""
    try:
        return bool(meta["fp4_padded"])
    except (KeyError, IndexError, TypeError):
        return True


def _encode(descriptor, meta):
    """Triton 3.6's expansion of a host descriptor with TMA metadata: [CUtensorMap, *shape, *strides]."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg(descriptor, meta)


def hooks_idle() -> bool:
    """Whether no Triton launch hook is installed (none, or empty hook chains): a replay then passes None for
    the launch metadata and both hooks, which the launcher skips, as it does the JIT's empty chains."""
    runtime = getattr(_knobs, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _name(kernel) -> str:
    return getattr(kernel, "__name__", type(kernel).__name__)


_DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)


def _on(template, base: torch.Tensor):
    """A copy of the descriptor ``template`` with ``base`` as its base: the template's fields, no
    re-validation (the template passed it, and the signature fixes everything it checked but the address,
    whose alignment is part of the signature too)."""
    copy = object.__new__(type(template))
    copy.__dict__.update(template.__dict__)
    copy.base = base
    return copy


class _Launch:
    """One recorded launch: the compiled kernel, its grid, and its arguments in the kernel's parameter
    order, with each slot tensor replaced by its index in `slot_of` and each descriptor by its index in
    `desc_of` (with the recorded descriptor as the template).  `direct`: a `_Direct`, or None (launched
    through the compiled kernel's launcher)."""

    __slots__ = ("args", "compiled", "desc_of", "direct", "grid", "slot_of")

    def __init__(self, compiled, grid: tuple[int, int, int], args: list, slot_of: tuple[tuple[int, int], ...],
                 desc_of: tuple[tuple[int, int, object], ...] = ()):
        self.compiled, self.grid, self.args, self.slot_of, self.desc_of = compiled, grid, args, slot_of, desc_of
        self.direct = _Direct.of(self) if DIRECT_TRITON else None


class _Direct:
    """A recorded launch made through Triton 3.6's C launcher with its arguments pre-expanded (module
    docstring, "Direct launches"): `args` is the whole argument list the C launcher takes, grid and stream
    included, with each slot tensor's place in `slot_at` and each encoded descriptor's in `maps`."""

    __slots__ = ("args", "launcher", "maps", "slot_at")
    STREAM_AT = 3  # the stream's place in the C launcher's arguments: after gridX, gridY, gridZ

    def __init__(self, args: list, launcher, maps: list, slot_at: list) -> None:
        self.args, self.launcher, self.maps, self.slot_at = args, launcher, maps, slot_at

    @staticmethod
    def of(launch: _Launch) -> _Direct | None:
        """The direct form of ``launch``, or None where its launcher is not of the form read in Triton 3.6
        (scratch memory to allocate per launch, another wrapper, descriptors it does not expand, or an fp4
        descriptor, whose shape the wrapper widens)."""
        run = launch.compiled.run
        wrapper = getattr(run, "launch", None)
        if (wrapper is None or getattr(run, "global_scratch_size", 1) != 0
                or getattr(run, "profile_scratch_size", 1) != 0
                or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
            return None
        code = getattr(wrapper, "__code__", None)
        if code is None:  # no descriptors: the C launcher itself
            launcher, indices, metas = wrapper, set(), []
        elif code.co_freevars == _WRAPPER_CELLS:
            launcher, indices, metas = (cell.cell_contents for cell in wrapper.__closure__)
            metas = list(metas) if metas else [None] * len(indices)
        else:
            return None
        descriptors = {position: (slot, template) for position, slot, template in launch.desc_of}
        if set(indices) != set(descriptors) or len(metas) != len(indices):
            return None
        if any(meta is not None and _fp4_padded(meta) for meta in metas):
            return None  # the wrapper widens such a descriptor's shape after the map: not expanded here
        slots = dict(launch.slot_of)
        args = [*launch.grid, None, launch.compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                None, None, launch.compiled.packed_metadata, None, None, None]
        slot_at, maps = [], []
        meta_of = dict(zip(sorted(indices), metas))
        for position, value in enumerate(launch.args):
            if position in slots:
                slot_at.append((len(args), slots[position]))
                args.append(None)
            elif position in descriptors:
                slot, template = descriptors[position]
                meta = meta_of[position]
                if meta is None:  # lowered to a pointer: the base, then shape and strides twice, as the wrapper
                    slot_at.append((len(args), slot))
                    args += [None, *template.shape, *template.strides, template.padding == "nan",
                             *template.shape, *template.strides]
                else:
                    maps.append((len(args), slot, template, meta, {}))
                    args += [None, *template.shape, *template.strides]
            else:
                args.append(value)
        return _Direct(args, launcher, maps, slot_at)

    def launch(self, slots: tuple[torch.Tensor, ...], stream: int) -> None:
        args = self.args.copy()
        args[self.STREAM_AT] = stream
        for at, slot in self.slot_at:
            args[at] = slots[slot]
        for at, slot, template, meta, table in self.maps:
            base = slots[slot]
            address = base.data_ptr()
            encoded = table.get(address)
            if encoded is None:
                if len(table) >= MAX_MAPS:
                    table.clear()
                encoded = table[address] = _encode(_on(template, base), meta)[0]
            args[at] = encoded
        self.launcher(*args)


class Recorder:
    """The ``wrap`` a launcher runs under to record its launches (see the module docstring).

    ``slots``: every tensor the launches may take, in a fixed order the replay repeats.  Each launch goes
    through Triton's JIT as usual; a tensor argument is matched to the first slot with the same address,
    dtype, shape and strides (none: the recording is refused)."""

    def __init__(self, slots: tuple[torch.Tensor, ...]) -> None:
        self.slots = slots
        self.launches: list[_Launch] = []
        self.ok = True
        self.why = ""

    def __call__(self, kernel):
        return _Recording(self, kernel)

    def refuse(self, why: str) -> None:
        if self.ok:
            self.ok, self.why = False, why

    def _slot(self, t: torch.Tensor, layout: bool = True) -> int | None:
        """The first slot with ``t``'s address and dtype, and with ``layout`` its shape and strides too (the
        kernels address a slot through the strides recorded beside it as integers; a descriptor's base, which
        carries its own shape and strides, may be a view of the slot), or None.  Slots that share memory
        (k is v) are told apart by nothing here: the caller's key must include which slots share an address,
        so that a replay finds the same sharing."""
        ptr, dtype = t.data_ptr(), t.dtype
        for i, s in enumerate(self.slots):
            if (s.data_ptr() == ptr and s.dtype == dtype
                    and (not layout or (s.shape == t.shape and s.stride() == t.stride()))):
                return i
        return None

    def add(self, kernel, compiled, grid, args: tuple, kwargs: dict) -> None:
        if compiled is None or not hasattr(compiled, "packed_metadata"):  # the interpreter's launch returns None
            self.refuse("the launch returned no compiled kernel")
            return
        if hasattr(compiled, "result"):
            self.refuse("the kernel was still compiling")
            return
        if getattr(kernel, "pre_run_hooks", None):
            self.refuse(f"{_name(kernel)} has JIT pre-run hooks")
            return
        if callable(grid) or not all(isinstance(g, int) for g in grid) or not 1 <= len(grid) <= 3:
            self.refuse(f"grid {grid!r} is not 1-3 integers")
            return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        names = set(kernel.arg_names)
        bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        values = list(bound.arguments.values())
        slot_of, desc_of = [], []
        for position, value in enumerate(values):
            if isinstance(value, _DESCRIPTORS):
                base = value.base
                slot = self._slot(base, layout=False) if isinstance(base, torch.Tensor) else None
                if slot is None:
                    self.refuse(f"descriptor {kernel.arg_names[position]} of {_name(kernel)} is not over one of "
                                "the call's tensors")
                    return
                desc_of.append((position, slot, _on(value, None)))  # the template keeps no tensor alive
                values[position] = None
            elif isinstance(value, torch.Tensor):
                slot = self._slot(value)
                if slot is None:
                    self.refuse(f"argument {kernel.arg_names[position]} of {_name(kernel)} is not one of the "
                                "call's tensors")
                    return
                slot_of.append((position, slot))
                values[position] = None
            elif not isinstance(value, (int, float, bool, str, type(None), triton.language.dtype)):
                # anything else built per call around an address
                self.refuse(f"argument {kernel.arg_names[position]} of {_name(kernel)} is a "
                            f"{type(value).__name__}")
                return
        self.launches.append(_Launch(compiled, grid, values, tuple(slot_of), tuple(desc_of)))

    def replay(self, slots: tuple[torch.Tensor, ...], stream: int) -> None:
        """Launch the recorded kernels on ``slots`` (same signature as the recorded ones) on ``stream``."""
        for launch in self.launches:
            if launch.direct is not None:
                launch.direct.launch(slots, stream)
                continue
            args = launch.args.copy()
            for position, slot in launch.slot_of:
                args[position] = slots[slot]
            for position, slot, template in launch.desc_of:
                args[position] = _on(template, slots[slot])
            compiled = launch.compiled
            compiled.run(*launch.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)


class _Recording:
    """`Recorder(kernel)[grid](*args, **kwargs)`: Triton's JIT launch, then the recorder keeps what it ran."""

    def __init__(self, recorder: Recorder, kernel) -> None:
        self.recorder, self.kernel = recorder, kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled = self.kernel[grid](*args, **kwargs)
            self.recorder.add(self.kernel, compiled, grid, args, kwargs)
            return compiled
        return run
