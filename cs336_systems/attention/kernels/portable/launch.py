"""Launchers of the FlashAttention-2 Triton kernels, one per kernel, with an explicit tile configuration.

Every tensor is (Z, H, N, d) with any strides on Z, H and N and unit stride on d (the kernels index a slice
as z * stride_z + h * stride_h, so a head-major view of a token-major (Z, N, H, d) tensor runs without a
copy), or (BH, N, d), taken as Z = 1; L and D are (Z * H, Nq) float32, contiguous.  Grouped-query
attention: K and V (and dK, dV) may have H / group heads, group = H // H_kv query heads per K/V head.  `wrap` is
applied to each kernel before launching it: the identity, the autotuner's compile-only stand-in,
`torch.library.wrap_triton`, or a `replay.Recorder` (an eager call's first launch of its signature).

On Hopper the forward and dQ kernels stream K and V through host-side TMA descriptors (`use_tma`); the
descriptors are built per call, so the registered ops that launch them are opaque operators (torch 2.11's
`triton_op` tracing cannot bind a descriptor argument under torch.compile).

The softmax scales are constexprs: inductor passes Python floats to user kernels as fp64 scalars,
which once turned every score tile's multiply into fp64 (see docs/flash-attention-experiments.md, Section 3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems import switches
from cs336_systems.attention.kernels.portable import kernels
from cs336_systems.attention.kernels.portable.configs import TileConfig, block_d, d_tiles, fp32_dot, split_opted_in

LOG2E = 1.4426950408889634


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(Z, H, N, d) as is, (BH, N, d) as a (1, BH, N, d) view; any other rank is a ValueError (the kernels'
    slice addressing has exactly a batch and a head stride)."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        return t.unsqueeze(0)
    raise ValueError(f"the flash launchers take (Z, H, N, d) or (BH, N, d) tensors, got shape {tuple(t.shape)}")


def slices(t: torch.Tensor) -> int:
    """How many (N, d) slices: the product of the leading dims (BH)."""
    return math.prod(t.shape[:-2])


def zhn_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The (Z, H, N) strides of `as_4d(t)`, the kernels' slice and row addressing."""
    return as_4d(t).stride()[:3]


def direct(kernel):
    """Launch the kernel as is (no tracing wrapper)."""
    return kernel


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: for fp32 inputs `configs.fp32_dot` ("tf32x3" by default, "ieee" on
    request; plain TF32 would lose fp32 accuracy); ignored for 16-bit inputs."""
    return fp32_dot() if dtype == torch.float32 else "tf32"


TMA_ENV = "CS336_FLASH_TMA"


def use_tma(t: torch.Tensor) -> bool:
    """Whether the forward and dQ kernels load `t`'s (K or V) unmasked tiles through a tensor descriptor.

    Yes on sm_90+ GPUs and under the interpreter (so the CPU tests run that path), when `t` (Z, H, N, d) or
    (BH, N, d) is contiguous (the descriptor covers its BH * N rows of d; a strided view takes the pointer
    loads), 16-byte aligned (a TMA requirement) and its
    row count fits the descriptor's int32 coordinates; otherwise the pointer loads.
    ``CS336_FLASH_TMA=0`` forces pointer loads everywhere (for same-run A/B measurements).
    """
    if not tma_enabled(t.device):
        return False
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() // t.shape[-1] < 2**31


def tma_enabled(device: torch.device) -> bool:
    """Whether descriptors may be used on ``device`` at all: an sm_90+ GPU or the interpreter, and not
    forced off by ``CS336_FLASH_TMA=0`` (ValueError for any other value than 0 or 1)."""
    if switches.read(TMA_ENV) == "0":
        return False
    if device.type == "cuda":
        return capability_major(device) >= 9
    return switches.interpreter_active()


def capability_major(device: torch.device) -> int:
    """The CUDA device's compute capability major (cached per device: this is asked on every call)."""
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, cfg: TileConfig, tma: int | None, tiles: tuple[int, int]):
    """(TMA mode, K_DESC, V_DESC) for the forward and dQ launchers.  ``tma`` None takes the configuration's
    mode where `use_tma` allows descriptors (else 0); 0 / 1 / 2 force it.  Mode 2 (the diagonal band's tiles
    through the descriptors too) falls back to 1 unless BLOCK_N divides N: a band tile crossing N would read
    the next slice's rows.  The descriptors cover the (BH * N, d) rows with (BLOCK_N, d) boxes, or are None
    in mode 0.  A head dim split over two register tiles (`d_tiles`) takes pointer loads: the descriptors'
    boxes are one tile wide (forcing 1 or 2 there is a ValueError).  ``tiles``: the launching kernel's `d_tiles`."""
    if tma not in (None, 0, 1, 2):
        raise ValueError(f"tma must be 0, 1, 2 or None; got {tma!r}")
    if tiles[1]:
        if tma:
            raise ValueError(f"tma={tma} needs a head dim that runs in one register tile; d={k.shape[-1]} runs "
                             f"split as {tiles} (CS336_FLASH_SPLIT_D=0: one padded tile)")
        return 0, None, None
    if tma is None:
        tma = cfg.tma if cfg.tma and use_tma(k) and use_tma(v) else 0
    if tma and not (k.is_contiguous() and v.is_contiguous()):
        # the descriptors cover the (BH * N, d) rows of contiguous memory; a strided view would be read wrong
        raise ValueError(f"tma={tma} needs contiguous k and v; got k strides {k.stride()}, v strides {v.stride()}")
    if not tma:
        return 0, None, None
    n, d = k.shape[-2:]
    rows = slices(k) * n
    # A (BLOCK_N, block_d(d)) box: past column d the TMA engine fills zeros, like the masked pointer loads.
    box = [cfg.block_n, block_d(d)]
    k_desc, v_desc = (TensorDescriptor(t.view(rows, d), [rows, d], [d, 1], box) for t in (k, v))
    return (1 if n % cfg.block_n else int(tma)), k_desc, v_desc


SPLITS_ENV = "CS336_FLASH_SPLITS"
MAX_KEY_SPLITS = 8
MIN_TILES_PER_SPLIT = 2  # a chunk shorter than this many key tiles does not repay its partial write


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def key_splits(q: torch.Tensor, n_keys: int, cfg: TileConfig, split_head_dim: bool = False) -> int:
    """How many key chunks the forward splits each query tile into (1: the unsplit kernel).

    Split only when the unsplit grid (query tiles x B*H) leaves at least half of the SMs idle: then the
    forward's time is the longest program's key loop, and SPLITS chunks shorten it SPLITS-fold for the
    price of a float32 partial output per chunk and a combine kernel.  Enough splits to bring the grid
    to about one program per SM, at most MAX_KEY_SPLITS, and chunks of at least MIN_TILES_PER_SPLIT key
    tiles.  Only on CUDA devices (the interpreter has no SMs; tests pass ``splits`` explicitly).
    ``CS336_FLASH_SPLITS=<n>`` overrides the choice (1: never split; for same-run A/B measurements).
    ``split_head_dim`` (every kernel opted in to two register tiles, `configs.split_opted_in`): 1 unless
    forced, since the key-split kernel runs the padded tile, which a configuration chosen for the split width
    need not fit.
    """
    forced = switches.read(SPLITS_ENV)  # a positive integer (ValueError otherwise) or ""
    if forced:
        return int(forced)
    if q.device.type != "cuda" or split_head_dim:
        return 1
    programs = triton.cdiv(q.shape[-2], cfg.block_m) * slices(q)
    sms = sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if 2 * programs > sms:
        return 1
    by_length = triton.cdiv(n_keys, cfg.block_n) // MIN_TILES_PER_SPLIT
    return max(1, min(MAX_KEY_SPLITS, sms // programs, by_length))


def group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per K/V head: H // H_kv, dim -3 (ValueError unless H_kv divides H and the batch dims match)."""
    if len(q.shape) != len(k.shape) or q.shape[:-3] != k.shape[:-3] or not k.shape[-3] or q.shape[-3] % k.shape[-3]:
        raise ValueError(f"K/V heads (dim -3) must divide the query heads and the other leading dims match "
                         f"(grouped-query attention); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return q.shape[-3] // k.shape[-3]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
            cfg: TileConfig, wrap: Callable = direct, longest_first: bool = True, splits: int | None = None,
            tma: int | None = None, tiles: tuple[int, int] | None = None) -> None:
    """o (Z, H, Nq, d) and lse (Z * H, Nq) written in place; k, v (Z, H_kv, Nk, d); or all (BH, N, d).

    ``splits``: key chunks per query tile (None: `key_splits`, never with split tiles opted in unless forced);
    above 1 the split kernel writes float32 partials to a (splits, BH, Nq, d) workspace and the combine kernel
    writes o and lse, both in the padded head-dim tile (a forward that runs split by default then runs padded).
    ``longest_first`` orders the unsplit kernel's causal tiles (a measurement switch); the split grid
    has about one program per SM, so it has no order to choose and ignores it.
    ``tma``: how K and V are loaded (None: the configuration's mode where `use_tma` allows it; see
    `_kv_descriptors`).  ``tiles``: the head-dim register tiles (None: `d_tiles(d, dtype, "fwd")`; the tuner
    passes the padded tile when the configuration is keyed by the padded width).
    """
    q, k, v, o = as_4d(q), as_4d(k), as_4d(v), as_4d(o)
    n_queries, d = q.shape[-2:]
    heads, bh = q.shape[1], slices(q)
    group = group_size(q, k)
    if tiles is None:
        tiles = d_tiles(d, q.dtype, "fwd", capability_major(q.device) if q.is_cuda else None)
    # a forward that runs split by default has a configuration chosen for the padded width, which the key-split
    # kernel's padded tile fits; with every kernel opted in to split tiles the configuration need not fit it
    splits = key_splits(q, k.shape[-2], cfg, split_head_dim=split_opted_in(d, q.dtype)) if splits is None else splits
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if splits > 1 and tiles[1]:
        # Key splits asked for a split head dim: the key-split kernel has one tile, the padded one (its split
        # variant was removed after GPU faults at shapes that take it; docs/flash-attention-experiments.md,
        # Section 13).
        tiles = (block_d(d), 0)
    tma, k_desc, v_desc = _kv_descriptors(k, v, cfg, tma, tiles)
    if splits > 1:
        o_part = torch.empty((splits, bh, n_queries, d), device=q.device, dtype=torch.float32)
        l_part = torch.empty((splits, bh, n_queries), device=q.device, dtype=torch.float32)
        wrap(kernels.flash_fwd_split_kernel)[(triton.cdiv(n_queries, cfg.block_m), bh, splits)](
            q, k, v, o_part, l_part, k_desc, v_desc, *zhn_strides(q), *zhn_strides(k), *zhn_strides(v),
            n_queries, k.shape[-2], heads, group, qk_scale=LOG2E / math.sqrt(d),
            CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), SPLITS=splits, TMA=tma, BLOCK_D=tiles[0],
            **cfg.launch_kwargs(),
        )
        combine_rows = 64 if d <= 64 else (32 if d <= 128 else 16)  # a (rows, d) float32 accumulator per program
        wrap(kernels.flash_fwd_combine_kernel)[(triton.cdiv(n_queries, combine_rows), bh)](
            o_part, l_part, o, lse, *zhn_strides(o), n_queries, heads,
            HEAD_DIM=d, BLOCK_M=combine_rows, SPLITS=splits, BLOCK_D=block_d(d), num_warps=4,
        )
        return
    grid = (triton.cdiv(n_queries, cfg.block_m), bh)
    wrap(kernels.flash_fwd_kernel)[grid](
        q, k, v, o, lse, k_desc, v_desc, *zhn_strides(q), *zhn_strides(k), *zhn_strides(v), *zhn_strides(o),
        n_queries, k.shape[-2], heads, group, qk_scale=LOG2E / math.sqrt(d),
        CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), TMA=tma, BLOCK_D=tiles[0], BLOCK_D2=tiles[1],
        LONGEST_FIRST=longest_first, **cfg.launch_kwargs(),
    )


GROUP_SPLITS_ENV = "CS336_FLASH_GROUP_SPLITS"


def forced_group_splits(group: int) -> int | None:
    """The split count ``CS336_FLASH_GROUP_SPLITS`` forces (ValueError unless a divisor of ``group``), or None."""
    forced = switches.read(GROUP_SPLITS_ENV)
    if not forced:
        return None
    if group % int(forced):
        raise ValueError(f"{GROUP_SPLITS_ENV} must be a positive divisor of the group size {group}, got {forced!r}")
    return int(forced)


def fewest_group_splits(group: int, programs: int, sms: int, per_sm: int = 2, steps: int = 0,
                        max_steps: int = 0) -> int:
    """The fewest equal shares of a group of query heads (a divisor of ``group``) that give a grid of
    ``programs`` (one per K/V tile) times the shares at least ``per_sm`` programs per SM and, with
    ``max_steps``, leave no program more than ``max_steps`` query steps (``steps``: one query head's steps
    in the longest program); the whole group if none does.  The portable dK/dV and the fused Gluon backward
    both split by it."""
    for splits in range(1, group + 1):
        if (group % splits == 0 and programs * splits >= per_sm * sms
                and (not max_steps or steps * (group // splits) <= max_steps)):
            return splits
    return group


def group_splits(q: torch.Tensor, k: torch.Tensor, cfg: TileConfig) -> int:
    """Over how many programs the dK/dV kernel spreads each K/V tile's query heads (a divisor of the group).

    One program per K/V tile summing over all `group` query heads needs no extra memory, but for few K/V
    heads (MQA: one) the grid has cdiv(Nk, BLOCK_N) * BH_kv programs, fewer than the SMs.  Split the heads
    into the fewest equal shares that give at least two programs per SM (causal programs differ in length),
    each writing a float32 partial that the launcher sums.  Only on CUDA devices (1 elsewhere; tests pass
    ``group_splits`` explicitly); ``CS336_FLASH_GROUP_SPLITS=<n>`` forces n (a divisor of the group).
    """
    group = group_size(q, k)
    forced = forced_group_splits(group)
    if forced:
        return forced
    if group == 1 or q.device.type != "cuda":
        return 1
    programs = triton.cdiv(k.shape[-2], cfg.block_n) * slices(k)
    return fewest_group_splits(group, programs, sm_count(q.device.index if q.device.index is not None
                                                         else torch.cuda.current_device()))


def dkdv(q, k, v, do, lse, delta, dk, dv, causal: bool, cfg: TileConfig, wrap: Callable = direct,
         splits: int | None = None) -> None:
    """dk, dv (Z, H_kv, Nk, d) written in place: each the sum over the K/V head's `group` query heads.

    ``splits`` (None: `group_splits`): programs per K/V tile, each summing group / splits query heads; above
    1 they write float32 partials to a (splits, Z, H_kv, Nk, d) workspace, summed here into dk and dv.
    ``cfg.parts`` 2: two launches, dV then dK (`TileConfig`), bit-equal to one.
    """
    q, k, v, do, dk, dv = (as_4d(t) for t in (q, k, v, do, dk, dv))
    n_queries, d = q.shape[-2:]
    n_keys = k.shape[-2]
    group = group_size(q, k)
    splits = group_splits(q, k, cfg) if splits is None else splits
    if splits < 1 or group % splits:
        raise ValueError(f"splits must be a positive divisor of the group size {group}, got {splits}")
    if splits > 1:
        dk_out = torch.empty((splits, *dk.shape), device=dk.device, dtype=torch.float32)
        dv_out = torch.empty((splits, *dv.shape), device=dv.device, dtype=torch.float32)
        split_strides = (dk_out.stride(0), dv_out.stride(0))
        dk_rows, dv_rows = dk_out[0], dv_out[0]
    else:
        dk_out, dv_out, dk_rows, dv_rows, split_strides = dk, dv, dk, dv, (0, 0)
    sm_scale = 1.0 / math.sqrt(d)
    tiles = d_tiles(d, q.dtype, "dkdv")
    # cfg.parts 2: a dV pass and a dK pass over the same grid, one float32 accumulator per program each
    for part in ((1, 2) if cfg.parts == 2 else (0,)):
        wrap(kernels.flash_bwd_dkdv_kernel)[(triton.cdiv(n_keys, cfg.block_n), slices(k) * splits)](
            q, k, v, do, lse, delta, dk_out, dv_out, *zhn_strides(q), *zhn_strides(k), *zhn_strides(v),
            *zhn_strides(do), *zhn_strides(dk_rows), *zhn_strides(dv_rows),
            n_queries, n_keys, q.shape[1], group, group // splits, *split_strides, sm_scale=sm_scale,
            qk_scale=sm_scale * LOG2E, CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), BLOCK_D=tiles[0],
            BLOCK_D2=tiles[1], PART=part, **cfg.launch_kwargs(),
        )
    if splits > 1:
        for grad, partials in ((dk, dk_out), (dv, dv_out)):
            grad.copy_(partials.sum(0))


def dq(q, k, v, do, lse, delta, dq_out, causal: bool, cfg: TileConfig, wrap: Callable = direct,
       longest_first: bool = True, *, o: torch.Tensor, tma: int | None = None) -> None:
    """dq_out (Z, H, Nq, d) and delta (Z * H, Nq) = rowsum(o * do) written in place (delta is what the dK/dV
    kernel reads: launch this one first); or all (BH, N, d).  ``tma`` as in `forward`."""
    q, k, v, do, dq_out, o = (as_4d(t) for t in (q, k, v, do, dq_out, o))
    n_queries, d = q.shape[-2:]
    bh = slices(q)
    group = group_size(q, k)
    sm_scale = 1.0 / math.sqrt(d)
    tiles = d_tiles(d, q.dtype, "dq")
    tma, k_desc, v_desc = _kv_descriptors(k, v, cfg, tma, tiles)
    wrap(kernels.flash_bwd_dq_kernel)[(triton.cdiv(n_queries, cfg.block_m), bh)](
        q, k, v, do, lse, delta, dq_out, o, k_desc, v_desc, *zhn_strides(q), *zhn_strides(k), *zhn_strides(v),
        *zhn_strides(do), *zhn_strides(dq_out), *zhn_strides(o),
        n_queries, k.shape[-2], q.shape[1], group, sm_scale=sm_scale, qk_scale=sm_scale * LOG2E,
        CAUSAL=causal, HEAD_DIM=d, PRECISION=precision(q.dtype), TMA=tma, BLOCK_D=tiles[0], BLOCK_D2=tiles[1],
        LONGEST_FIRST=longest_first, **cfg.launch_kwargs(),
    )
