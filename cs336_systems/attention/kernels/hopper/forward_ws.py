"""Warp-specialized FlashAttention forward for Hopper (sm_90) in Gluon, at head dims 64, 80, 96, 128 and 256: a TMA
producer warp and two consumer warpgroups that run independently of each other.

    forward(q, k, v, o, lse, causal)   q, o: (Z, H, Nq, d)   k, v: (Z, H_kv, Nk, d)   lse: (Z, H, Nq) float32

`hopper.forward`'s kernel runs its two warpgroups (64 query rows each) as one 8-warp program: the compiled
code puts a CTA-wide barrier before every TMA issue and around the ring's waits, which locks the two
warpgroups into the same step, so neither's softmax runs under the other's products.  Here the program is
split with `gl.warp_specialize` into three partitions over one shared-memory plan:

    producer (1 warp):            Q's two 64-row halves, then K_j into K's ring stage j % K_STAGES and V_j into
                                  V's ring stage j % V_STAGES, each once both consumers have released the tile
                                  that stage held (`k_empty`, `v_empty`, count 2)
    consumer w (4 warps, w 0, 1): rows start_m + 64 w .. + 64, per key tile j, as hopper.forward's warpgroup:
                                  S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued asynchronously, K_j released once
                                  S_j is done, the softmax of S_j under P_{j-1} V_{j-1}, then V_{j-1} released

Each partition synchronizes only its own warps, so the two consumers drift apart and one's exponentials
overlap the other's tensor-core work (what FlashAttention-3's ping-pong schedules explicitly).  Registers are
rebalanced per partition: the launch's 168 a thread over 12 warps (the producer's warpgroup has 3 idle warps),
then 240 for each consumer warpgroup and 24 for the producer's (`REGS`).  At d 256 K and V have rings of their
own: K_j is free as soon as both consumers' S_j is done, a step before V_j, so the producer runs further ahead
on K, the tile each step waits for first; at d <= 128 one ring holds both, released after P_j V_j (`tiles`).
Shared memory: Q 2 x 64 rows and the rings' tiles of BLOCK_N keys: 224 KB at d 128 (128-key tiles, three
stages of K + V), 192 KB at d 256 (64-key tiles, two stages of K and two of V; there O alone is 128 registers a
thread).  d 80 and 96 run
in d 128's tiles (`common.tile_dim`: TMA zero-fills the columns past d and drops them on the store), with
S = Q K^T over d in two slices (`common.d_split`: 64 + 16 or 32 columns, wgmma skipping the zeros); P V keeps
the whole tile (its output columns past d are zeros that are never stored).

The arithmetic per row is hopper.forward's (same tiles, same order of products and softmax steps), so at d 64
and 128 O and L equal that kernel's bit for bit (GPU test; at d 256 both are checked against float64).  That
holds because BLOCK_N equals the 128-row block: each consumer's unmasked tiles are then the one-program
kernel's (with 64-key tiles the second consumer would skip the mask on a tile that kernel masks, a result as
correct but not bit-equal).  At d 80 / 96
hopper.forward takes 64-key tiles, so there the two agree to rounding (both checked against float64).
Causal programs run longest first; both consumers walk the key tiles of the whole 128-row block (the producer
loads them once), each masking with its own rows, so a consumer may see a tile whose keys are all after its
rows: its scores are masked to -1e6 and add zeros.

Written against Triton 3.6's Gluon API, like the other Gluon kernels.  Where the Gluon forward runs is decided by
`cs336_systems.attention.plan` (its table `RULES`), whose "fwd-ws" rules take this kernel instead of
hopper.forward's (at d 64 and 128 always, at d 80 / 96 from 2048 keys, at d 256 from 2048 keys and a 128-row
program per SM).
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

from cs336_systems.attention.kernels.hopper import common
from cs336_systems.attention.kernels.portable.launch import direct

HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_M = 128  # query rows per program: two consumer warpgroups of ROWS
ROWS = 64
# (BLOCK_N keys per tile, K ring stages, V ring stages; V_STAGES 0: one joint ring, K_j and V_j in stage
# j % K_STAGES, landing on one barrier and released together after P_j V_j).  d <= 128: the joint ring; the
# separate rings measured 0-3% slower there (docs/flash-attention-experiments.md, Section 21); with two stages the
# producer waits for both consumers before a tile can land, which serializes them again, and 64-key tiles
# measured slower too (Section 14).
TILES = (128, 3, 0)
# d 256: a (64, 256) float32 O is 128 registers a thread; 64-key tiles, K and V in separate rings of two stages
# (Q 64 KB, K 64, V 64: 192 KB): 0.79x the joint ring's 32-key tiles in four stages (which had measured 8-22%
# faster than the joint ring's 64-key tiles in two), K in three stages no faster; ptxas spills nothing in any of
# them at 240 registers (docs/flash-attention-experiments.md, Sections 20 and 21)
TILES_256 = (64, 2, 2)

# Registers a thread: the launch's budget (65536 over 12 warps, a multiple of 8), then each consumer
# warpgroup's and the producer's after the rebalancing (240 + 240 + 24 <= 3 x 168).
MAXNREG = 168
REGS = (240, 24)


def tiles(width: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, K stages, V stages; 0: V in K's ring) for a tile width (`common.tile_dim`)."""
    return TILES if width <= 128 else TILES_256


@gluon.jit
def _ring(desc, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """STAGES shared-memory boxes of (1, 1, BLOCK_N, HEAD_DIM) and their `ready` (count 1, the TMA load) and
    `empty` (count 2, one arrival per consumer warpgroup) barriers, initialized."""
    buf = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return buf, ready, empty


@gluon.jit
def _load_tile(desc, coord_z, coord_h, row, buf, ready, empty, j, STAGES: gl.constexpr):
    """Tile j into stage j % STAGES, once both consumers released the tile j - STAGES it held."""
    stage = j % STAGES
    if j >= STAGES:
        mbarrier.wait(empty.index(stage), ((j // STAGES) - 1) & 1)
    mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [coord_z, coord_h, row, 0], ready.index(stage), buf.index(stage))


@gluon.jit
def _tile(buf, ready, j, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Tile j's (BLOCK_N, HEAD_DIM) view, once its load landed, and its stage."""
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    return buf.index(stage).reshape([BLOCK_N, HEAD_DIM]), stage


@gluon.jit
def _v_tile(v_buf, v_ready, v_empty, k_empty, j, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """V_j's view once it landed, its stage and the barriers that free it: V's ring, or with one ring
    (V_STAGES 0) K's stage, whose barrier the caller already waited on for K_j."""
    if V_STAGES == 0:
        return v_buf.index(j % K_STAGES).reshape([BLOCK_N, HEAD_DIM]), j % K_STAGES, k_empty
    else:
        view, stage = _tile(v_buf, v_ready, j, BLOCK_N, HEAD_DIM, V_STAGES)
        return view, stage, v_empty


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_buf, q_bar, k_buf, k_ready, k_empty, v_buf, v_ready, v_empty, n_k, heads,
              group, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """TMA loads: Q's two halves once (q_bar), then every key tile of the block, K_j then V_j, each into its own
    ring."""
    bh, z, h, kv_head, start_m = common.query_tile(heads, group, 128, CAUSAL)
    n_tiles, full = common.key_tiles(start_m, n_k, 128, BLOCK_N, CAUSAL)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [z, h, start_m, 0], q_bar, q_buf.index(0))
    tma.async_copy_global_to_shared(q_desc, [z, h, start_m + 64, 0], q_bar, q_buf.index(1))
    for j in range(n_tiles):
        if V_STAGES == 0:  # one ring: K_j and V_j land on K's barrier, free once both consumers' P_j V_j is done
            stage = j % K_STAGES
            if j >= K_STAGES:
                mbarrier.wait(k_empty.index(stage), ((j // K_STAGES) - 1) & 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [z, kv_head, j * BLOCK_N, 0], k_ready.index(stage),
                                            k_buf.index(stage))
            tma.async_copy_global_to_shared(v_desc, [z, kv_head, j * BLOCK_N, 0], k_ready.index(stage),
                                            v_buf.index(stage))
        else:
            _load_tile(k_desc, z, kv_head, j * BLOCK_N, k_buf, k_ready, k_empty, j, K_STAGES)
            _load_tile(v_desc, z, kv_head, j * BLOCK_N, v_buf, v_ready, v_empty, j, V_STAGES)


@gluon.jit
def _consumer(o_desc, q_buf, q_bar, k_buf, k_ready, k_empty, v_buf, v_ready, v_empty, L, qk_scale, n_q, n_k, heads,
              group, W: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, D_SPLIT: gl.constexpr):
    """Rows start_m + 64 W .. + 64: hopper.forward's warpgroup loop on the producer's rings, then O through
    its half of Q's buffer and a TMA store, and L."""
    dtype: gl.constexpr = o_desc.dtype
    bh, z, h, kv_head, start_m = common.query_tile(heads, group, 128, CAUSAL)
    row0 = start_m + W * 64
    n_tiles, full_block = common.key_tiles(start_m, n_k, 128, BLOCK_N, CAUSAL)  # the tiles the producer loads
    full = common.key_tiles(row0, n_k, 64, BLOCK_N, CAUSAL)[1]  # of those, the tiles this warpgroup's rows see all of
    s_layout: gl.constexpr = common.mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = common.mma_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_smem = q_buf.index(W).reshape([64, HEAD_DIM])

    # -1e6 as the starting max: key 0 is visible to every row and tile 0 comes first (hopper.forward)
    m_i = gl.full([64], -1.0e6, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    k0, k_stage = _tile(k_buf, k_ready, 0, BLOCK_N, HEAD_DIM, K_STAGES)
    s_tok = common.dot_nt(q_smem, k0, s_zero, D_SPLIT)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, q_smem, k0))[0]
    if V_STAGES > 0:
        mbarrier.arrive(k_empty.index(k_stage), count=1)
    if full > 0:
        p, alpha, m_i, l_i = common.softmax_tile(s, m_i, l_i, 0, row0, qk_scale, n_k, False, CAUSAL, 64, BLOCK_N,
                                               s_layout)
    else:
        p, alpha, m_i, l_i = common.softmax_tile(s, m_i, l_i, 0, row0, qk_scale, n_k, True, CAUSAL, 64, BLOCK_N,
                                               s_layout)
    for j in range(1, n_tiles):
        kj, k_stage = _tile(k_buf, k_ready, j, BLOCK_N, HEAD_DIM, K_STAGES)
        s_tok = common.dot_nt(q_smem, kj, s_zero, D_SPLIT)
        v_prev, v_stage, v_free = _v_tile(v_buf, v_ready, v_empty, k_empty, j - 1, BLOCK_N, HEAD_DIM, K_STAGES,
                                          V_STAGES)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_prev, common.rescaled(acc, alpha), is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, kj))[0]
        if V_STAGES > 0:
            mbarrier.arrive(k_empty.index(k_stage), count=1)  # S_j done: K_j consumed by this warpgroup
        if j < full:
            p, alpha, m_i, l_i = common.softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, qk_scale, n_k, False, CAUSAL,
                                                   64, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = common.softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, qk_scale, n_k, True, CAUSAL,
                                                   64, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_prev))[0]
        mbarrier.arrive(v_free.index(v_stage), count=1)  # V_{j-1} (and with one ring K_{j-1}) consumed

    v_last, v_stage, v_free = _v_tile(v_buf, v_ready, v_empty, k_empty, n_tiles - 1, BLOCK_N, HEAD_DIM, K_STAGES,
                                      V_STAGES)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    o_tok = warpgroup_mma(p_op, v_last, common.rescaled(acc, alpha), is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_last))[0]
    # this warpgroup's half of Q's buffer stages O for the TMA store (rows past Nq are dropped)
    q_smem.store(common.normalized(acc, l_i).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [z, h, row0, 0], q_buf.index(W))
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    gl.store(L + bh * n_q + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < n_q)
    tma.store_wait(0)


@gluon.jit
def flash_fwd_hopper_ws_kernel(q_desc, k_desc, v_desc, o_desc, L, qk_scale, n_q, n_k, heads, group,
                               CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                               K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, D_SPLIT: gl.constexpr):
    """Grid (query tiles of 128 rows, Z * H); num_warps 4 (the first consumer), plus a consumer warpgroup and
    the producer warp as workers."""
    dtype: gl.constexpr = q_desc.dtype
    q_buf = gl.allocate_shared_memory(dtype, [2, 1, 1, 64, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_buf, k_ready, k_empty = _ring(k_desc, BLOCK_N, HEAD_DIM, K_STAGES)
    # one ring (V_STAGES 0): V's boxes beside K's stages, its barriers unused
    v_buf, v_ready, v_empty = _ring(v_desc, BLOCK_N, HEAD_DIM, V_STAGES if V_STAGES > 0 else K_STAGES)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (o_desc, q_buf, q_bar, k_buf, k_ready, k_empty, v_buf, v_ready, v_empty, L, qk_scale, n_q, n_k,
                     heads, group, 0, CAUSAL, HEAD_DIM, BLOCK_N, K_STAGES, V_STAGES, D_SPLIT)),
        (_consumer, (o_desc, q_buf, q_bar, k_buf, k_ready, k_empty, v_buf, v_ready, v_empty, L, qk_scale, n_q, n_k,
                     heads, group, 1, CAUSAL, HEAD_DIM, BLOCK_N, K_STAGES, V_STAGES, D_SPLIT)),
        (_producer, (q_desc, k_desc, v_desc, q_buf, q_bar, k_buf, k_ready, k_empty, v_buf, v_ready, v_empty, n_k,
                     heads, group, CAUSAL, BLOCK_N, K_STAGES, V_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            causal: bool, wrap=direct) -> None:
    """o (like q) and lse ((Z, H, Nq) contiguous float32) written in place; q, k, v, o (Z, H, N, d), d in
    HEAD_DIMS, with TMA strides (`plan.tma_layout_ok`), k and v with H_kv heads dividing H.  ``wrap``:
    `portable.launch.direct`, or a `replay.Recorder` recording the launch."""
    n_q, d = q.shape[-2:]
    if d not in HEAD_DIMS:
        raise ValueError(f"the warp-specialized forward takes head dims {HEAD_DIMS}; got d={d}")
    heads, n_k = q.shape[1], k.shape[-2]
    block_n, k_stages, v_stages = tiles(common.tile_dim(d))
    grid = (triton.cdiv(n_q, BLOCK_M), q.shape[0] * heads)
    wrap(flash_fwd_hopper_ws_kernel)[grid](
        common.descriptor(q, ROWS), common.descriptor(k, block_n), common.descriptor(v, block_n),
        common.descriptor(o, ROWS),
        lse, common.LOG2E / math.sqrt(d), n_q, n_k, heads, heads // k.shape[1],
        CAUSAL=causal, HEAD_DIM=common.tile_dim(d), BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=v_stages,
        CONSUMER_REGS=REGS[0],
        PRODUCER_REGS=REGS[1], num_warps=4, maxnreg=MAXNREG, D_SPLIT=common.d_split(d),
    )
