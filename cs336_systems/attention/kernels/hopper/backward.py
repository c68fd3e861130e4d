"""Fused FlashAttention backward for Hopper (sm_90) in Gluon at head dims 64, 80, 96 and 128: dQ, dK and dV from
one pass over the attention matrix (five tile products per tile instead of the two-kernel backward's seven).
`launch` hands head dim 256 to hopper/backward_wide, whose two consumers split the head dim instead of the keys.

    backward(q, k, v, o, do, lse, delta, dqa, dq, dk, dv, causal)
    q, o, do, dq: (Z, H, Nq, d)   k, v, dk, dv: (Z, H_kv, Nk, d)   lse, delta: (Z, H, Nq) float32, d 64-128
    dqa: (Z, H, Nq, d) float32 contiguous (dQ's accumulator, zeroed here)

Three launches: `common.dq_prep_kernel` (delta = rowsum(O * dO), dqa = 0), `flash_bwd_hopper_kernel`,
`common.dq_post_kernel`
(dQ = dqa / sqrt(d) in dq's dtype and strides).  The main kernel takes FlashAttention-3's tiles: one program
owns 128 keys of one (z, h_kv) and walks the query rows of every query head of its group in steps of BLOCK_M
(128 at d 64, 64 at d 128).  Four partitions (`gl.warp_specialize`):

    producer (1 warp):   K and V once; per step Q and dO (TMA) and the step's L·log2(e) and delta rows
                         (plain loads into shared memory) into a NUM_STAGES ring
    consumer w (4 warps, w = 0, 1), keys 64w .. 64w + 64, per step t:
        S^T = K_w Q_t^T, dP^T = V_w dO_t^T               (64 x BLOCK_M each, asynchronous)
        P^T = exp2(S^T · log2(e)/sqrt(d) - L_t · log2(e)), masked, rounded to the input dtype
        dS^T = P^T (dP^T - delta_t)
        dV_w += P^T dO_t, dK_w += dS^T Q_t                (P^T and dS^T as register operands)
        dS^T rows into the step's shared (128 keys, BLOCK_M queries) tile (two stages)
        a part of dQ_{t-1} = dS_{t-1} K over all 128 keys, from the previous step's tile (both consumers'
        rows are in by now): 128-row steps, rows 64w .. + 64 (the tile's transposed column slice);
        64-row steps, columns (d/2)w .. + d/2 (K's column slice)
        that part (float32) to the consumer's staging tile
    writer (1 warp):     each staging tile reduce-added into dqa by TMA (`cp.reduce.async.bulk.tensor`)

d 80 and 96 run in d 128's 128-wide tiles: TMA zero-fills the columns past d on loads and drops them on
stores, and the two products over d (S^T, dP^T) skip the zero columns in two slices (64 + d - 64, as the other
Gluon kernels at these head dims); dV, dK and dQ keep the whole width.

Every product's A operand is a register tile or a shared slice, so a consumer holds S^T and dP^T (64
registers a thread each at d 64, 32 at d 128), dK and dV (32 each at d 64, 64 at d 128) and its dQ part (32)
at 240 registers each (`REGS`).  P^T is rounded
before dS^T is formed (the P^T that dV takes): with P^T in float32 beside dP^T the consumers spilled and the
kernel ran far slower (docs/flash-attention-experiments.md, Section 8).  The dS tile is double-buffered; its
stages and the ring's are released by mbarriers that both consumers arrive at.  The
consumers share the dS tiles but never wait for each other within a step: each takes the dQ of the step
before, whose tile the other consumer filled a step earlier, so they drift apart (one's exponentials under
the other's products) instead of meeting every step.

dK and dV are deterministic.  dQ is not bit for bit: its float32 sums arrive by TMA reductions from the
programs of every key block, in an order that varies from run to run (as FlashAttention-2/3's atomic dQ).

Causal: a program's first steps cover the diagonal block (128 keys start at a multiple of 128), the only
ones masked besides ragged last steps.  Keys past Nk are zero-filled by TMA and masked in the last key
block (their dK / dV rows are clipped by the stores).  Grouped-query attention: the step loop runs over
the program's share of the group's heads in turn, so dK and dV sum over them without atomics.  Where one
program per K/V head's key block would leave fewer than `SPLIT_PER_SM` programs an SM or a causal program
more than `SPLIT_STEPS` query steps, `group_splits` splits the group among several programs (grid Z * H_kv
* splits); each then writes float32 partial dK and dV and `_sum_kernel` adds them in split order
(deterministic).  The partials take 2 x splits x Z x H_kv x key blocks·128 x 128 floats, up to twice the
dQ accumulator's size at d 128 when the whole group is split (MQA, long causal rows).

Written against Triton 3.6's Gluon API, like the other Gluon kernels (its descriptors and layouts are `common`'s); where
it runs is decided by `cs336_systems.attention.plan` (its table `RULES`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.attention.kernels.hopper import common
from cs336_systems.attention.kernels.portable.launch import (
    direct,
    fewest_group_splits,
    forced_group_splits,
    sm_count,
)

HEAD_DIMS = (64, 80, 96, 128, 256)  # 256: hopper/backward_wide's kernel (`launch` hands it over)
BLOCK_N = 128  # keys per program: two consumers of 64
# query rows per step: 128 at d 64 (consumer w computes dQ rows 64 w .. + 64), 64 at d 128, where a
# consumer's dK and dV take 128 registers (consumer w computes dQ columns 64 w .. + 64 of the step's rows).
# 64-row steps at d 64 do not spill, yet measured no faster causal and 4% slower without the mask
# (docs/flash-attention-experiments.md, Section 8)
# d 80 and 96 run in d 128's tiles (`common.tile_dim`: TMA zero-fills the columns past d), with the two
# products over d (S^T, dP^T) in slices that skip the zeros (`common.d_split`)
BLOCK_M = {64: 128, 128: 64}
NUM_STAGES = 2  # Q / dO ring (32 KB a stage at d 64 and 128); dS stages 32 KB (d 64) / 16 KB (d 128) each
DS_STAGES = 2  # one stage measured slower (docs/flash-attention-experiments.md, Section 8)
# grouped heads: split each group among programs until the grid has this many programs per SM and a causal
# program walks at most this many query steps (`group_splits`): the splits that measured fastest at H 32 / 8,
# d 64 and 128, N 2048 and 8192 (H200; docs/flash-attention-experiments.md, Section 18)
SPLIT_PER_SM = 2
SPLIT_STEPS = 64
# the launch's 168 registers a thread over 12 warps (the two one-warp workers fill a warpgroup), rebalanced
# by `setmaxnreg`: 240 for the worker consumer warpgroup and 24 (the least) for the workers' warpgroup; the
# first consumer (the default partition) gets what is left, 168 x 3 - 240 - 24 = 240.  Both consumers still
# spill at d 64, and the one with fewer registers sets the pace: 232 / 240 measured 8% slower than 240 / 240
# (docs/flash-attention-experiments.md, Section 8)
MAXNREG = 168
REGS = (240, 24)
_BLOCK_N = gl.constexpr(BLOCK_N)


@gluon.jit
def _kv_slice(kv_heads, group, splits):
    """This program's K/V head and its share of the group's query heads (grid dimension 1: Z * H_kv * splits,
    the splits of one K/V head adjacent): (z, K/V head, split, first query head, query heads)."""
    pid = gl.program_id(1)
    zkv = pid // splits
    split = pid % splits
    kv_head = zkv % kv_heads
    per_split = group // splits
    return zkv // kv_heads, kv_head, split, kv_head * group + split * per_split, per_split


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready,
              empty, L, Delta, n_q, heads, kv_heads, group, splits, CAUSAL: gl.constexpr,
              NUM_STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
    """`common.backward_producer` for this program's key block and its share of the group's query heads."""
    z, kv_head, split, h0, per_split = _kv_slice(kv_heads, group, splits)
    common.backward_producer(q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf,
                             delta_buf, ready, empty, L, Delta, n_q, heads, z, kv_head, gl.program_id(0) * _BLOCK_N,
                             h0, per_split, CAUSAL, NUM_STAGES, BLOCK_M)


@gluon.jit
def _writer(dq_desc, dq_stage, dq_full, dq_empty, n_q, kv_heads, group, splits, CAUSAL: gl.constexpr,
            BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Per step, each consumer's finished dQ rows reduce-added into dqa; the staging tile is released once
    the copy has read it."""
    start_n = gl.program_id(0) * _BLOCK_N
    z, kv_head, split, h0, per_split = _kv_slice(kv_heads, group, splits)
    lo_tile, m_tiles, n_iter = common.query_steps(start_n, n_q, per_split, CAUSAL, BLOCK_M)
    for t in range(n_iter):
        h = h0 + t // m_tiles
        m0 = (lo_tile + t % m_tiles) * BLOCK_M
        for w in gl.static_range(2):
            mbarrier.wait(dq_full.index(w), t & 1)
            # 128-row steps: consumer w's rows 64 w .. + 64; 64-row steps: its half of the columns (rows past
            # Nq are clipped)
            if BLOCK_M == 128:
                common.reduce_add(dq_desc, [z, h, m0 + 64 * w, 0], dq_stage.index(w))
            else:
                common.reduce_add(dq_desc, [z, h, m0, (HEAD_DIM // 2) * w], dq_stage.index(w))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(w), count=1)


@gluon.jit
def _dq_product(ds_buf, ds_full, k_all, dq_zero, u, W: gl.constexpr, DS_STAGES: gl.constexpr, wait,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Issue this consumer's part of step t's dQ = dS_t K, t = u - DS_STAGES (u >= 0 keeps the arithmetic
    non-negative): A is step t's dS tile, transposed (128-row steps: its 64-column slice W; 64-row steps:
    whole), once both consumers' rows are in (unless ``wait`` is false); B is K over all 128 keys (128-row
    steps: every column; 64-row steps: columns HEAD_DIM/2 W .. + HEAD_DIM/2).  Returns the asynchronous
    accumulator."""
    db = u % DS_STAGES
    mbarrier.wait(ds_full.index(db), ((u // DS_STAGES) - 1) & 1, pred=wait)
    if BLOCK_M == 128:  # dQ rows 64 W .. + 64 (of 128), every column
        a_ds = ds_buf.index(db).slice(W * 64, 64, 1).permute((1, 0))
        return warpgroup_mma(a_ds, k_all, dq_zero, use_acc=False, is_async=True)
    else:  # every row (of 64), half of dQ's columns
        half: gl.constexpr = HEAD_DIM // 2
        return warpgroup_mma(ds_buf.index(db).permute((1, 0)), k_all.slice(W * half, half, 1), dq_zero,
                             use_acc=False, is_async=True)


@gluon.jit
def _consumer(done, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, ds_buf, ds_full,
              ds_empty, dq_stage, dq_full, dq_empty, dk_desc, dv_desc, DKP, DVP, sm_scale, qk_scale, n_q, n_k,
              kv_heads, group, splits, W: gl.constexpr, CAUSAL: gl.constexpr, RAGGED_KEYS: gl.constexpr,
              NUM_STAGES: gl.constexpr, DS_STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
              D_SPLIT: gl.constexpr, PARTIALS: gl.constexpr):
    """Keys start_n + 64 W .. + 64: dK and dV, and this consumer's (64, 64) part of every step's dQ (rows
    64 W .. + 64 at d 64, columns at d 128; module docstring).  PARTIALS: dK and dV of this program's share
    of the group go to float32 partial sums (DKP, DVP: (splits, Z * H_kv, key blocks * 128, HEAD_DIM)
    contiguous), which `_sum_kernel` adds up."""
    dtype: gl.constexpr = dk_desc.dtype
    start_blk = gl.program_id(0) * _BLOCK_N
    start_n = start_blk + W * 64
    z, kv_head, split, h0, per_split = _kv_slice(kv_heads, group, splits)
    s_layout: gl.constexpr = common.mma_layout(4, BLOCK_M)
    acc_layout: gl.constexpr = common.mma_layout(4, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_all = k_buf.reshape([_BLOCK_N, HEAD_DIM])
    k_smem = k_all.slice(W * 64, 64, 0)
    v_smem = v_buf.reshape([_BLOCK_N, HEAD_DIM]).slice(W * 64, 64, 0)
    lo_tile, m_tiles, n_iter = common.query_steps(start_blk, n_q, per_split, CAUSAL, BLOCK_M)
    full_end = n_q // BLOCK_M - lo_tile  # relative tiles with no rows past Nq
    diag_tiles = _BLOCK_N // BLOCK_M  # causal: the steps over the block's own 128 queries
    dk = gl.zeros([64, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, layout=acc_layout)
    DQ_N: gl.constexpr = 64 if BLOCK_M == 128 else HEAD_DIM // 2  # the columns of a consumer's dQ part
    dq_layout: gl.constexpr = common.mma_layout(4, DQ_N)
    dq_zero = gl.zeros([64, DQ_N], gl.float32, layout=dq_layout)
    DP_GROUPS: gl.constexpr = 2 if D_SPLIT > 0 else 1  # wgmma groups of a product over d (`common.dot_nt`)
    s_zero = gl.zeros([64, BLOCK_M], gl.float32, layout=s_layout)
    keys = start_n + gl.arange(0, 64, layout=key_layout)
    # keys past Nk are zero-filled: their scores are 0 and exp(-L) could overflow the input dtype (L very
    # negative), and dQ would then take inf x 0 from their zero K rows: the last key block masks them.  A
    # constexpr, so that Nk a multiple of 128 compiles none of it (docs/flash-attention-experiments.md,
    # Section 16)
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iter):
        stage = t % NUM_STAGES
        db = t % DS_STAGES
        rel = t % m_tiles
        m0 = (lo_tile + rel) * BLOCK_M
        mbarrier.wait(ready.index(stage), (t // NUM_STAGES) & 1)
        q_s = q_buf.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do_s = do_buf.index(stage).reshape([BLOCK_M, HEAD_DIM])
        s_tok = common.dot_nt(k_smem, q_s, s_zero, D_SPLIT)
        dp_tok = common.dot_nt(v_smem, do_s, s_zero, D_SPLIT)
        lse = lse_buf.index(stage).load(col_layout)
        s_t = warpgroup_mma_wait(num_outstanding=DP_GROUPS, deps=(s_tok, q_s))[0]  # dP^T's groups still running
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        need_mask = rel >= full_end
        if RAGGED_KEYS:
            need_mask = need_mask | (start_blk + _BLOCK_N > n_k)
        if CAUSAL:
            need_mask = need_mask | (rel < diag_tiles)
        if need_mask:
            cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
            visible = gl.expand_dims(cols < n_q, 0)
            if RAGGED_KEYS:
                visible = visible & gl.expand_dims(keys < n_k, 1)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1))
            p_t = gl.where(visible, p_t, 0.0)
        p_lo = p_t.to(dtype)  # rounded once: dV's operand and dS^T's factor (module docstring)
        delta = delta_buf.index(stage).load(col_layout)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, do_s))[0]
        ds_t = (p_lo.to(gl.float32) * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        dv = warpgroup_mma(gl.convert_layout(p_lo, op_layout), do_s, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, op_layout), q_s, dk, is_async=True)
        # this consumer's dS^T rows into the step's tile, once both dQ products of its previous use are done
        if t >= DS_STAGES:
            mbarrier.wait(ds_empty.index(db), ((t // DS_STAGES) - 1) & 1)
        ds_buf.index(db).slice(W * 64, 64, 0).store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_full.index(db), count=1)
        # dQ of the previous step: its dS tile is complete unless the other consumer is a step behind, so the
        # consumers need not meet every step (the same step's dQ, which makes them meet, measured slower;
        # docs/flash-attention-experiments.md, Section 8).  At t = 0 the product runs on the other dS stage
        # without waiting and its result is dropped (branch-free: the accumulators keep one type through the
        # loop).
        dq = _dq_product(ds_buf, ds_full, k_all, dq_zero, t + DS_STAGES - 1, W, DS_STAGES, t > 0, BLOCK_M,
                         HEAD_DIM)
        dk, dv, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq))
        mbarrier.arrive(empty.index(stage), count=1)  # Q, dO, L and delta of this stage are read
        if t > 0:
            mbarrier.arrive(ds_empty.index((t - 1) % DS_STAGES), count=1)
            common.stage_dq(dq, dq_stage, dq_full, dq_empty, t - 1, W, DQ_N)
    if n_iter > 0:  # the last step's dQ
        dq = _dq_product(ds_buf, ds_full, k_all, dq_zero, n_iter - 1 + DS_STAGES, W, DS_STAGES, True, BLOCK_M,
                         HEAD_DIM)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        common.stage_dq(dq, dq_stage, dq_full, dq_empty, n_iter - 1, W, DQ_N)
    if PARTIALS:  # float32, straight from the registers (no shared memory: K is still the other's operand)
        rows = start_n + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        row0 = (split * (gl.num_programs(1) // splits) + z * kv_heads + kv_head).to(gl.int64) * (
            gl.num_programs(0) * _BLOCK_N)
        offsets = (row0 + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(cols, 0)
        gl.store(DKP + offsets, dk * sm_scale)
        gl.store(DVP + offsets, dv)
    else:
        # K is both consumers' dQ operand: overwrite it with dK only once both are done with it
        mbarrier.arrive(done, count=1)
        v_smem.store(dv.to(dtype))
        mbarrier.wait(done, 0)
        k_smem.store((dk * sm_scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [z, kv_head, start_n, 0], k_buf.slice(W * 64, 64, 2))
        tma.async_copy_shared_to_global(dv_desc, [z, kv_head, start_n, 0], v_buf.slice(W * 64, 64, 2))
        tma.store_wait(0)


@gluon.jit
def flash_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DKP, DVP, L, Delta,
                            sm_scale, qk_scale, n_q, n_k, heads, kv_heads, group, splits, CAUSAL: gl.constexpr,
                            RAGGED_KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, DS_STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr, D_SPLIT: gl.constexpr,
                            PARTIALS: gl.constexpr):
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    """Grid (key blocks of 128, Z * H_kv * splits); num_warps 4 (the first consumer), plus a consumer warpgroup, the
    producer warp and the writer warp as workers.  Shared memory at d 64 (d 128): K, V 32 (64) KB; the ring
    2 x 32 KB; the dS tiles 2 x 32 (16) KB; the dQ staging tiles 2 x 16 KB: 195 (194) KB with the ring's L and
    delta rows."""
    dtype: gl.constexpr = k_desc.dtype
    k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty = common.alloc_backward(
        k_desc, q_desc, do_desc, _BLOCK_N, BLOCK_M, HEAD_DIM, NUM_STAGES)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, BLOCK_M], dtype)
    ds_buf = gl.allocate_shared_memory(dtype, [DS_STAGES, _BLOCK_N, BLOCK_M], ds_layout)
    ds_full = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DS_STAGES):
        mbarrier.init(ds_full.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=2)
    dq_stage = gl.allocate_shared_memory(gl.float32, [2, 1, 1, 64, dq_desc.block_type.shape[3]], dq_desc.layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (done, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, ds_buf, ds_full,
                     ds_empty, dq_stage, dq_full, dq_empty, dk_desc, dv_desc, DKP, DVP, sm_scale, qk_scale, n_q, n_k,
                     kv_heads, group, splits, 0, CAUSAL, RAGGED_KEYS, NUM_STAGES, DS_STAGES, BLOCK_M, HEAD_DIM, D_SPLIT,
                     PARTIALS)),
        (_consumer, (done, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, ds_buf, ds_full,
                     ds_empty, dq_stage, dq_full, dq_empty, dk_desc, dv_desc, DKP, DVP, sm_scale, qk_scale, n_q, n_k,
                     kv_heads, group, splits, 1, CAUSAL, RAGGED_KEYS, NUM_STAGES, DS_STAGES, BLOCK_M, HEAD_DIM, D_SPLIT,
                     PARTIALS)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready,
                     empty, L, Delta, n_q, heads, kv_heads, group, splits, CAUSAL, NUM_STAGES, BLOCK_M)),
        (_writer, (dq_desc, dq_stage, dq_full, dq_empty, n_q, kv_heads, group, splits, CAUSAL, BLOCK_M, HEAD_DIM)),
    ], [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])


@triton.jit
def _sum_kernel(DKP, DVP, DK, DV, n_k, rows_padded, split_stride, splits, kv_heads, sk_z, sk_h, sk_n, sv_z, sv_h,
                sv_n, D: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """dK and dV = the sums of their float32 partials over the splits (DKP, DVP: (splits, Z * H_kv,
    rows_padded, WIDTH) contiguous), in dK's and dV's dtypes and strides: BLOCK key rows of one (z, h_kv);
    grid (row blocks, Z * H_kv); ``split_stride``: Z * H_kv * rows_padded * WIDTH.  The splits are added in
    order: deterministic."""
    zkv = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, WIDTH)
    offsets = (zkv * rows_padded + rows[:, None]).to(tl.int64) * WIDTH + cols[None, :]
    dk = tl.zeros([BLOCK, WIDTH], tl.float32)
    dv = tl.zeros([BLOCK, WIDTH], tl.float32)
    dkp, dvp = DKP + offsets, DVP + offsets
    for _ in range(splits):  # pointer steps: 64-bit addresses however large the partials
        dk += tl.load(dkp)
        dv += tl.load(dvp)
        dkp += split_stride
        dvp += split_stride
    z, h = zkv // kv_heads, zkv % kv_heads
    m = (rows[:, None] < n_k) & (cols[None, :] < D)
    tl.store(DK + z * sk_z + h * sk_h + rows[:, None] * sk_n + cols[None, :], dk.to(DK.dtype.element_ty), mask=m)
    tl.store(DV + z * sv_z + h * sv_h + rows[:, None] * sv_n + cols[None, :], dv.to(DV.dtype.element_ty), mask=m)


def group_splits(group: int, programs: int, sm_count: int, steps: int = 0) -> int:
    """Into how many parts the fused backward splits each K/V head's group of query heads (a divisor of the
    group): ``CS336_FLASH_GROUP_SPLITS`` where set, else the fewest that give the grid (``programs``: key
    blocks x Z x H_kv, times the splits) at least `SPLIT_PER_SM` programs per SM and leave the longest
    program at most `SPLIT_STEPS` query steps (``steps``: the query tiles of one head a causal program walks
    at most; 0 without the mask, whose programs are balanced); 1 without grouped heads.  The portable dK/dV's
    rule (`portable.launch.fewest_group_splits`) with the bound on steps."""
    return forced_group_splits(group) or fewest_group_splits(group, programs, sm_count, SPLIT_PER_SM, steps,
                                                             SPLIT_STEPS)


def _accumulator_descriptor(dqa: torch.Tensor, columns: int):
    """(1, 1, 64, columns) float32 boxes over dQ's accumulator: a consumer's part of a step."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    box = [1, 1, 64, columns]
    return TensorDescriptor.from_tensor(dqa, box, gl.NVMMASharedLayout.get_default_for(box, gl.float32))


def launch(q, k, v, o, do, lse, delta, dqa, dq, dk, dv, causal: bool, wrap=direct) -> None:
    """dq (q's shape, unit stride on d), dk, dv (like k, v; TMA strides) written in place, and delta;
    lse, delta (Z, H, Nq) contiguous float32; dqa (Z, H, Nq, d) contiguous float32 (overwritten).
    ``wrap``: `portable.launch.direct`, or a `replay.Recorder` recording the three launches."""
    z, heads, n_q, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"the fused Hopper backward takes head dims {HEAD_DIMS}; got d={d}")
    if d == 256:  # two consumers splitting the head dim of a 64-key block (its module docstring)
        from cs336_systems.attention.kernels.hopper import backward_wide

        backward_wide.launch(q, k, v, o, do, lse, delta, dqa, dq, dk, dv, causal, wrap)
        return
    width = common.tile_dim(d)  # the kernel's tile: 128 at d 80 and 96
    block_m = BLOCK_M[width]
    kv_heads = k.shape[1]
    rows = (triton.cdiv(n_q, 64), z * heads)
    acc = (n_q * d, d, 1)  # dqa's strides: (Z * H, Nq, d) contiguous
    wrap(common.dq_prep_kernel)[rows](o, do, delta, dqa, n_q, heads, *o.stride()[:3], *do.stride()[:3], *acc, D=d,
                                      D_TILE=triton.next_power_of_2(d), BLOCK=64)
    n_k, group = k.shape[-2], heads // kv_heads
    blocks = triton.cdiv(n_k, BLOCK_N)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    steps = triton.cdiv(n_q, block_m) if causal else 0  # a causal grid's longest program, per query head
    splits = group_splits(group, blocks * z * kv_heads, sm_count(device), steps)
    if splits < 1 or group % splits:
        raise ValueError(f"group_splits must divide the group of {group} query heads; got splits={splits}")
    partials = ()
    if splits > 1:  # float32 partial dK and dV per split (every row and column written: no zeroing)
        partials = tuple(torch.empty(splits, z * kv_heads, blocks * BLOCK_N, width, device=q.device,
                                     dtype=torch.float32) for _ in range(2))
    grid = (blocks, z * kv_heads * splits)
    wrap(flash_bwd_hopper_kernel)[grid](
        common.descriptor(q, block_m), common.descriptor(k, BLOCK_N), common.descriptor(v, BLOCK_N),
        common.descriptor(do, block_m), common.descriptor(dk, 64), common.descriptor(dv, 64),
        _accumulator_descriptor(dqa, 64 if block_m == 128 else width // 2), *(partials or (lse, lse)),
        lse, delta, 1.0 / math.sqrt(d), common.LOG2E / math.sqrt(d), n_q, n_k, heads, kv_heads, group, splits,
        CAUSAL=causal, RAGGED_KEYS=n_k % BLOCK_N != 0, NUM_STAGES=NUM_STAGES, DS_STAGES=DS_STAGES,
        CONSUMER_REGS=REGS[0], WORKER_REGS=REGS[1], D_SPLIT=common.d_split(d), PARTIALS=splits > 1,
        num_warps=4, maxnreg=MAXNREG,
    )
    if splits > 1:
        wrap(_sum_kernel)[(triton.cdiv(n_k, 64), z * kv_heads)](
            *partials, dk, dv, n_k, blocks * BLOCK_N, partials[0][0].numel(), splits, kv_heads, *dk.stride()[:3],
            *dv.stride()[:3], D=d, WIDTH=width, BLOCK=64)
    wrap(common.dq_post_kernel)[rows](dqa, dq, n_q, heads, *dq.stride()[:3], *acc, 1.0 / math.sqrt(d), D=d,
                                      D_TILE=triton.next_power_of_2(d), BLOCK=64)
