"""Tile configurations of the FlashAttention-2 Triton kernels, and how one is chosen for a call.

Three kernels take a configuration each (the backward preprocess D = rowsum(O * dO) runs in the dQ
kernel's prologue, with its query tile):

    "fwd"   forward:  BLOCK_M queries resident, loop over BLOCK_N keys
    "dkdv"  dK/dV:    BLOCK_N keys resident,    loop over BLOCK_M queries
    "dq"    dQ:       BLOCK_M queries resident, loop over BLOCK_N keys

The best configuration depends on the head dimension (register and shared-memory pressure), the
element size and arithmetic (fp32 tiles take twice the shared memory or more; tf32x3 or IEEE FMA dots),
causality (how much of the work is the masked diagonal band), the sequence length and the number of
(batch x head) slices: with B*H = 1 a forward at N = 4096 has only 32 query tiles of 128 for 132 SMs, so
smaller tiles (more programs) win there, while at the leaderboard shape (16 x 128 tiles) per-tile
efficiency decides.  `ShapeKey` buckets exactly those parameters.

Choice, first match wins (`autotune.select`):
  1. the autotune cache (`autotune`): configurations measured on this GPU model and Triton version;
  2. `TUNED_SM90`: configurations measured on an H100 (sm_90) with `python -m cs336_systems.flash_autotune`
     and pasted here, used on sm_90 devices; a shape between measured points takes the nearest one, and a
     split head-dim width with no entries of its own (d = 80 runs 64 + 16 columns) its padded width's (128);
  3. `default_config`: a conservative heuristic that fits every NVIDIA GPU from sm_80 on.
Under the Triton interpreter the tiles are fixed small (32 x 32): the interpreter runs each program as numpy
ops, and the property tests want many programs, ragged edges and several tiles per row, not speed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from cs336_systems import switches

KERNELS = ("fwd", "dkdv", "dq")
DTYPE_CLASSES = ("half", "fp32x3", "fp32ieee")
TMA_SUFFIX = ("", "t", "b")  # TileConfig.tma 0 / 1 / 2 in the text form
# What the kernels support: every multiple of 8 up to 256 (rows of 16 bytes or more in 16-bit dtypes, as TMA
# and vectorized loads want).  The register tiles are `d_tiles(d, dtype, kernel)`: one `block_d(d)` wide whose
# padding columns are masked, or two power-of-two tiles side by side.
HEAD_DIMS = tuple(range(8, 257, 8))


def block_d(head_dim: int) -> int:
    """The head dim's padded tile: the next power of two >= max(head_dim, 16) (tl.arange needs a power of
    two, tl.dot a K of at least 16): the kernels' tile by default, so d = 80 and 96 share d = 128's
    configurations and 160 and 192 share d = 256's (`ShapeKey`)."""
    return max(16, 1 << (head_dim - 1).bit_length())


SPLIT_D_ENV = "CS336_FLASH_SPLIT_D"

# Two-tile layouts (BLOCK_D, BLOCK_D2): the orders that ran clean on an H100 (Triton 3.6) when each kernel was
# compared alone with float64 under compute-sanitizer; a 64-wide first tile with a 32-wide second (d 88, 96) or
# a masked 16-wide one (d 72) gave wrong forward scores and out-of-bounds shared memory reads in Triton's wgmma
# code there (docs/flash-attention-experiments.md, Section 13).  Head dims not listed keep the padded tile.
SPLIT_LAYOUTS = {48: (32, 16), 80: (64, 16), 88: (32, 64), 96: (32, 64), 160: (32, 128), 192: (64, 128)}

# Head dims whose forward runs its split layout by default (16-bit inputs): none.  The split forward at d 80 and
# 96 measured faster than the padded tile at the 2.7B model's attention shape, but with one key (N_k 1) under
# concurrent load it hit illegal memory accesses on an H200 (Triton 3.6) where the padded forward ran clean
# (docs/flash-attention-experiments.md, Section 13); the backward kernels' split tiles fault too.
# The mechanism stays for a Triton release without the fault: a head dim listed here runs its forward split by
# default on devices of a compute capability major in FORWARD_SPLIT_CAPABILITIES and off CUDA.
FORWARD_SPLIT_HEAD_DIMS: tuple[int, ...] = ()
FORWARD_SPLIT_CAPABILITIES = (9,)


def _split_switch() -> str:
    """``CS336_FLASH_SPLIT_D``: "" (unset: the default), "0" or "1"; anything else is a ValueError."""
    return switches.read(SPLIT_D_ENV)


def split_opted_in(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``CS336_FLASH_SPLIT_D=1`` puts every kernel of this call on its split layout (16-bit inputs at a
    head dim of `SPLIT_LAYOUTS`): then the configurations are keyed by the split width (`ShapeKey`).  A value
    other than unset, "0" or "1" is a ValueError."""
    return _split_switch() == "1" and dtype != torch.float32 and head_dim in SPLIT_LAYOUTS


def d_tiles(head_dim: int, dtype: torch.dtype, kernel: str, capability: int | None = None) -> tuple[int, int]:
    """One kernel's head-dim register tiles (BLOCK_D, BLOCK_D2) (``kernel`` one of `KERNELS`): the one padded
    tile `block_d(d)` and BLOCK_D2 = 0, or two power-of-two tiles side by side that cover d with fewer columns:
    80 = 64 + 16, 96 = 32 + 64 (`SPLIT_LAYOUTS`).  Every matmul over d becomes two (Q K^T and dO V^T sum two
    products; O, dQ, dK, dV are two accumulators), so the padding's work is gone: a padded d = 80 tile
    multiplies 128 columns, the split one 80.

    By default (``CS336_FLASH_SPLIT_D`` unset) the forward of 16-bit inputs at `FORWARD_SPLIT_HEAD_DIMS` (none at
    present) runs split and everything else padded; ``capability`` is the CUDA device's compute capability
    major (None off CUDA, e.g. in the interpreter), and a default split forward applies only at
    `FORWARD_SPLIT_CAPABILITIES` and off CUDA.  ``CS336_FLASH_SPLIT_D=0``: padded everywhere.  ``=1`` (opt-in,
    experimental): every kernel at every head dim of `SPLIT_LAYOUTS` runs split; on Hopper (Triton 3.6) the
    split kernels hit illegal memory accesses, and the backward's can return NaN without an error, under
    concurrent load (docs/flash-attention-experiments.md, Section 13); the first such choice in a process
    warns (RuntimeWarning, SPLIT_D_WARNING).  float32 keeps the padded tile in every case (its split kernels
    faulted).  The variable is read at every eager call, but a torch.compile'd call keeps the tiles it was
    traced with (set it before compiling).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    switch = _split_switch()  # read once: this runs on every call
    if switch == "0" or dtype == torch.float32 or head_dim not in SPLIT_LAYOUTS:
        return block_d(head_dim), 0
    if switch == "1":
        global _split_warned
        if not _split_warned:  # once a process
            _split_warned = True
            warnings.warn(SPLIT_D_WARNING, RuntimeWarning, stacklevel=2)
        return SPLIT_LAYOUTS[head_dim]
    if kernel == "fwd" and head_dim in FORWARD_SPLIT_HEAD_DIMS and capability in (None, *FORWARD_SPLIT_CAPABILITIES):
        return SPLIT_LAYOUTS[head_dim]
    return block_d(head_dim), 0


SPLIT_D_WARNING = (f"{SPLIT_D_ENV}=1: split head-dim tiles are experimental; on Hopper with Triton 3.6 the "
                   "split kernels can hit illegal memory accesses, and the backward's return NaN without an error "
                   "(docs/flash-attention-experiments.md, Section 13)")
_split_warned = False


N_BUCKETS = tuple(2**i for i in range(7, 17))  # 128 ... 65536
BH_BUCKETS = (1, 4, 16, 64)


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_M (queries) x BLOCK_N (keys) tile, warps per program, software-pipelining depth, and how the
    forward / dQ kernel streams K and V (`tma`): 0 pointer loads; 1 TMA descriptors for the unmasked tiles,
    bounds-masked pointer loads for the diagonal band; 2 descriptors for the band too, where BLOCK_N divides
    N (else mode 1).  `launch.use_tma` decides whether the tensors allow descriptors; the dK/dV kernel
    has no descriptor path and ignores the field.  `parts` (dK/dV kernel only; the others ignore it): 1
    accumulates dK and dV in one program; 2 runs two passes over the same tiles, one accumulating dV and one
    dK, so each program keeps one (BLOCK_N, d) float32 accumulator instead of two (it recomputes P, and the
    dK pass dP, in each: 5 tile products instead of 4).  Text form: "64x128w4s3", with a trailing "t" for
    mode 1 ("64x128w4s3t") or "b" for mode 2 ("64x128w4s3b"), then "p2" for two passes ("32x64w8s2p2")."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        if self.tma not in (0, 1, 2):
            raise ValueError(f"TileConfig.tma must be 0, 1 or 2; got {self.tma!r}")
        if self.parts not in (1, 2):
            raise ValueError(f"TileConfig.parts must be 1 or 2; got {self.parts!r}")
        object.__setattr__(self, "tma", int(self.tma))  # True / False -> 1 / 0
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (tl.dot's minimum); got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be one of 1, 2, 4, 8, 16; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages must be >= 1; got {self.num_stages}")

    def launch_kwargs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)

    def short(self) -> str:
        parts = "p2" if self.parts == 2 else ""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}{TMA_SUFFIX[self.tma]}{parts}"

    @classmethod
    def parse(cls, text: str) -> TileConfig:
        """Inverse of `short`: "128x64w4s3" -> TileConfig(128, 64, 4, 3); "64x128w4s3t" -> (..., tma=1);
        "32x64w8s2p2" -> (..., parts=2)."""
        try:
            parts = 2 if text.endswith("p2") else 1
            body = text[:-2] if parts == 2 else text
            tma = TMA_SUFFIX.index(body[-1]) if body[-1:] in TMA_SUFFIX[1:] else 0
            tiles, rest = (body[:-1] if tma else body).split("w")
            warps, stages = rest.split("s")
            block_m, block_n = tiles.split("x")
            return cls(int(block_m), int(block_n), int(warps), int(stages), tma, parts)
        except ValueError as exc:
            raise ValueError(f"tile config {text!r} is not of the form <BLOCK_M>x<BLOCK_N>w<warps>s<stages>: {exc}") from None


FP32_DOT_ENV = "CS336_FLASH_FP32_DOT"


def fp32_dot() -> str:
    """How the kernels multiply float32 tiles: "tf32x3" (default) or "ieee" (``CS336_FLASH_FP32_DOT``).

    "tf32x3" splits each operand into a TF32 high part and a TF32 remainder and sums three tensor-core
    products (hi*hi + hi*lo + lo*hi; the dropped lo*lo term is ~2^-22 relative): close to fp32 accuracy at
    tensor-core speed.  It is the arithmetic PyTorch's own fp32 SDPA kernel (mem-efficient, CUTLASS's
    OpMultiplyAddFastF32) uses on sm_80+.  "ieee" multiplies on the FMA units, exact fp32 products, several
    times slower and register-hungry at d >= 64 (docs/flash-attention-experiments.md, Section 7).
    """
    return switches.read(FP32_DOT_ENV) or "tf32x3"


def dtype_class(dtype: torch.dtype) -> str:
    """fp16 shares bf16's tables: same element size, same tensor-core rate.  float32 is "fp32x3" (tf32x3
    dots, tensor cores) or "fp32ieee" (FMA dots): different arithmetic, different best tiles (and different
    shared memory: an IEEE-tuned tile can run out of it with tf32x3).  Earlier versions had one float32
    class, "fp32", tuned with IEEE dots; autotune-cache entries under that name are never read."""
    if dtype == torch.float32:
        return "fp32x3" if fp32_dot() == "tf32x3" else "fp32ieee"
    if dtype in (torch.bfloat16, torch.float16):
        return "half"
    raise ValueError(f"flash-triton supports float32, bfloat16, float16; got dtype {dtype}")


def _bucket(value: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if value <= bucket:
            return bucket
    return buckets[-1]


@dataclass(frozen=True)
class ShapeKey:
    """What a configuration is tuned for: the kernels' head-dim register width (`d_tiles`), dtype class, causal,
    N bucket, B*H bucket."""

    head_dim: int
    dtype: str
    causal: bool
    n_bucket: int
    bh_bucket: int

    @classmethod
    def of(cls, bh: int, n_queries: int, n_keys: int, head_dim: int, dtype: torch.dtype, causal: bool) -> ShapeKey:
        """The key of a call: its head dim is the kernels' register width (what registers and shared memory
        depend on): the padded tile's, so d = 80, 112 and 128 share configurations (one 128-wide tile; a
        forward that runs split by default holds fewer columns, so they fit it too); with every kernel's split
        tiles opted in (`split_opted_in`), the split width: d = 80 in 16-bit types has its own (64 + 16)."""
        n = max(n_queries, n_keys)
        cls_ = dtype_class(dtype)  # first: it names an unsupported dtype
        width = sum(SPLIT_LAYOUTS[head_dim]) if split_opted_in(head_dim, dtype) else block_d(head_dim)
        return cls(width, cls_, bool(causal), _bucket(n, N_BUCKETS), _bucket(bh, BH_BUCKETS))

    def text(self) -> str:
        return f"d{self.head_dim}-{self.dtype}-{'causal' if self.causal else 'full'}-n{self.n_bucket}-bh{self.bh_bucket}"

    @classmethod
    def parse(cls, text: str) -> ShapeKey:
        try:
            d, dtype, causal, n, bh = text.split("-")
            if causal not in ("causal", "full") or dtype not in DTYPE_CLASSES:
                raise ValueError("bad causal/dtype field")
            return cls(int(d[1:]), dtype, causal == "causal", int(n[1:]), int(bh[2:]))
        except ValueError as exc:
            raise ValueError(f"shape key {text!r} is not of the form d<D>-<half|fp32x3|fp32ieee>-<causal|full>-n<N>-bh<BH>: {exc}") from None


# TMA mode 2 for forward and dQ so that the property tests run the descriptor paths (the interpreter emulates
# them): the band through descriptors where 32 divides N, through pointer loads elsewhere; non-contiguous
# inputs still take the pointer loads.
INTERPRETER = {"fwd": TileConfig(32, 32, 4, 1, 2), "dkdv": TileConfig(32, 32, 4, 1), "dq": TileConfig(32, 32, 4, 1, 2)}


def default_config(key: ShapeKey) -> dict[str, TileConfig]:
    """A heuristic that fits sm_80+ shared memory for every supported d and dtype (no measurements)."""
    d = key.head_dim
    if d > 128:
        # 256-wide tiles: a (64, 256) float32 accumulator is 64 KB of registers per program, and a pipelined
        # (64, 256) K/V stage 64 KB of shared memory in 16-bit types; float32 operands double both.
        if key.dtype == "half":
            return {"fwd": TileConfig(64, 64, 8, 2), "dkdv": TileConfig(32, 64, 8, 2), "dq": TileConfig(64, 64, 8, 2)}
        return {"fwd": TileConfig(32, 32, 4, 1), "dkdv": TileConfig(16, 32, 4, 1), "dq": TileConfig(32, 32, 4, 1)}
    if key.dtype == "fp32ieee":
        # fp32 tiles take twice the shared memory and IEEE dots run on the FMA units, unrolled: small
        # tiles, which also compile several times faster; the H100 tuner picked these or 32x32 at N = 1024 for
        # d = 16 and 32 (docs/flash-attention-experiments.md, Section 7).
        return {"fwd": TileConfig(32, 64, 4, 2), "dkdv": TileConfig(32, 32, 4, 2), "dq": TileConfig(32, 64, 4, 2)}
    if key.dtype == "fp32x3":
        # tf32x3 keeps each operand's high and low TF32 parts in shared memory.  The H100 tuner picked
        # 32-query tiles at d = 64 and 128 (dK/dV 32 x 32 everywhere once that tile was a candidate), and
        # these fit sm_80's 163 KB at d = 128 (docs/flash-attention-experiments.md, Section 7).
        return {"fwd": TileConfig(32, 64, 4, 2), "dkdv": TileConfig(32, 32, 4, 2), "dq": TileConfig(32, 64, 4, 2)}
    fwd = TileConfig(128, 64, 8 if d >= 128 else 4, 2 if d >= 128 else 3)
    bwd = TileConfig(64, 64, 8 if d >= 128 else 4, 2)
    if key.n_bucket * key.bh_bucket <= 4096:
        # Too few query tiles of 128 to fill the SMs: halve the tile, double the programs.
        fwd = TileConfig(64, 64, 4, 3 if d <= 64 else 2)
    return {"fwd": fwd, "dkdv": bwd, "dq": bwd}


def _configs(*specs: tuple[int, int, int, int]) -> tuple[TileConfig, ...]:
    return tuple(TileConfig(*spec) for spec in specs)


# Hand-picked search spaces (BLOCK_M, BLOCK_N, warps, stages): the shapes that win somewhere in
# FlashAttention-2/3 and Triton's tutorial kernels on Hopper, ~10 per kernel so that tuning one shape
# from an empty cache (every candidate compiled once) stays well under a minute.
SEARCH_SPACE = {
    # "t": K/V through TMA descriptors, only at the forward tile where they measured faster, 64 x 128 at long
    # rows (H100; docs/flash-attention-experiments.md, Section 6).  64 x 32 left for it (never chosen).
    ("fwd", "half"): _configs((128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 2),
                              (128, 32, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 3, 1)),
    ("dkdv", "half"): _configs((32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2),
                               (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 3), (16, 64, 4, 4)),
    # 64 x 128-key dQ tiles: faster than the other candidates at d = 64 on every measured shape (H100;
    # docs/flash-attention-experiments.md, Section 4); 64 x 32 left (never chosen, and 32-key tiles lost every
    # dQ measurement so far).
    # TMA dQ (Section 6 there): 128 x 64 w8 faster at B*H 16 and at B*H 1, N 65536; 64 x 128 only at short
    # rows (B*H 1, N 16384); the 128 x 32 tiles left for them (never chosen).
    # Band mode (the band through the descriptors too; Section 6 there): dQ 64 x 128 faster at the leaderboard
    # shape and at B*H 1, N 65536, mode 1 at B*H 1, N 16384, so both modes stay.
    # 64 x 128 w4 s4 left for it (last chosen before TMA).
    ("dq", "half"): _configs((128, 64, 8, 3, 1), (64, 128, 4, 3, 1), (64, 128, 4, 3, 2), (128, 64, 8, 3),
                             (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3),
                             (64, 128, 4, 3)),
    # float32 with tf32x3 dots (tensor cores; each operand's two TF32 parts double the shared memory):
    # the half-precision shapes that fit, fewer of them, since each compiles slowly.  Tuned on an H100 from an
    # empty cache (docs/flash-attention-experiments.md, Section 7): among the half-precision shapes 32 x 64 won
    # every kernel, and 64-query dQ and dK/dV tiles run out of shared memory at d = 128; with 32-query
    # candidates dK/dV moved to 32 x 32, hence the 32 x 32 and 16-query variants around it.
    ("fwd", "fp32x3"): _configs((32, 64, 4, 2), (32, 64, 4, 3), (32, 32, 4, 2), (32, 128, 4, 2), (64, 64, 4, 2),
                              (64, 32, 4, 3), (128, 32, 8, 3)),
    ("dkdv", "fp32x3"): _configs((32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2),
                               (64, 64, 4, 2), (64, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 3), (16, 32, 4, 2)),
    ("dq", "fp32x3"): _configs((32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2), (32, 32, 4, 2), (32, 128, 4, 2),
                             (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 8, 2), (32, 32, 4, 3), (16, 64, 4, 2)),
    # float32 with IEEE dots (CS336_FLASH_FP32_DOT=ieee): FMA units.
    ("fwd", "fp32ieee"): _configs((64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 4, 3)),
    # fp32 dK/dV at 64x64 is left out: over a minute to compile on its own (IEEE dots unroll into FMA code;
    # docs/flash-attention-experiments.md, Section 7).
    ("dkdv", "fp32ieee"): _configs((32, 64, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2)),
    ("dq", "fp32ieee"): _configs((64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)),
}


# 256-wide head-dim tiles (d = 160 ... 256) in 16-bit types: a (rows, 256) float32 accumulator holds 64 KB of
# registers per 64 rows, so the half-precision shapes above mostly spill or run out of shared memory; narrower
# key tiles and 8 warps instead.
WIDE_SEARCH_SPACE = {
    "fwd": _configs((64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2),
                    (64, 128, 8, 2), (32, 64, 4, 2)),
    "dkdv": _configs((16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2), (16, 128, 8, 2), (32, 128, 8, 1),
                     (64, 64, 8, 1), (64, 32, 8, 2))
    # two passes, one (BLOCK_N, 256) float32 accumulator each: wider key tiles without spilling (on the H100
    # 64x64 and 32x128 with two stages, and 64x128 with two, need more shared memory than the SM has)
    + tuple(TileConfig(m, n, w, s, parts=2) for m, n, w, s in ((32, 64, 4, 2), (32, 64, 8, 2), (32, 128, 8, 1),
                                                               (64, 128, 8, 1), (128, 64, 8, 1))),
    "dq": _configs((64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 3), (128, 64, 8, 1),
                   (32, 32, 4, 3)),
}


def search_space(kernel: str, key: ShapeKey) -> tuple[TileConfig, ...]:
    """The hand-picked configurations for `kernel` at `key`, before pruning: `WIDE_SEARCH_SPACE` for 256-wide
    half-precision tiles, `SEARCH_SPACE` otherwise."""
    if key.head_dim > 128 and key.dtype == "half":
        return WIDE_SEARCH_SPACE[kernel]
    return SEARCH_SPACE[(kernel, key.dtype)]


def candidates(kernel: str, key: ShapeKey) -> list[TileConfig]:
    """The configurations the autotuner tries for `kernel` at `key`: `SEARCH_SPACE` (`WIDE_SEARCH_SPACE` for 256-wide
    half-precision tiles), pruned.

    Pruning: tiles no larger than the (bucketed) sequence needs, and an estimate of the pipelined shared
    memory (the resident tiles plus `num_stages` copies of the streamed ones) under 200 KiB, so the
    228 KiB of an H100 SM leaves room for Triton's layout-conversion scratch.  Anything that still fails
    to compile or launch is skipped by the tuner.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    element = 2 if key.dtype == "half" else 4
    limit = max(key.n_bucket, 64)
    out = []
    for cfg in search_space(kernel, key):
        if max(cfg.block_m, cfg.block_n) > limit:
            continue
        if _shared_bytes(kernel, cfg.block_m, cfg.block_n, key.head_dim, element, cfg.num_stages) > 200 * 1024:
            continue
        out.append(cfg)
    return out


def _shared_bytes(kernel: str, block_m: int, block_n: int, d: int, element: int, stages: int) -> int:
    if kernel == "fwd":  # Q resident; K and V streamed
        return element * d * (block_m + 2 * stages * block_n)
    if kernel == "dkdv":  # K and V resident; Q and dO streamed
        return element * d * (2 * block_n + 2 * stages * block_m)
    return element * d * (2 * block_m + 2 * stages * block_n)  # dq: Q and dO resident; K and V streamed


# Measured on an H100 80GB HBM3 (sm_90), torch 2.11, triton 3.6, with
#   python -m cs336_systems.flash_autotune --dtype bf16 --shape 16,16384,64 ... --json ...
# (the --json output records every candidate's time).  Keys are ShapeKey.text(); values
# TileConfig.short().  The two fp32ieee entries were tuned when IEEE was the only fp32 arithmetic.
TUNED_SM90: dict[str, dict[str, str]] = {
    "d16-fp32ieee-causal-n1024-bh1": {"fwd": "32x32w4s3", "dkdv": "32x32w4s2", "dq": "32x64w4s2"},
    "d32-fp32ieee-causal-n1024-bh1": {"fwd": "32x64w4s2", "dkdv": "32x32w4s2", "dq": "32x64w4s2"},
    # float32, tf32x3 dots, tuned on an H100 (2026-11-22; docs/flash-attention-experiments.md, Section 7):
    # d = 16 / 32 before the 16-query and 8-warp 32 x 32 candidates were added, d = 64 / 128 with them.  At
    # N = 1024 the tuner's per-kernel times are host-bound (tens of microseconds) and varied 2-3x between two
    # tuning runs: those entries are the weakest.
    "d16-fp32x3-causal-n1024-bh1": {"fwd": "32x32w4s2", "dkdv": "64x64w4s2", "dq": "64x64w4s3"},
    "d16-fp32x3-causal-n16384-bh1": {"fwd": "64x64w4s2", "dkdv": "64x64w4s2", "dq": "64x64w4s3"},
    "d32-fp32x3-causal-n1024-bh1": {"fwd": "128x32w8s3", "dkdv": "64x64w4s2", "dq": "64x64w4s3"},
    "d32-fp32x3-causal-n16384-bh1": {"fwd": "64x64w4s2", "dkdv": "64x64w4s2", "dq": "64x64w4s3"},
    "d64-fp32x3-causal-n1024-bh1": {"fwd": "32x64w4s3", "dkdv": "32x32w4s3", "dq": "16x64w4s2"},
    "d64-fp32x3-causal-n4096-bh1": {"fwd": "128x32w8s3", "dkdv": "32x32w4s2", "dq": "16x64w4s2"},
    "d64-fp32x3-causal-n16384-bh1": {"fwd": "32x128w4s2", "dkdv": "32x32w4s2", "dq": "32x64w4s2"},
    "d128-fp32x3-causal-n1024-bh1": {"fwd": "32x32w4s2", "dkdv": "32x32w4s2", "dq": "16x64w4s2"},
    "d128-fp32x3-causal-n4096-bh1": {"fwd": "128x32w8s3", "dkdv": "32x32w4s2", "dq": "16x64w4s2"},
    "d128-fp32x3-causal-n16384-bh1": {"fwd": "32x64w4s2", "dkdv": "32x32w4s2", "dq": "32x32w4s2"},
    "d16-half-causal-n1024-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d16-half-causal-n4096-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d16-half-causal-n16384-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d16-half-causal-n65536-bh1": {"fwd": "64x128w4s3", "dkdv": "32x128w4s4", "dq": "64x64w4s3"},
    "d32-half-causal-n1024-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d32-half-causal-n4096-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d32-half-causal-n16384-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d32-half-causal-n65536-bh1": {"fwd": "64x128w4s3", "dkdv": "32x64w4s3", "dq": "64x64w4s3"},
    "d64-half-causal-n1024-bh1": {"fwd": "64x64w4s4", "dkdv": "64x64w4s2", "dq": "128x64w8s3"},
    "d64-half-causal-n4096-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x128w4s3"},
    "d64-half-causal-n16384-bh1": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "64x128w4s3t"},
    # fwd and dq re-chosen by same-run A/Bs of the compiled forward+backward in the harness, since the tuner's
    # ranking of near-equal tiles is not stable; the d = 64, B*H = 1 dq entries changed with the same
    # measurement; TMA mode 1 ("t") and the band mode ("b") where each kernel alone measured faster (H100,
    # 2026-11-21/22; docs/flash-attention-experiments.md, Sections 4 and 6).
    "d64-half-causal-n16384-bh16": {"fwd": "64x128w4s3t", "dkdv": "32x64w4s3", "dq": "64x128w4s3b"},
    "d64-half-causal-n65536-bh1": {"fwd": "64x128w4s3t", "dkdv": "32x128w4s4", "dq": "64x128w4s3b"},
    # The models' short sequences (B 4, N 512; bf16, causal), tuned on an H200 (2026-11-26; torch 2.11, triton
    # 3.6) with CUDA-graph timing (do_bench's times are host-bound at this size); faster than the entries these
    # keys took before, the nearest, n1024-bh1 (docs/flash-attention-experiments.md, Section 13).
    "d64-half-causal-n512-bh64": {"fwd": "64x64w4s3", "dkdv": "64x64w4s2", "dq": "64x64w4s3"},
    "d128-half-causal-n512-bh64": {"fwd": "64x64w4s3", "dkdv": "64x128w8s2", "dq": "64x64w4s2"},
    "d128-half-causal-n1024-bh1": {"fwd": "64x64w4s3", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    # d = 128 dQ re-measured with pointer loads: these entries' tiles were the faster (H100, 2026-11-22;
    # docs/flash-attention-experiments.md, Section 4).
    "d128-half-causal-n4096-bh1": {"fwd": "64x64w4s3", "dkdv": "32x64w4s3", "dq": "64x128w4s3"},
    "d128-half-causal-n16384-bh1": {"fwd": "64x64w4s4", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d128-half-causal-n16384-bh16": {"fwd": "64x64w4s3", "dkdv": "64x128w8s2", "dq": "128x64w8s3"},
    "d128-half-causal-n65536-bh1": {"fwd": "64x64w4s3", "dkdv": "32x128w8s3", "dq": "128x64w8s3"},
    # Without the causal mask (bf16), tuned with `python -m cs336_systems.flash_autotune --no-causal` on an H100
    # (torch 2.11, triton 3.6; do_bench, each kernel alone), where `default_config` had served every such call:
    # faster than the default's tiles, except the forward at d 128, N 1024, which keeps the default's 128x64w8s2
    # (docs/flash-attention-experiments.md, Section 4).  On Hopper the Gluon kernels take most calls at d 128
    # (and dK/dV at d 64 from 2048 queries with two programs an SM; `cs336_systems.attention.plan.RULES`);
    # these tiles serve the rest.
    "d64-half-full-n1024-bh16": {"fwd": "64x128w4s3", "dkdv": "64x64w4s3", "dq": "128x128w8s2"},
    "d64-half-full-n2048-bh64": {"fwd": "128x64w8s3", "dkdv": "32x64w4s3", "dq": "64x128w4s3b"},
    "d64-half-full-n4096-bh16": {"fwd": "128x64w8s3", "dkdv": "32x128w4s3", "dq": "64x128w4s3b"},
    "d64-half-full-n16384-bh1": {"fwd": "64x128w4s3t", "dkdv": "64x128w8s3", "dq": "64x128w4s3b"},
    "d64-half-full-n16384-bh16": {"fwd": "128x64w8s3", "dkdv": "32x128w4s4", "dq": "128x64w8s3t"},
    "d128-half-full-n1024-bh16": {"fwd": "128x64w8s2", "dkdv": "64x64w4s3", "dq": "64x64w4s3"},
    "d128-half-full-n2048-bh64": {"fwd": "128x64w8s3", "dkdv": "64x128w8s2", "dq": "128x64w8s3t"},
    "d128-half-full-n4096-bh16": {"fwd": "64x64w4s3", "dkdv": "64x128w8s2", "dq": "128x64w8s3"},
    "d128-half-full-n16384-bh1": {"fwd": "128x64w8s3", "dkdv": "32x128w8s3", "dq": "128x64w8s3"},
    "d128-half-full-n16384-bh16": {"fwd": "128x64w8s3", "dkdv": "64x128w8s2", "dq": "128x64w8s3t"},
    # 256-wide tiles (d = 160 ... 256), tuned among WIDE_SEARCH_SPACE on an H100 (torch 2.11, triton 3.6): in
    # one pass every dK/dV tile wider than the default's spills its two (BLOCK_N, 256) float32 accumulators, so
    # dK/dV runs in two passes (parts 2, one accumulator a program), which measured faster; the other two-pass
    # tiles with two or more stages ran out of shared memory (docs/flash-attention-experiments.md, Section 13).
    "d256-half-causal-n8192-bh16": {"fwd": "128x64w8s2", "dkdv": "32x64w4s2p2", "dq": "128x64w8s1"},
    "d256-half-causal-n16384-bh1": {"fwd": "64x32w4s3", "dkdv": "32x64w4s2p2", "dq": "64x32w4s2"},
    "d256-half-causal-n65536-bh1": {"fwd": "64x32w4s3", "dkdv": "64x128w8s1p2", "dq": "64x32w4s2"},
}


def _tuned_sm90() -> dict[ShapeKey, dict[str, TileConfig]]:
    return {ShapeKey.parse(k): {kern: TileConfig.parse(c) for kern, c in v.items()} for k, v in TUNED_SM90.items()}


def nearest_tuned(key: ShapeKey, table: dict[ShapeKey, dict[str, TileConfig]]) -> dict[str, TileConfig] | None:
    """The table entry for the same (d, dtype, causal) closest to `key` in log2(N), then log2(B*H)."""
    same = [k for k in table if (k.head_dim, k.dtype, k.causal) == (key.head_dim, key.dtype, key.causal)]
    if not same:
        return None

    def distance(k: ShapeKey) -> tuple[float, float]:
        return (abs(math.log2(k.n_bucket / key.n_bucket)), abs(math.log2(k.bh_bucket / key.bh_bucket)))

    return table[min(same, key=distance)]


def tuned_sm90(key: ShapeKey) -> dict[str, TileConfig] | None:
    """`TUNED_SM90`'s entry for `key`: the nearest one of its own register width, else (a split head-dim width
    with no entries yet) the nearest one of its padded width `block_d`, the tile it ran in before the split
    (its configurations fit: the split tiles hold fewer columns)."""
    table = _tuned_sm90()
    return nearest_tuned(key, table) or nearest_tuned(replace(key, head_dim=block_d(key.head_dim)), table)


def tuned_for_device(key: ShapeKey, device: torch.device) -> dict[str, TileConfig] | None:
    """The committed measurements for this device's architecture, if any."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    return tuned_sm90(key)


def as_dict(configs: dict[str, TileConfig]) -> dict[str, dict]:
    return {kernel: asdict(cfg) for kernel, cfg in configs.items()}
