"""Variable-length (packed) FlashAttention-2 in Triton: the tokens of every sequence concatenated.

    forward(q, k, v, cu_q, cu_k, max_q, max_k, causal) -> (o, lse)
    backward(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal) -> (dq, dk, dv)
    q, o, dq, do: (total_q, H, d)   k, v, dk, dv: (total_k, H_kv, d), H_kv dividing H   lse: (H, total_q) float32
    cu_q, cu_k: (B + 1,) int32, increasing from 0: sequence b's queries are rows cu_q[b] .. cu_q[b + 1] - 1,
    its keys rows cu_k[b] .. cu_k[b + 1] - 1; max_q, max_k: at least the longest sequence's lengths

Each program reads its sequence's offsets and runs the dense kernels' tile loops (`kernels.fwd_tile`,
`dq_tile`, `dkdv_tile`, unchanged) on that sequence's rows, as a dense program runs them on its (batch,
head) slice: grid (cdiv(max_q, BLOCK_M), B * H) for the forward and dQ, (cdiv(max_k, BLOCK_N), B * H_kv)
for dK/dV; a program past its sequence's end returns at once, so no work crosses a sequence boundary and
none is spent on padding.  Causal masking is aligned at each sequence's first token (query i of a sequence
sees its keys j <= i), the dense path's convention.  Pointer loads only (a tensor descriptor would span
every sequence), tiles by kernel and a row's bytes (`tiles`), no key splits: the packed-documents
benchmark is what tunes this.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cs336_systems.attention.kernels.portable.kernels import (
    MASKED,
    dkdv_tile,
    dq_tile,
    fwd_tile,
    load_tile,
    store_tile,
)
from cs336_systems.attention.kernels.portable.launch import precision

LOG2E = 1.4426950408889634
ROW_BYTES_FULL_TILES = 256  # 16-bit d <= 128, float32 d <= 64: 64 x 64 tiles, Triton's default pipelining
ROW_BYTES_NARROW = 128  # 16-bit d <= 64, float32 d <= 32: dK/dV takes 128-key tiles (`tiles`)


KERNELS = ("fwd", "dq", "dkdv")


def tiles(dtype: torch.dtype, head_dim: int, kernel: str = "fwd") -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for the varlen ``kernel`` (one of KERNELS).  Shared memory grows with
    a tile row's bytes (element size x padded head dim) times the pipelined K/V (or Q/dO) stages: 64 x 64
    tiles at three stages need about 256 KB once a row is 512 bytes (float32 at d 128, 16-bit at d 256), past
    the 227 KB an H100 program may take; 32 x 32 tiles at two stages (one past 512 bytes) stay under 100 KB."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    row = torch.empty((), dtype=dtype).element_size() * _block_d(head_dim)
    if kernel == "dkdv" and row <= ROW_BYTES_NARROW:
        # 128 keys a program, 32 queries a step: on an H200 at d 64 in bf16 (64 long-tailed documents of 16k
        # and 64k tokens, causal and not) the backward took 0.63-0.83x its time with 64 x 64 tiles, the best of
        # ten tiles at three of the four sizes and within 9% at the fourth (docs/flash-attention.md, Packed
        # sequences); its dK and dV accumulators, 128 x d float32 each, fit 4 warps' registers up to d 64
        return 32, 128, 4, 3
    if row <= ROW_BYTES_FULL_TILES:
        return 64, 64, 4, 3
    return 32, 32, 4, 2 if row <= 2 * ROW_BYTES_FULL_TILES else 1


@triton.jit
def _sequence(CU, b):
    """(first row, length) of sequence b in the offsets CU."""
    start = tl.load(CU + b)
    return start.to(tl.int64), (tl.load(CU + b + 1) - start).to(tl.int32)


@triton.jit
def _query_program(CU_Q, CU_K, heads, BLOCK_M: tl.constexpr):
    """A program of the grid (query tiles, B * H): (h, its sequence's first query row and count, first key
    row and count, its tile's first query, the tile's query offsets, which of them are in the sequence)."""
    bh = tl.program_id(1)
    q_start, n_queries = _sequence(CU_Q, bh // heads)
    k_start, n_keys = _sequence(CU_K, bh // heads)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    return bh % heads, q_start, n_queries, k_start, n_keys, start_m, offs_m, offs_m < n_queries


@triton.jit
def _key_range(start_m, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(hi, full_end): the keys a query tile starting at start_m visits (causal: up to its last query) and,
    of them, the whole key tiles every one of its queries sees (no mask)."""
    if CAUSAL:
        return tl.minimum(start_m + BLOCK_M, n_keys), tl.minimum(start_m, n_keys) // BLOCK_N * BLOCK_N
    return n_keys, n_keys // BLOCK_N * BLOCK_N


@triton.jit
def _query_tile(X, start, stride_t, stride_h, h, offs_m, rows, offs_d, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Rows offs_m of head h of the packed (tokens, heads, d) tensor X from token ``start`` on, (BLOCK_M,
    BLOCK_D), zeros past the sequence's rows and past d."""
    ptrs = X + start * stride_t + h * stride_h + offs_m[:, None] * stride_t + offs_d[None, :]
    return load_tile(ptrs, rows[:, None], offs_d[None, :] < HEAD_DIM, True, BLOCK_D > HEAD_DIM)


@triton.jit
def varlen_fwd_kernel(
    Q, K, V, O, L, CU_Q, CU_K, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, total_q, heads, group, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(max_q, BLOCK_M), B * H): O and L of one query tile of one sequence and head."""
    h, q_start, n_queries, k_start, n_keys, start_m, offs_m, rows = _query_program(CU_Q, CU_K, heads, BLOCK_M)
    if start_m >= n_queries:
        return
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _query_tile(Q, q_start, stride_qt, stride_qh, h, offs_m, rows, offs_d, HEAD_DIM, BLOCK_D)
    k_base = K + k_start * stride_kt + (h // group) * stride_kh
    v_base = V + k_start * stride_vt + (h // group) * stride_vh
    state = (tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
             tl.full([BLOCK_M], MASKED, dtype=tl.float32))  # O's accumulator, l, m
    hi, full_end = _key_range(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    acc, _, l_i, m_i = fwd_tile(state[0], state[0], state[1], state[2], q, q, k_base, v_base, K, V, 0, offs_m,
                                offs_n0, offs_d, offs_d, stride_kt, stride_vt, 0, full_end, n_keys, qk_scale, False,
                                CAUSAL, BLOCK_N, PRECISION, 0, HEAD_DIM, BLOCK_D, 0)
    acc, _, l_i, m_i = fwd_tile(acc, acc, l_i, m_i, q, q, k_base, v_base, K, V, 0, offs_m, offs_n0, offs_d, offs_d,
                                stride_kt, stride_vt, full_end, hi, n_keys, qk_scale, True, CAUSAL, BLOCK_N, PRECISION,
                                0, HEAD_DIM, BLOCK_D, 0)
    store_tile(O + q_start * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
               (acc / l_i[:, None]).to(O.dtype.element_ty), rows[:, None], offs_d[None, :] < HEAD_DIM,
               BLOCK_D > HEAD_DIM)
    tl.store(L + h * total_q + q_start + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
             mask=offs_m < n_queries)


@triton.jit
def varlen_dq_kernel(
    Q, K, V, O, DO, L, Dvec, DQ, CU_Q, CU_K, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, total_q, heads, group,
    sm_scale: tl.constexpr, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(max_q, BLOCK_M), B * H): D = rowsum(O * dO) of one query tile (stored for dK/dV, which
    runs after this kernel) and its dQ."""
    h, q_start, n_queries, k_start, n_keys, start_m, offs_m, rows = _query_program(CU_Q, CU_K, heads, BLOCK_M)
    if start_m >= n_queries:
        return
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _query_tile(Q, q_start, stride_qt, stride_qh, h, offs_m, rows, offs_d, HEAD_DIM, BLOCK_D)
    do = _query_tile(DO, q_start, stride_dot, stride_doh, h, offs_m, rows, offs_d, HEAD_DIM, BLOCK_D)
    o = _query_tile(O, q_start, stride_ot, stride_oh, h, offs_m, rows, offs_d, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_vec = h * total_q + q_start + offs_m  # this tile's rows of L and D, (H, total_q)
    tl.store(Dvec + row_vec, delta, mask=rows)
    lse2 = tl.load(L + row_vec, mask=rows, other=0.0) * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + k_start * stride_kt + (h // group) * stride_kh
    v_base = V + k_start * stride_vt + (h // group) * stride_vh
    hi, full_end = _key_range(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    dq, _ = dq_tile(dq, dq, q, q, do, do, lse2, delta, k_base, v_base, K, V, 0, offs_m, offs_n0, offs_d, offs_d,
                    stride_kt, stride_vt, 0, full_end, n_keys, qk_scale, False, CAUSAL, BLOCK_N, PRECISION, 0,
                    HEAD_DIM, BLOCK_D, 0)
    dq, _ = dq_tile(dq, dq, q, q, do, do, lse2, delta, k_base, v_base, K, V, 0, offs_m, offs_n0, offs_d, offs_d,
                    stride_kt, stride_vt, full_end, hi, n_keys, qk_scale, True, CAUSAL, BLOCK_N, PRECISION, 0,
                    HEAD_DIM, BLOCK_D, 0)
    store_tile(DQ + q_start * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
               (dq * sm_scale).to(DQ.dtype.element_ty), rows[:, None], offs_d[None, :] < HEAD_DIM, BLOCK_D > HEAD_DIM)


@triton.jit
def varlen_dkdv_kernel(
    Q, K, V, DO, L, Dvec, DK, DV, CU_Q, CU_K, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, total_q, heads, group,
    sm_scale: tl.constexpr, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(max_k, BLOCK_N), B * H_kv): dK and dV of one key tile of one sequence and K/V head, summed
    over the query heads of its group (no atomics)."""
    pid = tl.program_id(1)
    heads_kv = heads // group
    b, kvh = pid // heads_kv, pid % heads_kv
    q_start, n_queries = _sequence(CU_Q, b)
    k_start, n_keys = _sequence(CU_K, b)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= n_keys:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols = offs_n[:, None] < n_keys
    d_row = offs_d[None, :] < HEAD_DIM
    pad = BLOCK_D > HEAD_DIM
    k = load_tile(K + k_start * stride_kt + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :], cols,
                  d_row, True, pad)
    v = load_tile(V + k_start * stride_vt + kvh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :], cols,
                  d_row, True, pad)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if CAUSAL:  # queries before start_n see none of these keys; the band up to the tile's last key is masked
        lo = start_n // BLOCK_M * BLOCK_M
        band_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_queries)
    else:
        lo = 0
        band_end = 0
    full_end = tl.maximum(band_end, n_queries // BLOCK_M * BLOCK_M)
    ragged = start_n + BLOCK_N > n_keys  # a ragged key tile takes the masked path throughout
    for i in range(group):
        h = kvh * group + i
        q_base = Q + q_start * stride_qt + h * stride_qh
        do_base = DO + q_start * stride_dot + h * stride_doh
        l_base = L + h * total_q + q_start
        d_base = Dvec + h * total_q + q_start
        if CAUSAL:
            dk, dv, _, _ = dkdv_tile(dk, dv, dk, dv, k, v, k, v, q_base, do_base, l_base, d_base, offs_n, offs_m0,
                                     offs_d, offs_d, stride_qt, stride_dot, lo, band_end, n_queries, n_keys, qk_scale,
                                     True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM, BLOCK_D, 0, 0)
        if ragged:
            dk, dv, _, _ = dkdv_tile(dk, dv, dk, dv, k, v, k, v, q_base, do_base, l_base, d_base, offs_n, offs_m0,
                                     offs_d, offs_d, stride_qt, stride_dot, band_end, full_end, n_queries, n_keys,
                                     qk_scale, True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM, BLOCK_D, 0, 0)
        else:
            dk, dv, _, _ = dkdv_tile(dk, dv, dk, dv, k, v, k, v, q_base, do_base, l_base, d_base, offs_n, offs_m0,
                                     offs_d, offs_d, stride_qt, stride_dot, band_end, full_end, n_queries, n_keys,
                                     qk_scale, False, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM, BLOCK_D, 0, 0)
        dk, dv, _, _ = dkdv_tile(dk, dv, dk, dv, k, v, k, v, q_base, do_base, l_base, d_base, offs_n, offs_m0,
                                 offs_d, offs_d, stride_qt, stride_dot, full_end, n_queries, n_queries, n_keys,
                                 qk_scale, True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM, BLOCK_D, 0, 0)
    store_tile(DK + k_start * stride_dkt + kvh * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
               (dk * sm_scale).to(DK.dtype.element_ty), cols, d_row, pad)
    store_tile(DV + k_start * stride_dvt + kvh * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
               dv.to(DV.dtype.element_ty), cols, d_row, pad)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
    """(o like q, lse (H, total_q) float32); shapes in the module docstring."""
    total_q, heads, d = q.shape
    group = heads // k.shape[1]
    batch = cu_q.shape[0] - 1
    o = torch.empty_like(q)
    lse = torch.empty((heads, total_q), device=q.device, dtype=torch.float32)
    block_m, block_n, warps, stages = tiles(q.dtype, d, "fwd")
    if batch and max_q:
        varlen_fwd_kernel[(triton.cdiv(max_q, block_m), batch * heads)](
            q, k, v, o, lse, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), total_q, heads, group, LOG2E / math.sqrt(d),
            CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision(q.dtype),
            BLOCK_D=_block_d(d), num_warps=warps, num_stages=stages)
    return o, lse


def backward(q, k, v, o, lse, do, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
    """(dq like q, dk like k, dv like v); dO ``do`` like q."""
    total_q, heads, d = q.shape
    group = heads // k.shape[1]
    batch = cu_q.shape[0] - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    dots, block_d = precision(q.dtype), _block_d(d)
    block_m, block_n, warps, stages = tiles(q.dtype, d, "dq")
    if batch and max_q:
        varlen_dq_kernel[(triton.cdiv(max_q, block_m), batch * heads)](
            q, k, v, o, do, lse, delta, dq, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
            total_q, heads, group, 1.0 / math.sqrt(d), LOG2E / math.sqrt(d),
            CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dots, BLOCK_D=block_d,
            num_warps=warps, num_stages=stages)
    block_m, block_n, warps, stages = tiles(q.dtype, d, "dkdv")
    if batch and max_k:
        varlen_dkdv_kernel[(triton.cdiv(max_k, block_n), batch * k.shape[1])](
            q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
            dv.stride(1), total_q, heads, group, 1.0 / math.sqrt(d), LOG2E / math.sqrt(d),
            CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dots, BLOCK_D=block_d,
            num_warps=warps, num_stages=stages)
    return dq, dk, dv
