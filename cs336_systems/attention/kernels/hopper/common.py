"""What the Hopper (sm_90) Gluon kernels share: TMA descriptors over (Z, H, N, d) views and their tile
widths, shared-memory rings and pairs with their mbarriers, wgmma accumulator layouts and products over
sliced head dims, the forward's online-softmax pieces (the plain and the warp-specialized forward both
use them), and the fused backwards' shared buffers, producer warp, query steps and dQ hand-off (hopper/backward
and hopper/backward_wide: `alloc_backward`, `backward_producer`, `query_steps`, `stage_dq`, `reduce_add`, and the
small Triton kernels before and after them, `dq_prep_kernel` and `dq_post_kernel`).

Tile widths: a head dim runs in the next power-of-two tile of at least 64 columns (`tile_dim`); 80 and 96 in
128-wide tiles whose products over d skip the zero columns (`SLICED_HEAD_DIMS`, `d_split`, `dot_nt`,
`dot_split_n`).  Descriptors are rank 4 (`descriptor`), so any strides with 16-byte alignment are read in
place and TMA's bounds do the ragged ends.

Written against Triton 3.6's Gluon API (triton.experimental: it changes between releases).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from cs336_systems.attention.kernels.portable.launch import sm_count

LOG2E = 1.4426950408889634


@builtin
def reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared tile ``src`` into the descriptor's box at ``coord`` (Triton 3.6's Gluon
    exposes the instruction only through its builder): the fused backwards' dQ accumulation."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


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

@triton.jit
def _row_block(n_q, heads, D: tl.constexpr, D_TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The program's (z * H + h as int64, z, h), its BLOCK query rows and D columns (in a register tile of
    D_TILE, the power of two at or above D), and the mask of rows inside Nq and columns inside D ((BLOCK,
    D_TILE)): grid (row blocks, Z * H)."""
    zh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D_TILE)
    return zh.to(tl.int64), zh // heads, zh % heads, rows, cols, (rows[:, None] < n_q) & (cols[None, :] < D)

@triton.jit
def dq_prep_kernel(O, DO, Delta, DQA, n_q, heads, so_z, so_h, so_n, sdo_z, sdo_h, sdo_n, acc_zh, acc_n, acc_d,
                   D: tl.constexpr, D_TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The fused backwards' first launch: delta = rowsum(O * dO) for BLOCK rows of one (z, h) (O, dO in their
    own strides), and those rows of the float32 dQ accumulator zeroed (element (zh, n, c) at zh * acc_zh +
    n * acc_n + c * acc_d: hopper/backward's (Z * H, Nq, d) or hopper/backward_wide's transposed one)."""
    zh, z, h, rows, cols, m = _row_block(n_q, heads, D, D_TILE, BLOCK)
    o = tl.load(O + z * so_z + h * so_h + rows[:, None] * so_n + cols[None, :], mask=m, other=0.0)
    do = tl.load(DO + z * sdo_z + h * sdo_h + rows[:, None] * sdo_n + cols[None, :], mask=m, other=0.0)
    tl.store(Delta + zh * n_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < n_q)
    tl.store(DQA + zh * acc_zh + rows[:, None] * acc_n + cols[None, :] * acc_d, tl.zeros(o.shape, tl.float32),
             mask=m)

@triton.jit
def dq_post_kernel(DQA, DQ, n_q, heads, sq_z, sq_h, sq_n, acc_zh, acc_n, acc_d, scale, D: tl.constexpr,
                   D_TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The fused backwards' last launch: dQ = accumulator · scale in dQ's dtype and strides, BLOCK rows of one
    (z, h) (the accumulator's strides as in `dq_prep_kernel`)."""
    zh, z, h, rows, cols, m = _row_block(n_q, heads, D, D_TILE, BLOCK)
    x = tl.load(DQA + zh * acc_zh + rows[:, None] * acc_n + cols[None, :] * acc_d, mask=m, other=0.0)
    tl.store(DQ + z * sq_z + h * sq_h + rows[:, None] * sq_n + cols[None, :], (x * scale).to(DQ.dtype.element_ty),
             mask=m)

@gluon.jit
def alloc_backward(k_desc, q_desc, do_desc, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                   NUM_STAGES: gl.constexpr):
    """The fused backwards' shared memory for `backward_producer`: K and V of a key block (BLOCK_N rows) and
    their barrier, then a NUM_STAGES ring of Q and dO (BLOCK_M rows), L·log2(e) and delta rows, with a `ready`
    barrier (two arrivals) and an `empty` one (one arrival per consumer) per stage, initialized; the caller
    fences after its own barriers.  Returns (k, v, kv_bar, q, do, lse, delta, ready, empty)."""
    dtype: gl.constexpr = k_desc.dtype
    k_buf = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    q_buf = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_buf = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_buf = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_smem)
    delta_buf = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_smem)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=2)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer
    return k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready, empty

@gluon.jit
def stage_dq(part, dq_stage, dq_full, dq_empty, j, W: gl.constexpr, COLS: gl.constexpr):
    """The fused backwards' hand-off of a finished dQ part (float32, 64 x COLS) to the writer warp: into
    consumer W's staging tile once the writer has read part j - 1 from it (`dq_empty`), then `dq_full`."""
    if j > 0:
        mbarrier.wait(dq_empty.index(W), (j - 1) & 1)
    dq_stage.index(W).reshape([64, COLS]).store(part)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(W), count=1)

@gluon.jit
def query_steps(start_n, n_q, group, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """The query steps of a backward program over the key block at start_n, for `group` query heads in turn:
    (first query tile, query tiles per head, steps); causal programs skip the tiles before their keys."""
    if CAUSAL:
        lo_tile = start_n // BLOCK_M
    else:
        lo_tile = 0
    m_tiles = gl.maximum(gl.cdiv(n_q, BLOCK_M) - lo_tile, 1)  # at least 1: a divisor
    n_iter = gl.maximum(gl.cdiv(n_q, BLOCK_M) - lo_tile, 0) * group
    return lo_tile, m_tiles, n_iter

@gluon.jit
def backward_producer(q_desc, k_desc, v_desc, do_desc, k_buf, v_buf, kv_bar, q_buf, do_buf, lse_buf, delta_buf, ready,
                      empty, L, Delta, n_q, heads, z, kv_head, start_n, h0, group, CAUSAL: gl.constexpr,
                      NUM_STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
    """The producer warp of the fused backwards (hopper/backward, hopper/backward_wide): K and V of the key
    block at start_n once (kv_bar); then per step (`query_steps` over `group` query heads from h0), Q and dO
    (TMA) and L·log2(e), delta (loads and shared stores) into the ring stage the step's turn gives, once both
    consumers released it (`empty`).  `ready` takes two arrivals: the TMA bytes' expect and the stores'."""
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [z, kv_head, start_n, 0], kv_bar, k_buf)
    tma.async_copy_global_to_shared(v_desc, [z, kv_head, start_n, 0], kv_bar, v_buf)
    lo_tile, m_tiles, n_iter = query_steps(start_n, n_q, group, CAUSAL, BLOCK_M)
    for t in range(n_iter):
        stage = t % NUM_STAGES
        if t >= NUM_STAGES:
            mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) - 1) & 1)
        h = h0 + t // m_tiles
        m0 = (lo_tile + t % m_tiles) * BLOCK_M
        mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [z, h, m0, 0], ready.index(stage), q_buf.index(stage))
        tma.async_copy_global_to_shared(do_desc, [z, h, m0, 0], ready.index(stage), do_buf.index(stage))
        rows = m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
        base = (z * heads + h) * n_q
        lse = gl.load(L + base + rows, mask=rows < n_q, other=0.0)
        lse_buf.index(stage).store(lse * 1.4426950408889634)
        delta = gl.load(Delta + base + rows, mask=rows < n_q, other=0.0)
        delta_buf.index(stage).store(delta)
        gl.thread_barrier()
        mbarrier.arrive(ready.index(stage), count=1)

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
