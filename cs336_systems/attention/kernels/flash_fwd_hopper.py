"""FlashAttention forward for Hopper (sm_90) in Gluon: TMA loads, a K/V ring of mbarrier-tracked stages and
asynchronous warpgroup MMAs, with the next tile's scores computed while the current P V product runs.

    forward(q, k, v, o, lse, causal)   q, o: (Z, H, Nq, d)   k, v: (Z, H_kv, Nk, d)   lse: (Z, H, Nq) float32

Why a second forward: the portable Triton kernel (flash_kernels.flash_fwd_kernel) leaves the order of its two
matrix products and the softmax to Triton's scheduler, which waits for each warpgroup MMA before the softmax
that follows it.  Here one program of 8 warps (two warpgroups, 64 query rows each: wgmma's M per warpgroup)
owns BLOCK_M = 128 query rows of one (z, h) (at d 80 and 96 one warpgroup owns 64, `tiles`) and, per key
tile j:

    S_j = Q K_j^T                (async wgmma, issued first)
    O  = alpha_{j-1} O + P_{j-1} V_{j-1}   (async wgmma, issued second)
    wait for S_j only (P V left in flight), softmax of S_j -> P_j, alpha_j, (m, l)
    wait for P_{j-1} V_{j-1}; its stage of the K/V ring is free: TMA-load tile j - 1 + NUM_STAGES into it

so the exponentials of tile j overlap the tensor-core work of tile j - 1 (FlashAttention-3's intra-warpgroup
overlap).  K and V arrive through a NUM_STAGES-deep ring; a tile's two loads complete one mbarrier.
Causal programs run longest first (the last query tile sees every key), and only tiles that cross the
diagonal or the end of the keys are masked.

At d 80 and 96 (128-wide tiles) S is computed over two K-dim slices of the tiles, 64 and d - 64 columns, and
O accumulates in two register tiles of those widths (`dot_nt`, D_SPLIT): no work on the tile's zero columns.

Descriptors are rank 4 over the (Z, H, N, d) views, so any strides with 16-byte alignment are read in place
(a head-major view of token-major memory included) and TMA's bounds do the ragged ends: loads past N are
zero-filled (those key columns are then masked), stores past Nq are dropped.  Grouped-query attention: query
head h reads K/V head h // group.

L = logsumexp of the scaled scores (natural log, float32) per query row, as the portable kernel stores it, so
the portable backward consumes this forward's output unchanged.

Written against Triton 3.6's Gluon API (triton.experimental: it changes between releases); where this kernel
runs is decided by `cs336_systems.attention.plan` (its table `RULES`).  At d 64 and 128 the plan takes the
warp-specialized form of the same loop instead (flash_fwd_hopper_ws: a producer warp and two independent
consumer warpgroups; same results, faster).
bfloat16 and float16 only; head dims 64, 80, 96, 128 and 256 (`HEAD_DIMS`; 80 and 96 in 128-wide tiles,
`tile_dim`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.attention.kernels.flash_launch import direct, sm_count

LOG2E = 1.4426950408889634
BLOCK_M = 128  # two warpgroups x 64 rows
HEAD_DIMS = (64, 80, 96, 128, 256)


def block_n(head_dim: int) -> int:
    """Key tile: 128 keys keep S (64 x 128 per warpgroup) and O (64 x d) in registers up to d = 128; at
    d 256 O alone is 128 registers a thread, so 32 keys, which measured faster than 64 at long rows and tied
    at short ones (docs/flash-attention-experiments.md, Section 14)."""
    return 128 if head_dim <= 128 else 32


# d 80 and 96 (128-wide tiles, products over d in slices): 64 query rows (one warpgroup) x 64 keys, 3 stages:
# Q 16 KB + 3 x (K + V) 96 KB, two programs per SM, where 128 x 128 tiles take one; faster than 128 x 128 at
# every shape measured, most at the models' short rows (docs/flash-attention-experiments.md, Section 14).
PADDED_TILES = (64, 64, 3)


def tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M query rows per program, BLOCK_N keys per step, ring stages): PADDED_TILES at head dims below
    their 128-wide tile (80, 96), with or without SLICED_HEAD_DIMS (the GPU test compares the sliced and
    whole-tile products at these tiles), else BLOCK_M x `block_n` with `stages`.  A program has BLOCK_M / 16
    warps."""
    width = tile_dim(head_dim)
    if width == 128 and head_dim != width:
        return PADDED_TILES
    return BLOCK_M, block_n(width), stages(width)


def stages(head_dim: int) -> int:
    """K/V ring depth: three stages (a tile in use, one landing, one requested) fit shared memory at d <= 128
    (Q 32 KB + 3 x (K + V) 192 KB at d = 128); four of the 32-key tiles at d 256 (Q 64 KB + 4 x (K + V)
    128 KB: the same bytes in flight as two 64-key stages, in finer steps)."""
    return 3 if head_dim <= 128 else 4


@gluon.jit
def alloc_ring(a_desc, b_desc, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """A TMA ring in shared memory: NUM_STAGES stages of one (1, 1, ROWS, HEAD_DIM) box of each of two
    tensors, and one mbarrier per stage that both boxes of the stage complete (initialized; the caller fences
    after its own barriers).  Returns (a stages, b stages, barriers)."""
    a_buf = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, 1, 1, ROWS, HEAD_DIM], a_desc.layout)
    b_buf = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, 1, 1, ROWS, HEAD_DIM], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    return a_buf, b_buf, ready


@gluon.jit
def alloc_pair(a_desc, b_desc, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Shared memory for one (1, 1, ROWS, HEAD_DIM) box of each of two tensors that stay resident (K and V,
    or Q and dO) and the mbarrier their loads complete (initialized; the caller fences after its own
    barriers).  Returns (a buffer, b buffer, barrier)."""
    a_buf = gl.allocate_shared_memory(a_desc.dtype, [1, 1, ROWS, HEAD_DIM], a_desc.layout)
    b_buf = gl.allocate_shared_memory(b_desc.dtype, [1, 1, ROWS, HEAD_DIM], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return a_buf, b_buf, bar


@gluon.jit
def query_tile(heads, group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """This program's query tile on a grid (query tiles, Z * H), causal grids longest first (the last query
    tile sees every key): returns (z * H + h, z, h, its K/V head h // group, first query row)."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    z = bh // heads
    h = bh % heads
    return bh, z, h, h // group, pid_m * BLOCK_M


@gluon.jit
def key_tiles(start_m, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The key tiles a query tile starting at row start_m visits (causal: up to its last row) and how many
    of them, from the first, every one of its rows sees entirely (no mask needed): (n_tiles, full)."""
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, n_k)
        full = gl.minimum(start_m + 1, n_k) // BLOCK_N
    else:
        hi = n_k
        full = n_k // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), full


@gluon.jit
def load_kv(k_desc, v_desc, k_smem, v_smem, ready, z, kv_head, tile, n_tiles, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr):
    """TMA-load key tile `tile` (K and V) into its ring stage; a no-op past the last tile."""
    stage = tile % NUM_STAGES
    pred = tile < n_tiles
    mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [z, kv_head, tile * BLOCK_N, 0], ready.index(stage),
                                    k_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [z, kv_head, tile * BLOCK_N, 0], ready.index(stage),
                                    v_smem.index(stage), pred=pred)


@gluon.jit
def wait_kv(k_buf, v_buf, ready, j, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Wait until key tile j has landed in its ring stage; returns (K_j, V_{j-1}) as (BLOCK_N, HEAD_DIM)
    shared-memory views and the ring stage of tile j - 1, whose P V product the caller issues next."""
    prev = (j - 1) % NUM_STAGES
    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    kj = k_buf.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_prev = v_buf.index(prev).reshape([BLOCK_N, HEAD_DIM])
    return kj, v_prev, prev


@gluon.jit
def softmax_tile(s, m_i, l_i, col0, row0, qk_scale, n_k, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one (BLOCK_M, BLOCK_N) tile of raw scores, base 2 (qk_scale = log2(e) / sqrt(d)):
    returns (P unnormalized float32, alpha = rescale of the running O, new m, new l).  Masked scores are
    -1e6 (the reference's convention), which exp2 turns into exact zeros."""
    if MASK:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols, 0) < n_k
        if CAUSAL:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            visible = visible & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
        s = gl.where(visible, s * qk_scale, -1.0e6)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.constexpr_function
def mma_layout(num_warps, width):
    """The register layout of a wgmma accumulator `width` columns wide: each of the program's warpgroups
    holds 64 rows (num_warps / 4 warpgroups stacked along M)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, width, 16])


@gluon.jit
def dot_nt(a_smem, b_smem, zero, D_SPLIT: gl.constexpr):
    """A B^T issued as asynchronous wgmma (A (M, d) and B (N, d) in shared memory, `zero` the (M, N) float32
    accumulator to start from); returns its token.  D_SPLIT > 0: over columns [0, 64) and [64, 64 + D_SPLIT)
    only, as two groups (a wait that must cover this product counts two)."""
    if D_SPLIT > 0:
        tok = warpgroup_mma(a_smem.slice(0, 64, 1), b_smem.slice(0, 64, 1).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        tok = warpgroup_mma(a_smem.slice(64, D_SPLIT, 1), b_smem.slice(64, D_SPLIT, 1).permute((1, 0)), tok,
                            is_async=True)
    else:
        tok = warpgroup_mma(a_smem, b_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    return tok


@gluon.jit
def dot_split_n(a, b_smem, acc, acc_hi, D_SPLIT: gl.constexpr):
    """acc += A B[:, 0:64] and acc_hi += A B[:, 64:64 + D_SPLIT] issued as two asynchronous wgmma groups (A in
    registers, converted to each accumulator's operand layout; B (K, N) in shared memory); returns the two
    tokens.  The N-dim counterpart of `dot_nt`'s slices: no columns for the tile's zeros."""
    lo_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    hi_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_hi.type.layout, k_width=2)
    tok = warpgroup_mma(gl.convert_layout(a, lo_op), b_smem.slice(0, 64, 1), acc, is_async=True)
    tok_hi = warpgroup_mma(gl.convert_layout(a, hi_op), b_smem.slice(64, D_SPLIT, 1), acc_hi, is_async=True)
    return tok, tok_hi


@gluon.jit
def rescaled(acc, alpha):
    """acc with each row scaled by alpha's entry (alpha in any row layout)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def normalized(acc, l_i):
    """acc with each row divided by l_i's entry (l_i in any row layout)."""
    return acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, L, qk_scale, n_q, n_k, heads, group,
                            CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
                            D_SPLIT: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    bh, z, h, kv_head, start_m = query_tile(heads, group, BLOCK_M, CAUSAL)

    # wgmma accumulators: each warpgroup holds 64 rows of S (BLOCK_M x BLOCK_N) and of O (BLOCK_M x HEAD_DIM);
    # with D_SPLIT > 0, O in two: columns [0, 64) and [64, 64 + D_SPLIT) (none for the tile's zero columns)
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    W2: gl.constexpr = D_SPLIT if D_SPLIT > 0 else 16

    q_buf = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_buf, v_buf, ready = alloc_ring(k_desc, v_desc, BLOCK_N, HEAD_DIM, NUM_STAGES)
    fence_async_shared()
    q_smem = q_buf.reshape([BLOCK_M, HEAD_DIM])

    n_tiles, full = key_tiles(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [z, h, start_m, 0], q_bar, q_buf)
    for t in gl.static_range(NUM_STAGES):
        load_kv(k_desc, v_desc, k_buf, v_buf, ready, z, kv_head, t, n_tiles, BLOCK_N, NUM_STAGES)

    # -1e6 as the starting max is safe because causal attention here is aligned at position 0: key 0 is
    # visible to every row, and tile 0 is processed first
    m_i = gl.full([BLOCK_M], -1.0e6, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    if D_SPLIT > 0:
        acc = gl.zeros([BLOCK_M, 64], gl.float32, layout=mma_layout(num_warps, 64))
        acc2 = gl.zeros([BLOCK_M, W2], gl.float32, layout=mma_layout(num_warps, W2))
    else:
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    # tile 0: its scores and softmax, nothing to overlap with yet
    mbarrier.wait(ready.index(0), 0)
    k0 = k_buf.index(0).reshape([BLOCK_N, HEAD_DIM])
    s_tok = dot_nt(q_smem, k0, s_zero, D_SPLIT)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, q_smem, k0))[0]
    if full > 0:
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, start_m, qk_scale, n_k, False, CAUSAL, BLOCK_M,
                                           BLOCK_N, s_layout)
    else:
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, start_m, qk_scale, n_k, True, CAUSAL, BLOCK_M,
                                           BLOCK_N, s_layout)

    for j in range(1, n_tiles):
        kj, v_prev, prev = wait_kv(k_buf, v_buf, ready, j, BLOCK_N, HEAD_DIM, NUM_STAGES)
        s_tok = dot_nt(q_smem, kj, s_zero, D_SPLIT)
        if D_SPLIT > 0:
            o_tok, o2_tok = dot_split_n(p.to(dtype), v_prev, rescaled(acc, alpha), rescaled(acc2, alpha), D_SPLIT)
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, kj))[0]
        else:
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, v_prev, rescaled(acc, alpha), is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, kj))[0]
        if j < full:
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j * BLOCK_N, start_m, qk_scale, n_k, False, CAUSAL,
                                               BLOCK_M, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j * BLOCK_N, start_m, qk_scale, n_k, True, CAUSAL,
                                               BLOCK_M, BLOCK_N, s_layout)
        if D_SPLIT > 0:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, o2_tok, v_prev))[:2]
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_prev))[0]
        # K_{j-1} and V_{j-1} are consumed: their stage takes tile j - 1 + NUM_STAGES
        load_kv(k_desc, v_desc, k_buf, v_buf, ready, z, kv_head, j - 1 + NUM_STAGES, n_tiles, BLOCK_N,
                 NUM_STAGES)

    last = (n_tiles - 1) % NUM_STAGES
    v_last = v_buf.index(last).reshape([BLOCK_N, HEAD_DIM])
    if D_SPLIT > 0:
        o_tok, o2_tok = dot_split_n(p.to(dtype), v_last, rescaled(acc, alpha), rescaled(acc2, alpha), D_SPLIT)
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, o2_tok, v_last))[:2]
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_last, rescaled(acc, alpha), is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_last))[0]

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    # Q's buffer stages O for the TMA store (rows past Nq are dropped by TMA; sliced: the columns past
    # 64 + D_SPLIT keep Q, dropped as well)
    if D_SPLIT > 0:
        q_smem.slice(0, 64, 1).store(normalized(acc, l_i).to(dtype))
        q_smem.slice(64, W2, 1).store(normalized(acc2, l_i).to(dtype))
    else:
        q_smem.store(normalized(acc, l_i).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [z, h, start_m, 0], q_buf)
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(L + bh * n_q + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < n_q)
    tma.store_wait(0)


def enough_work(programs: int, device: torch.device, per_sm: int) -> bool:
    """At least `per_sm` programs per SM of the device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return programs >= per_sm * sm_count(index)


@functools.cache
def _box_layout(rows: int, head_dim: int, bf16: bool):
    """The shared-memory layout of a (1, 1, rows, head_dim) box (made once: descriptors are built every call)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gl.bfloat16 if bf16 else gl.float16)


def tile_dim(head_dim: int) -> int:
    """The kernels' tile width for a head dim: the next power of two, at least 64 (wgmma and Gluon's register
    tiles are powers of two).  A narrower head dim (80, 96) runs in 128-wide tiles: its descriptors' boxes
    are 128 columns wide, so TMA zero-fills the columns past d on loads (they add nothing to Q K^T, and the
    products' columns past d are zero) and drops them on stores."""
    return max(64, triton.next_power_of_2(head_dim))


# Head dims whose products over d skip the 128-wide tile's zero columns: d = 64 + (d - 64) in two K-dim slices
# of the tile's shared memory (the first 64 columns are one 128-byte swizzle row, so both slices are whole
# wgmma operands), wgmma's work over d 80 is 80 columns instead of 128.  Bit-equal to the whole tile (the
# skipped columns are zeros); measured per kernel in docs/flash-attention-experiments.md, Section 14.
SLICED_HEAD_DIMS = (80, 96)


def d_split(head_dim: int) -> int:
    """The kernels' D_SPLIT for a head dim: d - 64 where the products over d run in two slices
    (`SLICED_HEAD_DIMS` in a 128-wide tile), else 0 (the whole tile)."""
    return head_dim - 64 if head_dim in SLICED_HEAD_DIMS and tile_dim(head_dim) == 128 else 0


def descriptor(t: torch.Tensor, rows: int):
    """A rank-4 TMA descriptor over the (Z, H, N, d) tensor t with (1, 1, rows, tile_dim(d)) boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = tile_dim(t.shape[-1])
    layout = _box_layout(rows, width, t.dtype is torch.bfloat16)
    return TensorDescriptor.from_tensor(t, [1, 1, rows, width], layout)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            causal: bool, wrap=direct) -> None:
    """o (like q) and lse ((Z, H, Nq) contiguous float32) written in place; q, k, v, o (Z, H, N, d) with
    TMA strides (`plan.tma_layout_ok`), k and v with H_kv heads dividing H.  ``wrap``: `flash_launch.direct`, or a
    `flash_replay.Recorder` recording the launch.  (At d 64 and 128 the plan takes the warp-specialized
    form of this kernel instead: flash_fwd_hopper_ws, same results bit for bit.)"""
    n_q, d = q.shape[-2:]
    heads, n_k = q.shape[1], k.shape[-2]
    bm, bn, ring = tiles(d)
    grid = (triton.cdiv(n_q, bm), q.shape[0] * heads)
    wrap(flash_fwd_hopper_kernel)[grid](
        descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), descriptor(o, bm), lse,
        LOG2E / math.sqrt(d), n_q, n_k, heads, heads // k.shape[1],
        CAUSAL=causal, HEAD_DIM=tile_dim(d), BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=ring, num_warps=bm // 16,
        D_SPLIT=d_split(d),
    )
