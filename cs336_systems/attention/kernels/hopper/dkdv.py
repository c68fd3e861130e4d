"""FlashAttention dK/dV for Hopper (sm_90) in Gluon: the backward's largest kernel with asynchronous warpgroup
MMAs, so that each step's exponentials and elementwise work overlap tensor-core work.

    dkdv(q, k, v, do, lse, delta, dk, dv, causal)
    q, do: (Z, H, Nq, d)   k, v, dk, dv: (Z, H_kv, Nk, d)   lse, delta: (Z, H, Nq) float32

lse is the forward's L (natural log) and delta = rowsum(O * dO), which the portable dQ kernel
(portable.kernels.flash_bwd_dq_kernel) computes and stores; launch that one first, as the portable backward does.

One program of one warpgroup (4 warps) owns BLOCK_N = 64 keys of one (z, h_kv) (wgmma's M) with K and V
resident in shared memory and dK, dV accumulating in registers, and walks the query tiles (BLOCK_M rows) of
every query head of its group: Q and dO arrive through a NUM_STAGES-deep TMA ring.  Per query tile t:

    S^T = K Q_t^T,  dP^T = V dO_t^T                 (async wgmma groups, issued back to back)
    wait for S^T (dP^T still running; dK/dV of tile t - 1 are then done too, freeing their ring stage)
    P^T = exp2(S^T * log2(e)/sqrt(d) - L_t * log2(e)), masked       (overlaps dP^T)
    wait for dP^T;  dS^T = P^T * (dP^T - delta_t)
    dV += P^T dO_t,  dK += dS^T Q_t                  (async, left running into tile t + 1's S^T and dP^T)

The portable kernel cannot express this: Triton waits for every wgmma right after issuing it
(docs/flash-attention-experiments.md, Section 8).  Small programs, several per SM, let one program's
exponentials run under another's products; two warpgroups per program (BLOCK_N 128) measured slower (Section
14 there: the compiled code's CTA-wide barriers lock them into the same step).  dK is scaled by 1/sqrt(d)
once at the end; dK and dV leave through shared memory (K's and V's buffers) and TMA stores, which drop rows
past Nk.  Grouped-query attention: the query loop runs over the group's heads in turn, so
dK and dV sum over the group with no atomics.

d 256: a (64, 256) float32 accumulator is 128 registers a thread, so one warpgroup cannot hold dK and dV
together; `launch` hands d 256 to hopper/backward_wide, whose two consumer warpgroups split the head dim of a
64-key block (each holds half of dK and of dV) and share P^T and dS^T through shared memory: four tile products,
where one-accumulator programs need five (S^T twice).

Written against Triton 3.6's Gluon API, like the other Gluon kernels (its descriptors and helpers are `common`'s); where
it runs is decided by `cs336_systems.attention.plan` (its table `RULES`).  bfloat16 and float16; head dims 64,
80, 96 and 128 here, 256 through hopper/backward_wide (80 and 96 in 128-wide tiles: `common.tile_dim`, with S^T and
dP^T over two
K-dim slices of the tiles, 64 and d - 64 columns, `common.dot_nt`; dK and dV keep 128-wide
accumulators, so their products still run over the tile's zero columns).
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

HEAD_DIMS = (64, 80, 96, 128, 256)  # where it runs: `cs336_systems.attention.plan`


def tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per program, BLOCK_M query rows per step, ring stages), the fastest measured
    (docs/flash-attention-experiments.md, Section 14): d 64 takes 64 x 64 with 3 stages, d 128 64 x 32 with 4
    (a 64-row query step at d 128 holds S^T, dP^T, dK and dV in registers with too little room left).  Shared
    memory at d 128: K + V 32 KB and 4 x (Q + dO) 64 KB."""
    return (64, 64, 3) if head_dim <= 64 else (64, 32, 4)


@gluon.jit
def _load_q_do(q_desc, do_desc, q_buf, do_buf, ready, z, kv_head, group, tile, n_iter, m_tiles, lo_tile,
               BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA-load step `tile` (Q and dO rows of one query head) into its ring stage; a no-op past the last."""
    stage = tile % NUM_STAGES
    pred = tile < n_iter
    h = kv_head * group + tile // m_tiles
    m0 = (lo_tile + tile % m_tiles) * BLOCK_M
    mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [z, h, m0, 0], ready.index(stage), q_buf.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [z, h, m0, 0], ready.index(stage), do_buf.index(stage), pred=pred)


@gluon.jit
def flash_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L, Delta, sm_scale, qk_scale,
                             n_q, n_k, heads, kv_heads, group,
                             CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
                             D_SPLIT: gl.constexpr):
    """Grid (key blocks, Z * H_kv): one program accumulates dK and dV of BLOCK_N keys of one (z, h_kv).
    D_SPLIT: `common.dot_nt`'s, for S^T and dP^T."""
    dtype: gl.constexpr = q_desc.dtype
    DP_GROUPS: gl.constexpr = 2 if D_SPLIT > 0 else 1  # wgmma groups of dP^T (`common.dot_nt`)
    k_buf, v_buf, kv_bar = common.alloc_pair(k_desc, v_desc, BLOCK_N, HEAD_DIM)
    q_buf, do_buf, ready = common.alloc_ring(q_desc, do_desc, BLOCK_M, HEAD_DIM, NUM_STAGES)
    fence_async_shared()
    start_n = gl.program_id(0) * BLOCK_N
    zh = gl.program_id(1)
    z = zh // kv_heads
    kv_head = zh % kv_heads

    s_layout: gl.constexpr = common.mma_layout(num_warps, BLOCK_M)
    acc_layout: gl.constexpr = common.mma_layout(num_warps, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_smem = k_buf.reshape([BLOCK_N, HEAD_DIM])
    v_smem = v_buf.reshape([BLOCK_N, HEAD_DIM])

    # Query tiles this key block needs: causal, queries before start_n see none of its keys.
    if CAUSAL:
        lo_tile = start_n // BLOCK_M
    else:
        lo_tile = 0
    m_tiles = gl.maximum(gl.cdiv(n_q, BLOCK_M) - lo_tile, 1)  # at least 1: a divisor below
    n_iter = gl.maximum(gl.cdiv(n_q, BLOCK_M) - lo_tile, 0) * group
    # Steps whose query tile lies wholly at or after the block's last key and inside Nq need no mask.
    if CAUSAL:
        diag_tiles = gl.cdiv(start_n + BLOCK_N, BLOCK_M) - lo_tile  # tiles crossing the diagonal
    else:
        diag_tiles = 0
    full_end = n_q // BLOCK_M - lo_tile  # relative tiles that are complete (no rows past Nq)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [z, kv_head, start_n, 0], kv_bar, k_buf)
    tma.async_copy_global_to_shared(v_desc, [z, kv_head, start_n, 0], kv_bar, v_buf)
    for t in gl.static_range(NUM_STAGES):
        _load_q_do(q_desc, do_desc, q_buf, do_buf, ready, z, kv_head, group, t, n_iter, m_tiles, lo_tile,
                   BLOCK_M, NUM_STAGES)

    # loop-carried as in-flight accumulators: each step waits for the previous step's products
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=key_layout)
    mbarrier.wait(kv_bar, 0)

    for t in range(n_iter):
        stage = t % NUM_STAGES
        rel = t % m_tiles
        h = kv_head * group + t // m_tiles
        m0 = (lo_tile + rel) * BLOCK_M
        cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
        row_base = (z * heads + h) * n_q
        in_q = cols < n_q
        lse = gl.load(L + row_base + cols, mask=in_q, other=0.0) * 1.4426950408889634
        delta = gl.load(Delta + row_base + cols, mask=in_q, other=0.0)
        mbarrier.wait(ready.index(stage), (t // NUM_STAGES) & 1)
        q_s = q_buf.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do_s = do_buf.index(stage).reshape([BLOCK_M, HEAD_DIM])
        s_tok = common.dot_nt(k_smem, q_s, s_zero, D_SPLIT)
        # S^T done, and so are the previous step's dK/dV products: its ring stage takes step t - 1 + NUM_STAGES
        # (dP^T left in flight)
        dp_tok = common.dot_nt(v_smem, do_s, s_zero, D_SPLIT)
        s_t, dk, dv = warpgroup_mma_wait(num_outstanding=DP_GROUPS, deps=(s_tok, dk, dv))
        if t > 0:
            _load_q_do(q_desc, do_desc, q_buf, do_buf, ready, z, kv_head, group, t - 1 + NUM_STAGES, n_iter,
                       m_tiles, lo_tile, BLOCK_M, NUM_STAGES)
        # keys past Nk (zero-filled K) are not masked: their dK/dV rows are dropped by the TMA stores
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        if (rel < diag_tiles) | (rel >= full_end):
            visible = gl.expand_dims(in_q, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1))
            p_t = gl.where(visible, p_t, 0.0)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, q_s, do_s))[0]
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        ds_op = gl.convert_layout(ds_t.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)

    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    # K's and V's buffers stage dK and dV for the TMA stores
    k_smem.store((dk * sm_scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [z, kv_head, start_n, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [z, kv_head, start_n, 0], v_buf)
    tma.store_wait(0)


def launch(q, k, v, do, lse, delta, dk, dv, causal: bool, wrap=direct) -> None:
    """dk, dv (like k, v; TMA strides, `plan.tma_layout_ok`) written in place; lse, delta (Z, H, Nq)
    contiguous float32.  One launch; d 256 is hopper/backward_wide's `launch_dkdv` (module docstring).
    ``wrap``: `portable.launch.direct`, or a `replay.Recorder` recording the launch."""
    n_q, d = q.shape[-2:]
    if d == 256:
        from cs336_systems.attention.kernels.hopper import backward_wide

        backward_wide.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, wrap)
        return
    kv_heads = k.shape[1]
    block_n, block_m, stages = tiles(common.tile_dim(d))
    wrap(flash_dkdv_hopper_kernel)[(triton.cdiv(k.shape[-2], block_n), k.shape[0] * kv_heads)](
        common.descriptor(q, block_m), common.descriptor(k, block_n), common.descriptor(v, block_n),
        common.descriptor(do, block_m), common.descriptor(dk, block_n), common.descriptor(dv, block_n), lse, delta,
        1.0 / math.sqrt(d), common.LOG2E / math.sqrt(d), n_q, k.shape[-2], q.shape[1], kv_heads, q.shape[1] // kv_heads,
        CAUSAL=causal, HEAD_DIM=common.tile_dim(d), BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
        num_warps=block_n // 16,  # 16 rows per warp: one warpgroup per 64 keys
        D_SPLIT=common.d_split(d),
    )
