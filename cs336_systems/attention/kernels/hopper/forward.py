"""FlashAttention forward for Hopper (sm_90) in Gluon: TMA loads, a K/V ring of mbarrier-tracked stages and
asynchronous warpgroup MMAs, with the next tile's scores computed while the current P V product runs.

    forward(q, k, v, o, lse, causal)   q, o: (Z, H, Nq, d)   k, v: (Z, H_kv, Nk, d)   lse: (Z, H, Nq) float32

Why a second forward: the portable Triton kernel (portable.kernels.flash_fwd_kernel) leaves the order of its two
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
runs is decided by `cs336_systems.attention.plan` (its table `RULES`).  At d 64 and 128, and at d 80 / 96
from 2048 keys, the plan takes the warp-specialized form of the same loop instead (hopper.forward_ws: a
producer warp and two independent consumer warpgroups; faster).
bfloat16 and float16 only; head dims 64, 80, 96, 128 and 256 (`HEAD_DIMS`; 80 and 96 in 128-wide tiles,
`tile_dim`).
"""

from __future__ import annotations

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

from cs336_systems.attention.kernels.hopper.common import (
    LOG2E,
    alloc_ring,
    d_split,
    descriptor,
    dot_nt,
    dot_split_n,
    key_tiles,
    load_kv,
    mma_layout,
    normalized,
    query_tile,
    rescaled,
    softmax_tile,
    tile_dim,
    wait_kv,
)
from cs336_systems.attention.kernels.portable.launch import direct

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

def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            causal: bool, wrap=direct) -> None:
    """o (like q) and lse ((Z, H, Nq) contiguous float32) written in place; q, k, v, o (Z, H, N, d) with
    TMA strides (`plan.tma_layout_ok`), k and v with H_kv heads dividing H.  ``wrap``: `portable.launch.direct`, or a
    `replay.Recorder` recording the launch.  (Where the plan's "fwd-ws" rules match it takes the
    warp-specialized form of this kernel instead: hopper.forward_ws, bit for bit the same at d 64 and 128.)"""
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
