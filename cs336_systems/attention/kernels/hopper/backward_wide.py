"""FlashAttention backward for Hopper (sm_90) in Gluon at head dim 256: dK and dV of a 64-key block in one pass by
two consumer warpgroups that split the head dim, and with ``fused`` dQ from the same pass.

    launch(q, k, v, o, do, lse, delta, dqa, dq, dk, dv, causal)            (fused: dQ, dK, dV)
    launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal)                  (dK, dV; dQ from hopper/dq)
    q, o, do, dq: (Z, H, Nq, 256)   k, v, dk, dv: (Z, H_kv, Nk, 256)   lse, delta: (Z, H, Nq) float32
    dqa: Z * H * Nq * 256 float32 contiguous (dQ's accumulator, transposed: (Z, H, 256, Nq); zeroed here)

Why its own kernel.  A (64, 256) float32 accumulator is 128 registers a thread of a warpgroup, so a one-warpgroup
dK/dV program (hopper/dkdv's design) holds dK or dV, not both, and two of them compute S^T twice: with hopper/dq's
S, dP and dQ, eight tile products per (query, key) tile.  Here the dK/dV pass runs four (seven with hopper/dq)
and the fused pass five.  A program owns BLOCK_N = 64 keys of one (z, h_kv) and walks BLOCK_M = 64 query rows a
step, with four partitions (`gl.warp_specialize`):

    producer (1 warp):     K and V once; per step Q, dO (TMA) and L·log2(e), delta rows into a NUM_STAGES ring
    consumer w (4 warps, w = 0, 1), per step t:
        S^T_w = K Q_t[32w:+32]^T, dP^T_w = V dO_t[32w:+32]^T   (64 keys x 32 queries each: the step's S^T
                                                               split between the consumers by queries)
        P^T_w = exp2(S^T_w log2(e)/sqrt(d) - L log2(e)) masked, rounded; dS^T_w = P^T_w (dP^T_w - delta)
        P^T_w, dS^T_w into the step's shared tiles w (64 x 32 each), then wait for the other consumer's
        dV[:, 128w:+128] += sum_u P^T_u dO_t[32u:+32, 128w:+128]     (both query halves: shared tiles)
        dK[:, 128w:+128] += sum_u dS^T_u Q_t[32u:+32, 128w:+128]
        fused: dQ_t^T[128w + 64c:+64, 32u:+32] = K[:, 128w + 64c:+64]^T dS^T_u   (c, u = 0, 1: four 64 x 32
               products; transposed so that each is one wgmma whose B operand is a whole shared tile), each
               staged in float32 for the writer
    writer (1 warp, fused): each staged part reduce-added into dqa by TMA (`cp.reduce.async.bulk.tensor`)

So each consumer holds half of dK and of dV (64 registers each), its S^T and dP^T (16 each) and one dQ part (16):
five tile products per (query, key) tile and no duplicated work; the consumers meet once a step (P^T and dS^T
are needed whole by both).  dQ's float32 partial sums per 64-key block are the fused pass's cost: Nq x 256 x 4
bytes of reductions per key block a query row sees.  The transposed accumulator is turned back by
`common.dq_post_kernel`.

Shared memory: K, V 64 KB; the ring 2 x (Q + dO) 128 KB; the P^T / dS^T tiles 16 KB a stage (1 stage fused, 2
otherwise); fused, the dQ staging tiles 2 x 8 KB: 224 KB either way with the ring's L and delta rows.

dK and dV are deterministic; dQ (fused) is not bit for bit, its float32 sums arriving by TMA reductions in an
order that varies between runs (as hopper/backward's).  Causal: a program's first step is its diagonal block
(64 keys start at a multiple of 64), the only one masked besides ragged ends; keys past Nk are zero-filled by
TMA and masked in the last key block, and their dK / dV rows are not stored.  Grouped-query attention: the step
loop runs over the group's query heads in turn, so dK and dV sum over them without atomics.

Measured on an H200 (docs/flash-attention-experiments.md, Section 20): hopper/dq then the dK/dV pass take the
backward to 0.72-0.79x the one-accumulator programs'; the fused pass is 1.13-1.29x the dK/dV pass (its dQ
reductions and single staging tile per consumer cost more than hopper/dq), so the plan runs it only under
`fused_bwd=on`.  Written against Triton 3.6's Gluon API, like the other Gluon kernels; where it runs is decided
by `cs336_systems.attention.plan` (its table `RULES`: d 256's "dkdv" rule).
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
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from cs336_systems.attention.kernels.hopper import common
from cs336_systems.attention.kernels.portable.launch import direct

HEAD_DIMS = (256,)
BLOCK_N = 64  # keys per program
BLOCK_M = 64  # query rows per step, 32 for each consumer's S^T
NUM_STAGES = 2  # Q / dO ring (64 KB a stage)
PDS_STAGES = {True: 1, False: 2}  # P^T / dS^T tiles, by fused: the dQ staging tiles take the second stage's room
MAXNREG = 168  # as hopper/backward: 168 a thread over 12 warps, then 240 for each consumer, 24 for the workers
REGS = (240, 24)
_BLOCK_N = gl.constexpr(BLOCK_N)
_BLOCK_M = gl.constexpr(BLOCK_M)
_HALF = gl.constexpr(32)  # a consumer's queries of S^T
_COLS = gl.constexpr(128)  # a consumer's columns of dK, dV (and dQ)


@gluon.jit
def _program(kv_heads, group, n_q, CAUSAL: gl.constexpr):
    """(z, K/V head, first query head, first key, first query tile, query tiles per head, steps) of this
    program (grid: key blocks, Z * H_kv)."""
    start_n = gl.program_id(0) * _BLOCK_N
    zkv = gl.program_id(1)
    kv_head = zkv % kv_heads
    lo_tile, m_tiles, n_iter = common.query_steps(start_n, n_q, group, CAUSAL, _BLOCK_M)
    return zkv // kv_heads, kv_head, kv_head * group, start_n, lo_tile, m_tiles, n_iter


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready,
              empty, L, Delta, n_q, heads, kv_heads, group, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr):
    """`common.backward_producer` for this program's 64-key block."""
    zkv = gl.program_id(1)
    kv_head = zkv % kv_heads
    common.backward_producer(q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf,
                             delta_buf, ready, empty, L, Delta, n_q, heads, zkv // kv_heads, kv_head,
                             gl.program_id(0) * _BLOCK_N, kv_head * group, group, CAUSAL, NUM_STAGES, _BLOCK_M)


@gluon.jit
def _writer(dq_desc, dq_stage, dq_full, dq_empty, n_q, kv_heads, group, CAUSAL: gl.constexpr,
            FUSED: gl.constexpr):
    """Fused: per step, each consumer's four staged dQ^T parts reduce-added into dqa, in the consumers' order
    (part j of consumer w: d rows 128 w + 64 (j // 2), queries 32 (j % 2)); a staging tile is released once
    the copy has read it."""
    if FUSED:
        z, kv_head, h0, start_n, lo_tile, m_tiles, n_iter = _program(kv_heads, group, n_q, CAUSAL)
        for t in range(n_iter):
            h = h0 + t // m_tiles
            m0 = (lo_tile + t % m_tiles) * _BLOCK_M
            for j in gl.static_range(4):
                for w in gl.static_range(2):
                    mbarrier.wait(dq_full.index(w), (t * 4 + j) & 1)
                    common.reduce_add(dq_desc, [z, h, _COLS * w + 64 * (j // 2), m0 + _HALF * (j % 2)],
                                      dq_stage.index(w))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty.index(w), count=1)


@gluon.jit
def _consumer(k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, p_buf, ds_buf, pds_full,
              pds_empty, dq_stage, dq_full, dq_empty, DK, DV, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n, sm_scale, qk_scale,
              n_q, n_k, kv_heads, group, W: gl.constexpr, CAUSAL: gl.constexpr, RAGGED_KEYS: gl.constexpr,
              NUM_STAGES: gl.constexpr, PDS_STAGES: gl.constexpr, FUSED: gl.constexpr):
    """Columns 128 W .. + 128 of the key block's dK and dV, S^T and dP^T for queries 32 W .. + 32 of each
    step, and (fused) dQ^T rows 128 W .. + 128 of each step (module docstring)."""
    dtype: gl.constexpr = k_buf.dtype
    HEAD_DIM: gl.constexpr = 256
    z, kv_head, h0, start_n, lo_tile, m_tiles, n_iter = _program(kv_heads, group, n_q, CAUSAL)
    s_layout: gl.constexpr = common.mma_layout(4, _HALF)
    acc_layout: gl.constexpr = common.mma_layout(4, _COLS)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_smem = k_buf.reshape([_BLOCK_N, HEAD_DIM])
    v_smem = v_buf.reshape([_BLOCK_N, HEAD_DIM])
    full_end = n_q // _BLOCK_M - lo_tile  # relative tiles with no rows past Nq
    dk = warpgroup_mma_init(gl.zeros([_BLOCK_N, _COLS], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([_BLOCK_N, _COLS], gl.float32, layout=acc_layout))
    s_zero = gl.zeros([_BLOCK_N, _HALF], gl.float32, layout=s_layout)
    keys = start_n + gl.arange(0, _BLOCK_N, layout=key_layout)
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iter):
        stage = t % NUM_STAGES
        pb = t % PDS_STAGES
        rel = t % m_tiles
        m0 = (lo_tile + rel) * _BLOCK_M
        mbarrier.wait(ready.index(stage), (t // NUM_STAGES) & 1)
        q_s = q_buf.index(stage).reshape([_BLOCK_M, HEAD_DIM])
        do_s = do_buf.index(stage).reshape([_BLOCK_M, HEAD_DIM])
        s_tok = warpgroup_mma(k_smem, q_s.slice(W * _HALF, _HALF, 0).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        dp_tok = warpgroup_mma(v_smem, do_s.slice(W * _HALF, _HALF, 0).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        lse = lse_buf.index(stage).slice(W * _HALF, _HALF).load(col_layout)
        # S^T done, and so are the previous step's dK / dV products: its ring stage and P^T / dS^T tiles are free
        s_t, dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, dk, dv))
        if t > 0:
            mbarrier.arrive(empty.index((t - 1) % NUM_STAGES), count=1)
            mbarrier.arrive(pds_empty.index((t - 1) % PDS_STAGES), count=1)
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        need_mask = rel >= full_end
        if RAGGED_KEYS:
            need_mask = need_mask | (start_n + _BLOCK_N > n_k)
        if CAUSAL:
            need_mask = need_mask | (rel == 0)
        if need_mask:
            cols = m0 + W * _HALF + gl.arange(0, _HALF, layout=col_layout)
            visible = gl.expand_dims(cols < n_q, 0)
            if RAGGED_KEYS:
                visible = visible & gl.expand_dims(keys < n_k, 1)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1))
            p_t = gl.where(visible, p_t, 0.0)
        p_lo = p_t.to(dtype)  # rounded once: dV's operand and dS^T's factor (as hopper/backward)
        delta = delta_buf.index(stage).slice(W * _HALF, _HALF).load(col_layout)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        ds_t = (p_lo.to(gl.float32) * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        if t >= PDS_STAGES:  # both consumers are done with this stage's previous tiles
            mbarrier.wait(pds_empty.index(pb), ((t // PDS_STAGES) - 1) & 1)
        p_buf.index(2 * pb + W).store(p_lo)
        ds_buf.index(2 * pb + W).store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pds_full.index(pb), count=1)
        mbarrier.wait(pds_full.index(pb), (t // PDS_STAGES) & 1)
        p0 = p_buf.index(2 * pb)
        p1 = p_buf.index(2 * pb + 1)
        ds0 = ds_buf.index(2 * pb)
        ds1 = ds_buf.index(2 * pb + 1)
        if FUSED:  # dQ^T's parts in two pairs, each issued before a product of dV or dK that its staging overlaps
            q_zero = gl.zeros([64, _HALF], gl.float32, layout=s_layout)
            kt = k_smem.slice(W * _COLS, 64, 1).permute((1, 0))
            dq0 = warpgroup_mma(kt, ds0, q_zero, use_acc=False, is_async=True)
            dq1 = warpgroup_mma(kt, ds1, q_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma(p0, do_s.slice(0, _HALF, 0).slice(W * _COLS, _COLS, 1), dv, is_async=True)
        dv = warpgroup_mma(p1, do_s.slice(_HALF, _HALF, 0).slice(W * _COLS, _COLS, 1), dv, is_async=True)
        if FUSED:
            part = warpgroup_mma_wait(num_outstanding=3, deps=(dq0,))
            common.stage_dq(part, dq_stage, dq_full, dq_empty, t * 4, W, _HALF)
            part = warpgroup_mma_wait(num_outstanding=2, deps=(dq1,))
            common.stage_dq(part, dq_stage, dq_full, dq_empty, t * 4 + 1, W, _HALF)
            kt = k_smem.slice(W * _COLS + 64, 64, 1).permute((1, 0))
            dq2 = warpgroup_mma(kt, ds0, q_zero, use_acc=False, is_async=True)
            dq3 = warpgroup_mma(kt, ds1, q_zero, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds0, q_s.slice(0, _HALF, 0).slice(W * _COLS, _COLS, 1), dk, is_async=True)
        dk = warpgroup_mma(ds1, q_s.slice(_HALF, _HALF, 0).slice(W * _COLS, _COLS, 1), dk, is_async=True)
        if FUSED:
            part = warpgroup_mma_wait(num_outstanding=3, deps=(dq2,))
            common.stage_dq(part, dq_stage, dq_full, dq_empty, t * 4 + 2, W, _HALF)
            part = warpgroup_mma_wait(num_outstanding=2, deps=(dq3,))
            common.stage_dq(part, dq_stage, dq_full, dq_empty, t * 4 + 3, W, _HALF)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    # dK and dV from the registers: this consumer's columns, keys inside Nk
    rows = start_n + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = W * _COLS + gl.arange(0, _COLS, layout=gl.SliceLayout(0, acc_layout))
    inside = gl.expand_dims(rows < n_k, 1)
    rows64 = gl.expand_dims(rows.to(gl.int64), 1)  # 64-bit offsets: K and V may pass 2^31 elements
    z64, kv64 = z.to(gl.int64), kv_head.to(gl.int64)
    gl.store(DK + z64 * sk_z + kv64 * sk_h + rows64 * sk_n + gl.expand_dims(cols, 0), (dk * sm_scale).to(dtype),
             mask=inside)
    gl.store(DV + z64 * sv_z + kv64 * sv_h + rows64 * sv_n + gl.expand_dims(cols, 0), dv.to(dtype), mask=inside)


@gluon.jit
def flash_bwd_wide_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n, L,
                          Delta, sm_scale, qk_scale, n_q, n_k, heads, kv_heads, group, CAUSAL: gl.constexpr,
                          RAGGED_KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, PDS_STAGES: gl.constexpr,
                          FUSED: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
    """Grid (key blocks of 64, Z * H_kv); num_warps 4 (the first consumer), plus a consumer warpgroup, the
    producer warp and the writer warp as workers (module docstring)."""
    dtype: gl.constexpr = k_desc.dtype
    HEAD_DIM: gl.constexpr = 256
    k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty = common.alloc_backward(
        k_desc, q_desc, do_desc, _BLOCK_N, _BLOCK_M, HEAD_DIM, NUM_STAGES)
    # P^T and dS^T: per stage one (64 keys, 32 queries) tile per consumer (tile 2 stage + w), each a whole wgmma
    # operand
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, _HALF], dtype)
    p_buf = gl.allocate_shared_memory(dtype, [PDS_STAGES * 2, _BLOCK_N, _HALF], pds_layout)
    ds_buf = gl.allocate_shared_memory(dtype, [PDS_STAGES * 2, _BLOCK_N, _HALF], pds_layout)
    pds_full = gl.allocate_shared_memory(gl.int64, [PDS_STAGES, 1], mbarrier.MBarrierLayout())
    pds_empty = gl.allocate_shared_memory(gl.int64, [PDS_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(PDS_STAGES):
        mbarrier.init(pds_full.index(i), count=2)
        mbarrier.init(pds_empty.index(i), count=2)
    if FUSED:
        dq_stage = gl.allocate_shared_memory(gl.float32, [2, 1, 1, 64, _HALF], dq_desc.layout)
    else:  # not read
        dq_stage = gl.allocate_shared_memory(gl.float32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, p_buf, ds_buf,
                     pds_full, pds_empty, dq_stage, dq_full, dq_empty, DK, DV, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n,
                     sm_scale, qk_scale, n_q, n_k, kv_heads, group, 0, CAUSAL, RAGGED_KEYS, NUM_STAGES, PDS_STAGES,
                     FUSED)),
        (_consumer, (k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty, p_buf, ds_buf,
                     pds_full, pds_empty, dq_stage, dq_full, dq_empty, DK, DV, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n,
                     sm_scale, qk_scale, n_q, n_k, kv_heads, group, 1, CAUSAL, RAGGED_KEYS, NUM_STAGES, PDS_STAGES,
                     FUSED)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready,
                     empty, L, Delta, n_q, heads, kv_heads, group, CAUSAL, NUM_STAGES)),
        (_writer, (dq_desc, dq_stage, dq_full, dq_empty, n_q, kv_heads, group, CAUSAL, FUSED)),
    ], [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])


def accumulator_ok(n_q: int) -> bool:
    """Whether the transposed dQ accumulator (rows of Nq float32) has the 16-byte row stride TMA needs (else
    `launch` pads its rows to a multiple of 4 in an accumulator of its own)."""
    return n_q % 4 == 0


def _kernel_launch(q, k, v, do, lse, delta, dqa, acc_row, dk, dv, causal: bool, fused: bool, wrap) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    z, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[-2]
    if fused:
        box = [1, 1, 64, 32]
        dq_desc = TensorDescriptor.from_tensor(dqa.view(z, heads, d, acc_row)[..., :n_q], box,
                                               gl.NVMMASharedLayout.get_default_for(box, gl.float32))
    else:
        dq_desc = None
    wrap(flash_bwd_wide_kernel)[(triton.cdiv(n_k, BLOCK_N), z * kv_heads)](
        common.descriptor(q, BLOCK_M), common.descriptor(k, BLOCK_N), common.descriptor(v, BLOCK_N),
        common.descriptor(do, BLOCK_M), dq_desc, dk, dv, *dk.stride()[:3], *dv.stride()[:3], lse, delta,
        1.0 / math.sqrt(d), common.LOG2E / math.sqrt(d), n_q, n_k, heads, kv_heads, heads // kv_heads,
        CAUSAL=causal, RAGGED_KEYS=n_k % BLOCK_N != 0, NUM_STAGES=NUM_STAGES, PDS_STAGES=PDS_STAGES[fused],
        FUSED=fused, CONSUMER_REGS=REGS[0], WORKER_REGS=REGS[1], num_warps=4, maxnreg=MAXNREG,
    )


def _check(q, k) -> None:
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"the wide Hopper backward takes head dims {HEAD_DIMS}; got d={q.shape[-1]}")


def launch(q, k, v, o, do, lse, delta, dqa, dq, dk, dv, causal: bool, wrap=direct) -> None:
    """The fused pass: dq (q's shape, unit stride on d), dk, dv (like k, v) written in place, and delta; lse,
    delta (Z, H, Nq) contiguous float32; dqa Z * H * Nq * 256 float32 contiguous (overwritten; needs
    `accumulator_ok`).  ``wrap``: `portable.launch.direct`, or a `replay.Recorder` recording the launches."""
    _check(q, k)
    z, heads, n_q, d = q.shape
    acc_row = n_q
    if not accumulator_ok(n_q):  # TMA needs 16-byte rows: a padded accumulator of this call's own
        acc_row = -(-n_q // 4) * 4
        dqa = torch.empty(z * heads * d * acc_row, device=q.device, dtype=torch.float32)
    rows = (triton.cdiv(n_q, 64), z * heads)
    acc = (d * acc_row, 1, acc_row)  # (Z * H, 256, acc_row) contiguous, read as (Z * H, Nq, 256)
    wrap(common.dq_prep_kernel)[rows](o, do, delta, dqa, n_q, heads, *o.stride()[:3], *do.stride()[:3], *acc, D=d,
                                      D_TILE=d, BLOCK=64)
    _kernel_launch(q, k, v, do, lse, delta, dqa, acc_row, dk, dv, causal, True, wrap)
    wrap(common.dq_post_kernel)[rows](dqa, dq, n_q, heads, *dq.stride()[:3], *acc, 1.0 / math.sqrt(d), D=d, D_TILE=d,
                                      BLOCK=64)


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal: bool, wrap=direct) -> None:
    """dK and dV only (delta from hopper/dq, launched first): dk, dv written in place."""
    _check(q, k)
    _kernel_launch(q, k, v, do, lse, delta, None, 0, dk, dv, causal, False, wrap)
