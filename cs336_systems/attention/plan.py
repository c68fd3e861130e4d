"""Which flash-triton kernels run for a call: one pure function over the problem, the device and the options.

    plan(Problem, Device, FlashOptions) -> Plan
        forward   "portable" | "hopper" | "hopper-ws"      (kernels/portable, hopper/forward[_ws])
        backward  "fused" | "two-kernel"                    (kernels/hopper/backward, or dQ then dK/dV)
        dq, dkdv  "portable" | "hopper" | "-" (fused)       (kernels/hopper/dq, hopper/dkdv)
        traced    "triton_op" | "custom_op" | "eager"       (how a torch.compile'd call launches them)
        reasons   one line per choice, naming the rule of `RULES` (or the constraint) that decided it

Every size rule lives in `RULES`, each with a one-line reason and the measurement that set it (device kind
and the section of docs/flash-attention-experiments.md); `explain` renders a plan, `rules_table` the table
for the docs.  A Gluon kernel is a candidate only where the device can run it (`Device.gluon`: a compute
capability 9.x GPU, Triton 3.6, TMA not switched off, 16-bit inputs) and the tensors suit TMA
(`Problem.tma_layout`); then its option decides: "off" never, "on" wherever the inputs allow (every head
dim the kernel has), "auto" where a rule of `RULES` matches.  Which Gluon forward runs, once one does, is
the "fwd-ws" rules' choice under every option (the warp-specialized kernel where one matches).  The rules
were measured on an H100 and an H200 (both 132 SMs): a rule's program minimum is counted in programs per
SM, so it scales with the device.

Sizes may be symbolic (`torch.SymInt`: a torch.compile'd call after a shape change, ``dynamic=True``,
``mark_dynamic``).  The plan then defers every kernel choice to run time ("at run time") and the traced
path is the custom op, whose kernel plans again on the concrete sizes of each call: a comparison on a
symbolic size here would install a guard and recompile the graph at every rule boundary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import triton

from cs336_systems import switches

MODES = ("auto", "on", "off")
FORWARDS = ("portable", "hopper", "hopper-ws")
BACKWARDS = ("fused", "two-kernel")
AT_RUN_TIME = "at run time"
# The Gluon API the Hopper kernels are written against; other Triton releases take the portable kernels.
GLUON_TRITON_VERSIONS = ("3.6.",)
# Head dims each Gluon kernel has ("on" takes every one of them).
# "fwd-ws": the forward's warp-specialized kernel (hopper/forward_ws), which its rules take in place of
# hopper/forward wherever the Gluon forward runs.
KERNEL_HEAD_DIMS = {"fwd": (64, 80, 96, 128, 256), "fwd-ws": (64, 80, 96, 128, 256), "dq": (64, 80, 96, 128, 256),
                    "dkdv": (64, 80, 96, 128, 256), "fused": (64, 80, 96, 128, 256)}
MAX_SLICES = 65535  # a grid's second dimension: (z, h) slices of one launch


def _is_symbolic(value) -> bool:
    return isinstance(value, torch.SymInt)


@dataclass(frozen=True)
class Problem:
    """One attention call's sizes: q (batch, heads, n_q, head_dim), k and v (batch, kv_heads, n_k, head_dim).
    ``tma_layout``: the tensors the kernels read and write suit TMA descriptors (unit stride on d, other
    strides multiples of 16 bytes, 16-byte aligned base addresses; `tma_layout_ok`).  ``kv_contiguous``:
    K and V are contiguous (the portable kernels' descriptors cover whole tensors)."""

    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    tma_layout: bool = True
    kv_contiguous: bool = True

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool, tensors: tuple[torch.Tensor, ...] = (),
           addresses: bool = True) -> Problem:
        """From (Z, H, N, d) views, or (BH, N, d) ones (one batch of BH heads); ``tensors``: every tensor the
        kernels address (q, k, v, and o, do for a backward), whose layout decides ``tma_layout``;
        ``addresses``: check base addresses too (not while tracing, where tensors have none)."""
        z, heads, n_q, d = q.shape if q.dim() == 4 else (1, *q.shape)
        sizes = (z, heads, k.shape[-3], n_q, k.shape[-2], d)
        if any(_is_symbolic(s) for s in sizes):  # no layout questions: they would guard on the symbols
            return cls(*sizes, q.dtype, bool(causal), tma_layout=False, kv_contiguous=False)
        tensors = tensors or (q, k)
        return cls(*sizes, q.dtype, bool(causal),
                   tma_layout=all(tma_layout_ok(t, addresses) for t in tensors),
                   kv_contiguous=all(t.is_contiguous() for t in tensors[1:3]))

    @property
    def symbolic(self) -> bool:
        return any(_is_symbolic(s) for s in (self.batch, self.heads, self.kv_heads, self.n_q, self.n_k,
                                             self.head_dim))

    def text(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"B {self.batch}, H {self.heads}{kv}, Nq {self.n_q}, Nk {self.n_k}, d {self.head_dim}, {dtype}, "
                f"{'causal' if self.causal else 'not causal'}")


def tma_layout_ok(t: torch.Tensor, addresses: bool = True) -> bool:
    """TMA's layout rules for a (Z, H, N, d) tensor: unit stride on d, every other stride a positive multiple
    of 16 bytes (a broadcast, zero-stride dimension of size > 1 is refused), and with ``addresses`` a
    16-byte aligned base address.  False for symbolic strides (decided at run time)."""
    if t.dim() != 4:
        return False
    strides = t.stride()
    if any(_is_symbolic(s) for s in strides) or any(_is_symbolic(n) for n in t.shape):
        return False
    size = t.element_size()
    ok = strides[-1] == 1 and all((s * size) % 16 == 0 and (s > 0 or n == 1)
                                  for s, n in zip(strides[:-1], t.shape[:-1]))
    return ok and (not addresses or t.data_ptr() % 16 == 0)


@dataclass(frozen=True)
class Device:
    """What the plan needs to know of a device.  ``kind``: "cuda" or "interpreter" (CPU tensors under
    TRITON_INTERPRET=1); ``capability``: compute capability major (0 off CUDA); ``gluon``: the Triton
    release has the Gluon API the Hopper kernels use; ``tma``: descriptors may be used (sm_90+ or the
    interpreter)."""

    kind: str
    name: str
    capability: int
    sm_count: int
    gluon: bool
    tma: bool
    index: int | None = None  # the CUDA device (None for presets and the interpreter)

    @classmethod
    def of(cls, device: torch.device) -> Device:
        """This process's device (CUDA facts cached per device index)."""
        if device.type == "cuda":
            return _cuda_device(device.index if device.index is not None else torch.cuda.current_device())
        return cls("interpreter" if switches.interpreter_active() else device.type, device.type, 0, 1, False,
                   switches.interpreter_active())

    @classmethod
    def preset(cls, name: str) -> Device:
        """A known GPU without one present ("H100", "H200"): for tests and ``--explain --device``."""
        if name not in PRESETS:
            raise ValueError(f"device preset must be one of {', '.join(PRESETS)}; got {name!r}")
        return PRESETS[name]


PRESETS = {
    "H100": Device("cuda", "NVIDIA H100 80GB HBM3", 9, 132, True, True),
    "H200": Device("cuda", "NVIDIA H200", 9, 132, True, True),
    "A100": Device("cuda", "NVIDIA A100-SXM4-80GB", 8, 108, True, False),
}


@functools.cache
def _cuda_device(index: int) -> Device:
    props = torch.cuda.get_device_properties(index)
    return Device("cuda", props.name, props.major, props.multi_processor_count,
                  triton.__version__.startswith(GLUON_TRITON_VERSIONS), props.major >= 9, index)


@dataclass(frozen=True)
class FlashOptions:
    """Explicit kernel choices (benchmarks and A/B runs pass these; the environment only overrides them, for
    debugging: `with_env`).  Each of ``hopper_fwd`` (the Gluon forward), ``hopper_bwd`` (every Gluon backward
    kernel: dQ, dK/dV and the fused pass) and ``fused_bwd`` (the fused pass) is "auto" (the rules of `RULES`),
    "on" (wherever the inputs allow) or "off"; ``tma`` False: no TMA descriptors anywhere (so no Gluon
    kernel either)."""

    hopper_fwd: str = "auto"
    hopper_bwd: str = "auto"
    fused_bwd: str = "auto"
    tma: bool = True

    def __post_init__(self) -> None:
        for name in ("hopper_fwd", "hopper_bwd", "fused_bwd"):
            value = getattr(self, name)
            if value not in MODES:
                raise ValueError(f"FlashOptions.{name} must be one of {', '.join(MODES)}; got {value!r}")
        if not isinstance(self.tma, bool):
            raise ValueError(f"FlashOptions.tma must be a bool; got {self.tma!r}")

    def with_env(self) -> FlashOptions:
        """These options with the switches set in the environment applied over them."""
        mode = {"0": "off", "1": "on"}
        env = {name: switches.read(var) for name, var in _OPTION_SWITCHES.items()}
        changes = {name: mode[value] for name, value in env.items() if value and name != "tma"}
        if env["tma"] == "0":
            changes["tma"] = False
        return replace(self, **changes) if changes else self

    def text(self) -> str:
        """A compact form ("" for the defaults): the custom ops carry options as this string."""
        parts = [f"{name}={getattr(self, name)}" for name in ("hopper_fwd", "hopper_bwd", "fused_bwd")
                 if getattr(self, name) != "auto"]
        if not self.tma:
            parts.append("tma=off")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> FlashOptions:
        if not text:
            return DEFAULT_OPTIONS
        fields = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name == "tma":
                if value not in ("on", "off"):
                    raise ValueError(f"flash option tma must be on or off; got {value!r} in {text!r}")
                fields["tma"] = value == "on"
            elif name in ("hopper_fwd", "hopper_bwd", "fused_bwd"):
                fields[name] = value
            else:
                raise ValueError(f"unknown flash option {name!r} in {text!r}")
        return cls(**fields)


DEFAULT_OPTIONS = FlashOptions()
_OPTION_SWITCHES = {"hopper_fwd": "CS336_FLASH_HOPPER_FWD", "hopper_bwd": "CS336_FLASH_HOPPER_BWD",
                    "fused_bwd": "CS336_FLASH_FUSED_BWD", "tma": "CS336_FLASH_TMA"}


@dataclass(frozen=True)
class Rule:
    """Where a Gluon kernel is taken under "auto": ``head_dims``, ``causal`` (None: either), ``min_q`` <=
    n_q <= ``max_q``, n_k >= ``min_k``, ``same_heads`` (no grouped K/V heads) or ``grouped`` (grouped K/V
    heads only), and at least ``per_sm``
    programs per SM, a program being ``unit`` rows of ``axis`` ("q" or "k") of one head of ``heads`` ("q" or
    "kv"); ``devices``: substrings of the GPU's name the rule holds on (None: every device the kernel runs on;
    a rule measured to differ between GPUs of one architecture names them).  ``reason``: why, in a line;
    ``measured``: where (device, and the experiments doc's section)."""

    kernel: str
    head_dims: tuple[int, ...]
    reason: str
    measured: str
    causal: bool | None = None
    min_q: int = 0
    max_q: int | None = None
    min_k: int = 0
    same_heads: bool = False
    grouped: bool = False
    per_sm: int = 0
    axis: str = "q"
    unit: int = 128
    heads: str = "q"
    devices: tuple[str, ...] | None = None

    def programs(self, p: Problem) -> int:
        rows = p.n_q if self.axis == "q" else p.n_k
        return -(-rows // self.unit) * p.batch * (p.heads if self.heads == "q" else p.kv_heads)

    def matches(self, p: Problem, device: Device) -> bool:
        return ((self.devices is None or any(name in device.name for name in self.devices))
                and p.head_dim in self.head_dims and (self.causal is None or self.causal == p.causal)
                and p.n_q >= self.min_q and (self.max_q is None or p.n_q <= self.max_q) and p.n_k >= self.min_k
                and (not self.same_heads or p.heads == p.kv_heads) and (not self.grouped or p.heads != p.kv_heads)
                and self.programs(p) >= self.per_sm * device.sm_count)

    def text(self) -> str:
        parts = [f"d {'/'.join(map(str, self.head_dims))}"]
        if self.causal is not None:
            parts.append("causal" if self.causal else "not causal")
        if self.min_q or self.max_q:
            parts.append(f"Nq {self.min_q}-{self.max_q}" if self.max_q else f"Nq >= {self.min_q}")
        if self.min_k:
            parts.append(f"Nk >= {self.min_k}")
        if self.same_heads:
            parts.append("no grouped heads")
        if self.grouped:
            parts.append("grouped heads")
        if self.devices:
            parts.append(f"on {' / '.join(self.devices)}")
        if self.per_sm:
            parts.append(f">= {self.per_sm} program{'s' if self.per_sm > 1 else ''} of {self.unit} "
                         f"{'queries' if self.axis == 'q' else 'keys'} per SM")
        return ", ".join(parts)


_EXP = "docs/flash-attention-experiments.md"
# The size rules, by kernel: the first rule that matches takes the kernel (under "auto").
RULES: tuple[Rule, ...] = (
    # forward (hopper/forward, or hopper/forward_ws where a "fwd-ws" rule matches too)
    Rule("fwd", (80, 96), "sliced products over d skip the padded tile's zero columns: faster at every length "
         "measured", f"H200, 31.3 vs 41.4 us at B 4, H 32, N 512 ({_EXP} §14)", min_k=512, per_sm=1),
    Rule("fwd", (128,), "warp-specialized producer/consumer pipeline: faster from 2048 keys",
         f"H100, 0.164 vs 0.194 ms at B 4, H 16, N 2048 ({_EXP} §14)", min_k=2048, per_sm=1),
    Rule("fwd", (256,), "the warp-specialized forward (64-key tiles, separate K and V rings) from a 128-row "
         "program per SM", f"H200, 0.460 vs 0.636 ms (portable) at B 1, H 8, N 8192, 0.747 vs 2.134 without the "
         f"mask, 0.379 vs 0.588 (one program) at B 1, H 2, N 16384 (256 programs); 32-key tiles lost at 128 "
         f"programs ({_EXP} §20, §21)", min_k=2048, per_sm=1, devices=("H200",)),
    Rule("fwd", (256,), "32-key tiles amortize a program's unoverlapped products only on long rows",
         f"H200, B·H 1: 256 programs at N 32768 won, 128 at N 16384 lost ({_EXP} §14)", min_k=16384, per_sm=1),
    # which Gluon forward: the warp-specialized one (hopper/forward_ws) where one of these matches, else hopper/forward
    Rule("fwd-ws", (64, 128), "one program's two warpgroups run in lock step; split, each one's softmax runs "
         "under the other's products", f"H100, d 128: 0.908 vs 1.154 ms at B 1, H 8, N 16384; d 64 1.311 vs "
         f"1.541 ({_EXP} §14)"),
    Rule("fwd-ws", (80, 96), "d 128's warp-specialized tiles, S over d in slices: faster from 2048 keys; at 512 "
         "the one-program kernel's 64-key tiles win", f"H200, 0.413 vs 0.551 ms at B 1, H 16, N 8192 (d 80); "
         f"0.044 vs 0.034 ms at B 4, H 32, N 512; not yet measured on an H100 ({_EXP} §18, §19)",
         min_k=2048, devices=("H200",)),
    Rule("fwd-ws", (256,), "64-key tiles, K and V in separate two-stage rings: 0.79-0.81x the 32-key joint ring, "
         "which was 0.86-0.93x the forward planned before it; from a 128-row program per SM (the 32-key tiles lost "
         "at 128 programs, 1.27x)", f"H200, B 1, H 8, N 8192, B 4, H 16, N 2048 and B 1, H 2, N 16384; not yet "
         f"measured on an H100 ({_EXP} §20, §21)", per_sm=1, devices=("H200",)),
    # dQ (hopper/dq)
    Rule("dq", (80, 96), "sliced products; slower than the portable kernel past 16384 queries",
         f"H200, N 8192 and 65536 measured ({_EXP} §14)", min_q=512, max_q=16384),
    Rule("dq", (128,), "without the mask a program's key loop is long enough to pipeline from 1024 queries",
         f"H100 ({_EXP} §14)", causal=False, min_q=1024),
    Rule("dq", (64,), "causal, medium lengths with two 64-row programs per SM; loses at long rows",
         f"H100 kernel sweep B·H 1-64 x N 1024-16384, +13% at the leaderboard ({_EXP} §14)",
         causal=True, min_q=2048, max_q=4096, per_sm=2, unit=64),
    Rule("dq", (128,), "causal, medium lengths with a 64-row program per SM; loses at long rows",
         f"H100 kernel sweep B·H 1-64 x N 1024-16384 ({_EXP} §14)",
         causal=True, min_q=2048, max_q=8192, per_sm=1, unit=64),
    Rule("dq", (256,), "whole 256-wide tiles: faster from 2048 queries",
         f"H200, B 2, H 4, N 2048 the shortest measured ({_EXP} §14)", min_q=2048),
    # dK/dV (hopper/dkdv)
    Rule("dkdv", (80, 96), "the portable kernel pads these to 128 columns too; the Gluon one pipelines them",
         f"H200, 59 vs 82 us at B 4, H 32, N 512 ({_EXP} §14)", min_q=512, same_heads=True, per_sm=2,
         axis="k", unit=64, heads="kv"),
    Rule("dkdv", (64, 128), "enough 64-key programs to balance a causal grid (two per SM)",
         f"H100/H200, B 4, H 16, N 2048 the shortest measured; B·H 1, N 16384 lost ({_EXP} §14)",
         min_q=2048, same_heads=True, per_sm=2, axis="k", unit=64, heads="kv"),
    Rule("dkdv", (256,), "two warpgroups split the head dim of a 64-key block (hopper/backward_wide): dK and dV "
         "in one pass, four tile products instead of the one-accumulator parts' five",
         f"H200, backward 0.72-0.79x the parts' at B·H 4-64, N 2048-16384 ({_EXP} §20)", min_q=2048,
         same_heads=True),
    # the fused backward (hopper/backward): replaces both dQ and dK/dV
    Rule("fused", (64,), "five tile products instead of seven once a 128-key program per SM walks long rows",
         f"H100, 0.75-0.91x the two kernels; H200 (both consumers at 240 registers), 0.94x at the leaderboard "
         f"and B 4, H 16, N 8192 ({_EXP} §8)",
         causal=True, min_q=4096, per_sm=1, axis="k", unit=128, heads="kv"),
    Rule("fused", (128,), "five tile products instead of seven; pays from 1024 queries at d 128",
         f"H100, 0.69-0.94x the two kernels from N 1024 to 65536 ({_EXP} §8)",
         causal=True, min_q=1024, per_sm=1, axis="k", unit=128, heads="kv"),
    Rule("fused", (80, 96), "d 128's fused pass, products over d in slices: five tile products instead of seven",
         f"H200, 0.80-0.97x the two kernels' forward+backward at B 4, H 32, N 512 to B 1, H 16, N 32768; "
         f"not yet measured on an H100 ({_EXP} §18)",
         min_q=512, per_sm=1, axis="k", unit=128, heads="kv", devices=("H200",)),
    Rule("fused", (64, 128), "grouped heads: each group split among programs (`group_splits`) fills the grid",
         f"H200, H 32 / 8 and 32 / 1 at N 8192 (d 64, 128), B 4, H 32 / 8 at N 2048 (d 128); not yet measured "
         f"on an H100 ({_EXP} §18)",
         causal=True, min_q=2048, grouped=True, per_sm=1, axis="k", unit=128, heads="q", devices=("H200",)),
    Rule("fused", (64,), "balanced programs without the mask; grouped heads not measured",
         f"H100, 0.87-0.95x the two kernels from N 1024 ({_EXP} §8)", causal=False, min_q=1024, same_heads=True),
    Rule("fused", (128,), "balanced programs without the mask; 1.04x at N 1024, so from 4096",
         f"H100, 0.78-0.81x the two kernels from N 4096 ({_EXP} §8)", causal=False, min_q=4096, same_heads=True),
    Rule("fused", (128,), "grouped heads without the mask: the two kernels' dK/dV is the portable one there",
         f"H200, H 32 / 8, N 4096: 0.80x the two kernels; not yet measured on an H100 ({_EXP} §18)",
         causal=False, min_q=4096, grouped=True, devices=("H200",)),
)
KERNELS = ("fwd", "fwd-ws", "dq", "dkdv", "fused")


@dataclass(frozen=True)
class Plan:
    """The kernels of one call (see the module docstring); ``configs``: the portable kernels' tile
    configurations by kernel and where they came from (None where sizes are symbolic)."""

    forward: str
    backward: str
    dq: str
    dkdv: str
    traced: str
    reasons: tuple[tuple[str, str], ...] = field(default=())
    configs: dict | None = field(default=None, compare=False)
    configs_source: str = field(default="", compare=False)

    def reason(self, part: str) -> str:
        return dict(self.reasons).get(part, "")

    @property
    def gluon_kernels(self) -> tuple[str, ...]:
        """The parts that run a Gluon kernel."""
        out = []
        if self.forward != "portable":
            out.append("forward")
        if self.backward == "fused":
            out.append("fused")
        out += [name for name in ("dq", "dkdv") if getattr(self, name) == "hopper"]
        return tuple(out)


def _gluon_candidate(kernel: str, p: Problem, device: Device, options: FlashOptions) -> tuple[bool, str]:
    """Whether ``kernel``'s Gluon version may run at all here, and why not."""
    if not device.gluon or device.kind != "cuda" or device.capability != 9:
        return False, "Gluon kernels need a compute capability 9.x GPU and Triton 3.6"
    if not (options.tma and device.tma):
        return False, "TMA off (FlashOptions.tma / CS336_FLASH_TMA=0): no descriptors, no Gluon kernel"
    if p.dtype not in (torch.bfloat16, torch.float16):
        return False, f"the Gluon kernels take bfloat16 / float16, not {p.dtype}"
    if p.head_dim not in KERNEL_HEAD_DIMS[kernel]:
        return False, f"no Gluon {kernel} kernel at d {p.head_dim}"
    slices = p.batch * (p.heads if kernel in ("fwd", "dq") else p.kv_heads)
    if slices > MAX_SLICES:
        return False, f"{slices} (z, h) slices exceed a grid's {MAX_SLICES}"
    if not p.tma_layout:
        return False, "a tensor's strides or base address do not suit TMA"
    return True, ""


def _choose(kernel: str, mode: str, p: Problem, device: Device, options: FlashOptions) -> tuple[bool, str]:
    """Whether the Gluon ``kernel`` runs, and the reason."""
    if mode == "off":
        return False, f"switched off ({kernel}: off)"
    ok, why = _gluon_candidate(kernel, p, device, options)
    if not ok:
        return False, why
    if mode == "on":
        return True, "switched on: wherever the inputs allow"
    for rule in RULES:
        if rule.kernel == kernel and rule.matches(p, device):
            return True, f"rule [{rule.text()}]: {rule.reason}"
    return False, "no rule of RULES takes this size (measured slower or not measured)"


def plan(problem: Problem, device: Device, options: FlashOptions = DEFAULT_OPTIONS, *, traced: bool = True,
         configs: dict | None = None) -> Plan:
    """The kernels for ``problem`` on ``device`` under ``options`` (already merged with the environment, if
    wanted: `FlashOptions.with_env`).  ``traced``: also decide the traced path (an eager call passes False:
    its kernels launch directly, and the portable tile configurations are left to the launch, which may
    autotune them); ``configs``: the portable kernels' tile configurations (kernel -> `TileConfig`), looked
    up with `portable_configs` where not given; they decide the traced path's need for TMA descriptors.
    No device work."""
    p = problem
    if p.symbolic:
        return Plan(AT_RUN_TIME, AT_RUN_TIME, AT_RUN_TIME, AT_RUN_TIME, "custom_op",
                    (("traced", "symbolic sizes: the custom op plans each call on its concrete sizes"),))
    reasons = []
    fwd_on, why = _choose("fwd", options.hopper_fwd, p, device, options)
    forward = "portable"
    if fwd_on:  # which Gluon forward: the "fwd-ws" rules decide, whatever the forward's option
        ws, ws_why = _choose("fwd-ws", "auto", p, device, options)
        forward = "hopper-ws" if ws else "hopper"
        why += f"; {ws_why}" if ws else "; one program (no fwd-ws rule matches)"
    reasons.append(("forward", why))
    fused_mode = "off" if options.hopper_bwd == "off" else options.fused_bwd
    fused, why = _choose("fused", fused_mode, p, device, options)
    if fused:
        backward, dq, dkdv = "fused", "-", "-"
        reasons.append(("backward", why))
    else:
        backward = "two-kernel"
        reasons.append(("backward", f"two kernels: fused pass not taken ({why})"))
        dq_on, why = _choose("dq", options.hopper_bwd, p, device, options)
        dq = "hopper" if dq_on else "portable"
        reasons.append(("dq", why))
        dkdv_on, why = _choose("dkdv", options.hopper_bwd, p, device, options)
        dkdv = "hopper" if dkdv_on else "portable"
        reasons.append(("dkdv", why))
    source = ""
    if not traced:
        traced_path, why = "eager", "an eager call launches its kernels directly"
    elif device.kind == "interpreter":
        traced_path, why = "custom_op", "the interpreter's kernels cannot be launched by inductor (wrap_triton)"
    elif fwd_on or fused or dq == "hopper" or dkdv == "hopper":
        traced_path, why = "custom_op", "a Gluon kernel runs: its launch takes host-side TMA descriptors"
    else:
        if configs is None:
            configs, source = portable_configs(p, device)
        wants = [kernel for kernel in ("fwd", "dq") if configs[kernel].tma and not _split_d(p, kernel, device)]
        if wants and p.kv_contiguous and options.tma and device.tma:
            traced_path = "custom_op"
            why = f"the {'/'.join(wants)} tile configuration loads K/V through TMA descriptors"
        else:
            traced_path, why = "triton_op", "portable kernels with pointer loads: inductor launches them itself"
    reasons.append(("traced", why))
    return Plan(forward, backward, dq, dkdv, traced_path, tuple(reasons), configs, source)


# The kernels' modules are imported where used: this module is imported by benchmarks.json's loader
# (FlashOptions), which must not pay for importing Triton.
def _split_d(p: Problem, kernel: str, device: Device) -> bool:
    from cs336_systems.attention.kernels.portable.configs import d_tiles

    return bool(d_tiles(p.head_dim, p.dtype, kernel, device.capability if device.kind == "cuda" else None)[1])


def portable_configs(p: Problem, device: Device) -> tuple[dict, str]:
    """The portable kernels' tile configurations for ``p`` and where they come from: on this process's GPU
    `flash_autotune.select` (the autotune cache, else the tuned table of the GPU's architecture, else the
    default rule); for a preset device the tuned table or the default; the interpreter's fixed tiles."""
    from cs336_systems.attention.kernels.portable import autotune as flash_autotune
    from cs336_systems.attention.kernels.portable import configs as flash_configs

    bh = p.batch * p.heads
    if device.kind == "interpreter":
        return flash_configs.INTERPRETER, "the interpreter's fixed tiles"
    if device.index is not None:
        chosen = flash_autotune.select(bh, p.n_q, p.n_k, p.head_dim, p.dtype, p.causal,
                                       torch.device("cuda", device.index))
        return chosen, "kernels.portable.autotune.select: autotune cache, else the tuned sm_90 table, else the default rule"
    key = flash_configs.ShapeKey.of(bh, p.n_q, p.n_k, p.head_dim, p.dtype, p.causal)
    tuned = flash_configs.tuned_sm90(key) if device.capability == 9 else None
    if tuned is not None:
        return tuned, "the tuned sm_90 table (kernels.portable.configs.TUNED_SM90)"
    return flash_configs.default_config(key), "the default rule (kernels.portable.configs.default_config)"


def explain(problem: Problem, device: Device, options: FlashOptions = DEFAULT_OPTIONS) -> str:
    """The plan for ``problem`` as text, one line per part with its reason."""
    pl = plan(problem, device, options)
    lines = [f"problem: {problem.text()}", f"device:  {device.name} (sm_{device.capability}0, {device.sm_count} SMs"
             f"{', Gluon' if device.gluon else ''})", f"options: {options.text() or 'defaults'}",
             f"forward:  {pl.forward:<11} {pl.reason('forward')}",
             f"backward: {pl.backward:<11} {pl.reason('backward')}"]
    if pl.backward == "two-kernel":
        lines += [f"  dq:     {pl.dq:<11} {pl.reason('dq')}", f"  dkdv:   {pl.dkdv:<11} {pl.reason('dkdv')}"]
    lines.append(f"traced:   {pl.traced:<11} {pl.reason('traced')}")
    if pl.configs is not None:
        tiles = ", ".join(f"{kernel} {cfg.short()}" for kernel, cfg in pl.configs.items())
        lines.append(f"portable tiles: {tiles} ({pl.configs_source})")
    return "\n".join(lines)


def rules_table() -> str:
    """`RULES` as a Markdown table (the docs' plan table is generated from it)."""
    rows = ["| kernel | where (under \"auto\") | why | measured |", "|---|---|---|---|"]
    rows += [f"| {r.kernel} | {r.text()} | {r.reason} | {r.measured} |" for r in RULES]
    return "\n".join(rows)


DOC_TABLES = {"plan-table": rules_table, "switches-table": switches.markdown_table}


def fill_doc_tables(text: str) -> str:
    """``text`` (docs/flash-attention.md) with the generated tables between their markers
    (``<!-- NAME:start -->`` ... ``<!-- NAME:end -->`` for each NAME of `DOC_TABLES`); ValueError if a marker
    pair is missing."""
    for name, render in DOC_TABLES.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if start not in text or end not in text:
            raise ValueError(f"the document has no {start} ... {end} markers")
        head, rest = text.split(start, 1)
        text = f"{head}{start}\n{render()}\n{end}{rest.split(end, 1)[1]}"
    return text
