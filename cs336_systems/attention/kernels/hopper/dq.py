"""FlashAttention dQ for Hopper (sm_90) in Gluon: the backward's dQ kernel with asynchronous warpgroup MMAs,
which also computes delta = rowsum(O * dO) for the dK/dV kernel that follows it.

    dq(q, k, v, o, do, lse, delta, dq_out, causal)
    q, o, do, dq_out: (Z, H, Nq, d)   k, v: (Z, H_kv, Nk, d)   lse, delta: (Z, H, Nq) float32

One program of one warpgroup (4 warps) owns BLOCK_M = 64 query rows of one (z, h) (wgmma's M) with Q and dO
resident in shared memory and dQ accumulating in registers, and walks the key tiles its rows see: K and V
arrive through a NUM_STAGES-deep TMA ring.  First delta = rowsum(O * dO) for its rows (O by pointer loads
while the TMA loads land; stored for dK/dV), then per key tile j:

    S = Q K_j^T,  dP = dO V_j^T                     (async wgmma groups, issued back to back)
    wait for S (dP still running; the previous tile's dQ product is then done too, freeing its ring stage)
    P = exp2(S * log2(e)/sqrt(d) - L * log2(e)), masked              (overlaps dP)
    wait for dP;  dS = P * (dP - delta)
    dQ += dS K_j                                      (async, left running into tile j + 1's S and dP)

dQ is scaled by 1/sqrt(d) once at the end and leaves through Q's buffer and a TMA store (rows past Nq are
dropped).  Causal programs run longest first; only key tiles that cross the diagonal or the end of the keys
are masked.  Grouped-query attention: query head h reads K/V head h // group.

At d 80 and 96 (128-wide tiles) S and dP are computed over two K-dim slices of the tiles, 64 and d - 64
columns, and dQ accumulates in two register tiles of those widths (`common.dot_nt`): no work on
the tile's zero columns.

Where it runs is decided by `cs336_systems.attention.plan` (its table `RULES`): d 256, where the portable dQ
kernel's tiles (64 x 32, with a (64, 256) float32 accumulator) run at a third of the tensor cores' rate; d 80
and 96 over a range of lengths; d 128 without the causal mask; causal d 64 and 128 at medium lengths only,
since at longer causal rows the portable kernel's 128-row programs measured faster
(docs/flash-attention-experiments.md, Section 14).  At d 128 the ring has two stages once the grid is large
enough (`two_stages`): two programs an SM instead of one.

Written against Triton 3.6's Gluon API, like the other Gluon kernels (its descriptors and helpers are `common`'s);
``CS336_FLASH_HOPPER_BWD`` (`FlashOptions.hopper_bwd`) switches it and hopper.dkdv together; bfloat16 and
float16; head dims 64, 80, 96, 128 and 256 (80 and 96 in 128-wide tiles, `common.tile_dim`).
"""

from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from cs336_systems.attention.kernels.hopper import common
from cs336_systems.attention.kernels.portable.launch import direct

HEAD_DIMS = (64, 80, 96, 128, 256)
# d 128: Q + dO 32 KB and two stages of K + V (64 KB) fit two programs an SM, where three stages (128 KB) fit
# one; faster on large grids, slower on small ones (docs/flash-attention-experiments.md, Section 14).
TWO_STAGE_PROGRAMS = {True: 1024, False: 512}  # by causal


# d 256 with long rows or few programs: 64-key steps with two stages (Q + dO 64 KB, 2 x (K + V) 128 KB: the same
# bytes in flight as three 32-key stages, in half as many steps); faster with fewer programs than SMs and at long
# rows, a few percent slower at two waves of short rows (docs/flash-attention-experiments.md, Section 14).
TILES_LONG_256 = (64, 64, 2)
LONG_QUERIES = 8192


def tiles(head_dim: int, long_rows: bool = False, two_stages: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M query rows per program, BLOCK_N keys per step, ring stages).  d 256: 64 x 32 with 3 stages (Q + dO
    64 KB and 3 x (K + V) 96 KB), or TILES_LONG_256 for `long_rows` (`dq`: at least LONG_QUERIES queries, or
    fewer programs than SMs).  Tile widths 64 and 128: 64 x 64 with 3 stages, 2 with `two_stages`."""
    if head_dim <= 128:
        return (64, 64, 2 if two_stages else 3)
    return TILES_LONG_256 if long_rows else (64, 32, 3)


def programs(z: int, heads: int, n_q: int) -> int:
    """The grid's 64-row programs (BLOCK_M is 64 in every tile choice): what the size rules and the tile
    choice count."""
    return triton.cdiv(n_q, 64) * z * heads


def two_stages(head_dim: int, programs: int, causal: bool) -> bool:
    """Two ring stages (two programs an SM) at d 128 with at least TWO_STAGE_PROGRAMS 64-row programs."""
    return head_dim == 128 and programs >= TWO_STAGE_PROGRAMS[causal]


@gluon.jit
def flash_dq_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, O, stride_oz, stride_oh, stride_on, L, Delta,
                           sm_scale, qk_scale, n_q, n_k, heads, group, head_dim,
                           CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
                           D_SPLIT: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    bh, z, h, kv_head, start_m = common.query_tile(heads, group, BLOCK_M, CAUSAL)

    s_layout: gl.constexpr = common.mma_layout(num_warps, BLOCK_N)
    acc_layout: gl.constexpr = common.mma_layout(num_warps, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # D_SPLIT > 0: dQ in two accumulators, columns [0, 64) and [64, 64 + D_SPLIT) (none for the tile's zeros)
    W2: gl.constexpr = D_SPLIT if D_SPLIT > 0 else 16
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # a plain blocked layout for the O * dO row sums (16-byte vectors along d)
    rowsum_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])

    q_buf, do_buf, qdo_bar = common.alloc_pair(q_desc, do_desc, BLOCK_M, HEAD_DIM)
    k_buf, v_buf, ready = common.alloc_ring(k_desc, v_desc, BLOCK_N, HEAD_DIM, NUM_STAGES)
    fence_async_shared()
    q_smem = q_buf.reshape([BLOCK_M, HEAD_DIM])
    do_smem = do_buf.reshape([BLOCK_M, HEAD_DIM])

    n_tiles, full = common.key_tiles(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)

    mbarrier.expect(qdo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [z, h, start_m, 0], qdo_bar, q_buf)
    tma.async_copy_global_to_shared(do_desc, [z, h, start_m, 0], qdo_bar, do_buf)
    for t in gl.static_range(NUM_STAGES):
        common.load_kv(k_desc, v_desc, k_buf, v_buf, ready, z, kv_head, t, n_tiles, BLOCK_N, NUM_STAGES)

    # delta = rowsum(O * dO) for these rows, stored for the dK/dV kernel
    rows_b = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rowsum_layout))
    cols_b = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rowsum_layout))
    # 64-bit offsets: O may hold 2^31 elements or more (the TMA descriptors carry their own)
    o_row0 = z.to(gl.int64) * stride_oz + h.to(gl.int64) * stride_oh
    o_ptrs = O + o_row0 + gl.expand_dims(rows_b.to(gl.int64), 1) * stride_on + gl.expand_dims(cols_b, 0)
    o_mask = gl.expand_dims(rows_b < n_q, 1) & gl.expand_dims(cols_b < head_dim, 0)  # a head dim below the tile's
    o_tile = gl.load(o_ptrs, mask=o_mask, other=0.0).to(gl.float32)
    mbarrier.wait(qdo_bar, 0)
    do_tile = do_smem.load(rowsum_layout).to(gl.float32)  # rows past Nq were zero-filled by TMA
    delta_b = gl.sum(o_tile * do_tile, axis=1)
    gl.store(Delta + bh * n_q + rows_b, delta_b, mask=rows_b < n_q)
    delta = gl.convert_layout(delta_b, row_layout)
    rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    lse = gl.load(L + bh * n_q + rows, mask=rows < n_q, other=0.0) * 1.4426950408889634

    if D_SPLIT > 0:
        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, 64], gl.float32, layout=common.mma_layout(num_warps, 64)))
        dq_hi = warpgroup_mma_init(gl.zeros([BLOCK_M, W2], gl.float32, layout=common.mma_layout(num_warps, W2)))
    else:
        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
        k_s = k_buf.index(stage).reshape([BLOCK_N, HEAD_DIM])
        v_s = v_buf.index(stage).reshape([BLOCK_N, HEAD_DIM])
        s_tok = common.dot_nt(q_smem, k_s, s_zero, D_SPLIT)
        dp_tok = common.dot_nt(do_smem, v_s, s_zero, D_SPLIT)
        # S done, and so is the previous tile's dQ product: its ring stage takes tile j - 1 + NUM_STAGES
        # (dP's one group in flight, two when sliced)
        if D_SPLIT > 0:
            s, dq, dq_hi = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, dq, dq_hi))
        else:
            s, dq = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, dq))
        if j > 0:
            common.load_kv(k_desc, v_desc, k_buf, v_buf, ready, z, kv_head, j - 1 + NUM_STAGES, n_tiles, BLOCK_N,
                         NUM_STAGES)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
        if j >= full:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(cols, 0) < n_k
            if CAUSAL:
                visible = visible & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
            p = gl.where(visible, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, q_smem, do_smem, k_s, v_s))[0]
        ds = p * (dp - gl.expand_dims(delta, 1))
        if D_SPLIT > 0:
            dq, dq_hi = common.dot_split_n(ds.to(dtype), k_s, dq, dq_hi, D_SPLIT)
        else:
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_s, dq, is_async=True)

    if D_SPLIT > 0:
        dq, dq_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq_hi))
    else:
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    mbarrier.invalidate(qdo_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    # Q's buffer stages dQ for the TMA store (sliced: its columns past 64 + D_SPLIT keep Q, dropped by the store)
    if D_SPLIT > 0:
        q_smem.slice(0, 64, 1).store((dq * sm_scale).to(dtype))
        q_smem.slice(64, W2, 1).store((dq_hi * sm_scale).to(dtype))
    else:
        q_smem.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [z, h, start_m, 0], q_buf)
    tma.store_wait(0)


def launch(q, k, v, o, do, lse, delta, dq_out, causal: bool, wrap=direct) -> None:
    """dq_out (like q; TMA strides, `plan.tma_layout_ok`) and delta ((Z, H, Nq) contiguous float32)
    written in place; lse is the forward's L, (Z, H, Nq) contiguous float32.  ``wrap``: `portable.launch.direct`,
    or a `replay.Recorder` recording the launch."""
    n_q, d = q.shape[-2:]
    heads = q.shape[1]
    width = common.tile_dim(d)
    count = programs(q.shape[0], heads, n_q)
    block_m, block_n, stages = tiles(width, n_q >= LONG_QUERIES or not common.enough_work(count, q.device, 1),
                                     two_stages(d, count, causal))
    grid = (triton.cdiv(n_q, block_m), q.shape[0] * heads)
    wrap(flash_dq_hopper_kernel)[grid](
        common.descriptor(q, block_m), common.descriptor(k, block_n), common.descriptor(v, block_n),
        common.descriptor(do, block_m), common.descriptor(dq_out, block_m), o, o.stride(0), o.stride(1), o.stride(2),
        lse, delta, 1.0 / math.sqrt(d), common.LOG2E / math.sqrt(d), n_q, k.shape[-2], heads, heads // k.shape[1], d,
        CAUSAL=causal, HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
        num_warps=block_m // 16,  # one warpgroup per 64 query rows
        D_SPLIT=common.d_split(d),
    )
