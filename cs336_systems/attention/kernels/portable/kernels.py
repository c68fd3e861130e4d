"""FlashAttention-2 Triton kernels (forward, and its key-split variant with a combine kernel for few
(batch x head) slices; dQ, which computes D = rowsum(O * dO) first; dK/dV). Kernel code only.

Layout: every tensor is (Z, H, N, d) with a unit stride on d and any batch (z), head (h) and row strides,
passed as arguments (the launchers take (BH, N, d) as Z = 1); one program handles one tile of one
(batch x head) slice bh = z * H + h, addressed as z * stride_z + h * stride_h; L and D are (Z * H, Nq)
contiguous, indexed by bh.  Head dims: HEAD_DIM is d (any multiple of 8 up to 256), held in one or two register
tiles of power-of-two widths (tl.arange and tl.dot need powers of two, tl.dot a K of 16 or more): BLOCK_D
columns, and with BLOCK_D2 > 0 a second tile of columns [BLOCK_D, BLOCK_D + BLOCK_D2) beside it (d = 80 as
64 + 16: every product over d is two products summed, every (rows, d) accumulator two).  Where the tiles reach
past d (one padded tile, BLOCK_D > d, or a second tile ending past d) loads and stores are masked on d there
and the padding columns are zeros, which add nothing to Q K^T and give zero columns of O, dQ, dK, dV that are
never stored; the masks are constexpr flags, so tiles that fit d exactly carry none.  Grouped-query attention:
K and V have H / GROUP heads (GROUP query heads share one K/V head), so query head h of batch z reads K/V
head h // GROUP of batch z; the dK/dV kernel sums over the group's query heads itself.

Scores are kept in base 2: with c = log2(e) / sqrt(d), s2 = (q . k) * c, so exp(S - m) == exp2(s2 - m2)
and the kernels use the cheaper exp2.  L is stored in natural-log units (logsumexp of S = q.k/sqrt(d)), as
the autograd contract asks.

Causal masking is top-left aligned (query i sees keys j <= i).  Each kernel walks its inner loop in
two phases: tiles that need no mask (fully visible and fully in bounds) and the few that do (the
diagonal band and the ragged end), so only those pay for the index comparison.  Tiles entirely
above the diagonal are never visited.  Masked scores get a large finite negative value instead of
-inf, so a row's running max is always finite and no NaN can arise from (-inf) - (-inf).

Loads are pointer arithmetic (no tl.make_block_ptr, which triton 3.9 removed), so one source runs in the
interpreter (TRITON_INTERPRET=1) and compiled on the GPU; with TMA=1 the forward and dQ kernels take
their streamed K and V tiles outside the masked band through host-side tensor descriptors over the
(BH * Nk, d) rows (Hopper's TMA engine: one bulk copy per tile, no per-thread address math; the
interpreter emulates them), with TMA=2 the band's tiles too (BLOCK_N divides Nk).  K_DESC and V_DESC are
None when TMA=0.
"""

from __future__ import annotations

import triton
import triton.language as tl

MASKED = tl.constexpr(-1.0e6)  # after scaling; exp2(MASKED - m) == 0 in float32 for any reachable m


@triton.jit
def _load(ptrs, rows_ok, d_ok, ROWS: tl.constexpr, PAD: tl.constexpr):
    """A tile load masked on rows (ROWS) and on head-dim columns past d (PAD: the tile reaches past
    HEAD_DIM) only where needed: a mask the compiler cannot prove all-true would cost the unmasked tiles
    their vectorized loads.  ``rows_ok`` and ``d_ok`` broadcast against ``ptrs``."""
    if ROWS:
        if PAD:
            tile = tl.load(ptrs, mask=rows_ok & d_ok, other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok, other=0.0)
    else:
        if PAD:
            tile = tl.load(ptrs, mask=d_ok, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store(ptrs, value, rows_ok, d_ok, PAD: tl.constexpr):
    """A row-masked tile store that also leaves the columns past d (PAD) unwritten."""
    if PAD:
        tl.store(ptrs, value, mask=rows_ok & d_ok)
    else:
        tl.store(ptrs, value, mask=rows_ok)


@triton.jit
def _second_q_tile(q_ptrs, q_rows, offs_d, q, acc, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """The forward kernels' second head-dim tile (BLOCK_D2 > 0, a split head dim): its column offsets
    [BLOCK_D, BLOCK_D + BLOCK_D2), Q's columns there and a zero accumulator for O's; with BLOCK_D2 == 0 the
    first tile's as placeholders, never read."""
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = _load(q_ptrs + offs_d2[None, :], q_rows, offs_d2[None, :] < HEAD_DIM, True, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    else:
        offs_d2 = offs_d
        q2 = q
        acc2 = acc
    return offs_d2, q2, acc2


@triton.jit
def _fwd_tile(acc, acc2, l_i, m_i, q, q2, k_base, v_base, k_desc, v_desc, row0, offs_m, offs_n0, offs_d, offs_d2,
              stride_kn, stride_vn, start, end, n_keys, qk_scale,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Online-softmax update of (acc, acc2, l_i, m_i) over key tiles [start, end).

    TMA (0, 1, 2): 1: the unmasked tiles (always fully in bounds) come through the (BH * Nk, d) tensor
    descriptors, row row0 + start_n, and masked tiles (diagonal band, ragged end) use pointer loads with
    bounds masks; 2 (only when BLOCK_N divides Nk, so no tile crosses into the next slice's rows): every
    tile through the descriptors, the masks applied to the scores only.  A descriptor's (BLOCK_N, BLOCK_D)
    box reads zeros past column d (the TMA engine's out-of-bounds fill), as the masked pointer loads do.
    BLOCK_D2 > 0 (a split head dim; pointer loads only): K's and V's columns offs_d2 come as a second pair
    of tiles, Q K^T sums the two tiles' products and acc2 holds O's columns offs_d2.
    """
    d_col = offs_d[:, None] < HEAD_DIM
    d_row = offs_d[None, :] < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASK and TMA < 2:
            k = _load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], offs_n[None, :] < n_keys, d_col,
                      True, BLOCK_D > HEAD_DIM)
        elif TMA > 0:
            k = tl.trans(k_desc.load([row0 + start_n, 0]))  # (BLOCK_D, BLOCK_N): K^T, transposed in shared memory
        else:
            k = _load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], offs_n[None, :] < n_keys, d_col,
                      False, BLOCK_D > HEAD_DIM)  # (BLOCK_D, BLOCK_N): K^T
        qk = tl.dot(q, k, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
        if BLOCK_D2 > 0:
            k2 = _load(k_base + offs_n[None, :] * stride_kn + offs_d2[:, None], offs_n[None, :] < n_keys,
                       offs_d2[:, None] < HEAD_DIM, MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)  # (BLOCK_D2, BLOCK_N)
            qk = tl.dot(q2, k2, acc=qk, input_precision=PRECISION)
        if MASK:
            visible = offs_n[None, :] < n_keys
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(visible, qk * qk_scale, MASKED)  # base-2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # The scale is positive, so the row max can be taken before scaling; the scale and the
            # subtraction then fuse into one FMA per score (the softmax ALU work rivals the matmul at d <= 64).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK and TMA < 2:
            v = _load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n[:, None] < n_keys, d_row,
                      True, BLOCK_D > HEAD_DIM)
        elif TMA > 0:
            v = v_desc.load([row0 + start_n, 0])
        else:
            v = _load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n[:, None] < n_keys, d_row,
                      False, BLOCK_D > HEAD_DIM)
        if BLOCK_D2 > 0:
            # V's second tile is loaded before the first tile's P V product, not between the two products:
            # loaded there, Triton 3.6 on Hopper miscompiled the narrow (d 80: 16-wide) product (illegal memory
            # accesses or wrong outputs on every launch at num_stages=1; docs/flash-attention-experiments.md,
            # Section 13).
            # The dQ and dK/dV kernels load their second tiles before their products already.
            v2 = _load(v_base + offs_n[:, None] * stride_vn + offs_d2[None, :], offs_n[:, None] < n_keys,
                       offs_d2[None, :] < HEAD_DIM, MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        # P is cast to V's dtype before the second matmul (FA2): bf16/fp16 tensor-core inputs.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if BLOCK_D2 > 0:
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=PRECISION)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, O, L, K_DESC, V_DESC,
    stride_qz, stride_qh, stride_qn, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_on,
    n_queries, n_keys, heads, group, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr, LONGEST_FIRST: tl.constexpr = True,
    BLOCK_D2: tl.constexpr = 0,
):
    """Grid (cdiv(Nq, BLOCK_M), BH).  O = softmax(Q K^T / sqrt(d)) V and L = logsumexp row-wise.

    Causal: program 0 takes the *last* query tile, the one with the most keys to visit, so the heavy
    tiles start first and the light ones fill the tail of the launch (longest-first scheduling;
    LONGEST_FIRST=False keeps the natural order, for measuring the difference).
    """
    tl.static_assert(BLOCK_D2 == 0 or TMA == 0, "a split head dim takes pointer loads")
    pid_m = tl.program_id(0)
    if CAUSAL and LONGEST_FIRST:
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # the (batch z, query head h) slice, z * heads + h
    z = bh // heads
    h = bh % heads
    kv = bh // group  # its K/V slice, z * (heads // group) + h // group: the descriptors' row block
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = offs_m[:, None] < n_queries
    d_row = offs_d[None, :] < HEAD_DIM
    q_ptrs = Q + z * stride_qz + h * stride_qh + offs_m[:, None] * stride_qn
    q = _load(q_ptrs + offs_d[None, :], q_rows, d_row, True, BLOCK_D > HEAD_DIM)
    k_base = K + z * stride_kz + (h // group) * stride_kh
    v_base = V + z * stride_vz + (h // group) * stride_vh
    row0 = (kv * n_keys).to(tl.int32)  # this slice's first row in the (BH * Nk, d) descriptors

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_d2, q2, acc2 = _second_q_tile(q_ptrs, q_rows, offs_d, q, acc, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_D2)

    # Keys this query tile can see: all, or (causal) those j <= the tile's last query.
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, n_keys)
        full_end = tl.minimum(start_m, n_keys) // BLOCK_N * BLOCK_N  # every query in the tile sees these
    else:
        hi = n_keys
        full_end = n_keys // BLOCK_N * BLOCK_N
    acc, acc2, l_i, m_i = _fwd_tile(acc, acc2, l_i, m_i, q, q2, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                                    offs_d, offs_d2, stride_kn, stride_vn, 0, full_end, n_keys, qk_scale, False, CAUSAL,
                                    BLOCK_N, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_D2)
    acc, acc2, l_i, m_i = _fwd_tile(acc, acc2, l_i, m_i, q, q2, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                                    offs_d, offs_d2, stride_kn, stride_vn, full_end, hi, n_keys, qk_scale, True, CAUSAL,
                                    BLOCK_N, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_D2)

    o = acc / l_i[:, None]
    o_ptrs = O + z * stride_oz + h * stride_oh + offs_m[:, None] * stride_on
    _store(o_ptrs + offs_d[None, :], o.to(O.dtype.element_ty), q_rows, d_row, BLOCK_D > HEAD_DIM)
    if BLOCK_D2 > 0:
        _store(o_ptrs + offs_d2[None, :], (acc2 / l_i[:, None]).to(O.dtype.element_ty), q_rows,
               offs_d2[None, :] < HEAD_DIM, BLOCK_D + BLOCK_D2 > HEAD_DIM)
    # natural-log logsumexp: ln(2) * (m2 + log2(l))
    tl.store(L + bh * n_queries + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=offs_m < n_queries)


@triton.jit
def flash_fwd_split_kernel(
    Q, K, V, O_PART, L_PART, K_DESC, V_DESC,
    stride_qz, stride_qh, stride_qn, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    n_queries, n_keys, heads, group, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SPLITS: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(Nq, BLOCK_M), BH, SPLITS): the forward with each query tile's keys split in SPLITS chunks.

    For few (batch x head) slices the unsplit grid has fewer programs than the GPU has SMs and its time is
    the longest program's key loop (the last causal tile visits every key); splitting the key range
    shortens that loop SPLITS-fold and multiplies the programs.  Program (m, bh, s) takes key tiles
    [s * c, (s + 1) * c) of the tile's visible ones, c = cdiv(visible tiles, SPLITS), and writes its
    normalized partial output (float32) to O_PART[s, bh] (SPLITS, BH, Nq, d) and its base-2 logsumexp
    (-inf for an empty chunk) to L_PART[s, bh] (SPLITS, BH, Nq); `flash_fwd_combine_kernel` merges them.
    A chunk holding only keys above a row's diagonal (BLOCK_M > BLOCK_N) leaves that row with m = MASKED,
    so its masked scores count as exp2(0) = 1 and its partial is garbage, but its L is ~MASKED (-1e6):
    weight exp2(-1e6 - L) = 0 in the combine, next to the row's chunks that do hold visible keys.
    One head-dim tile (BLOCK_D, padded past d where needed): split head dims take the padded tile here
    (`launch.forward`).
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # the (batch z, query head h) slice, z * heads + h
    z = bh // heads
    h = bh % heads
    kv = bh // group  # its K/V slice, z * (heads // group) + h // group: the descriptors' row block
    split = tl.program_id(2)
    n_bh = tl.num_programs(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = offs_m[:, None] < n_queries
    d_row = offs_d[None, :] < HEAD_DIM
    q_ptrs = Q + z * stride_qz + h * stride_qh + offs_m[:, None] * stride_qn
    q = _load(q_ptrs + offs_d[None, :], q_rows, d_row, True, BLOCK_D > HEAD_DIM)
    k_base = K + z * stride_kz + (h // group) * stride_kh
    v_base = V + z * stride_vz + (h // group) * stride_vh
    row0 = (kv * n_keys).to(tl.int32)  # this slice's first row in the (BH * Nk, d) descriptors

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_d2, q2, acc2 = _second_q_tile(q_ptrs, q_rows, offs_d, q, acc, BLOCK_M, HEAD_DIM, BLOCK_D, 0)

    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, n_keys)
        full_end = tl.minimum(start_m, n_keys) // BLOCK_N * BLOCK_N
    else:
        hi = n_keys
        full_end = n_keys // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(hi, BLOCK_N), SPLITS) * BLOCK_N
    lo = tl.minimum(split * chunk, hi)
    end = tl.minimum(lo + chunk, hi)
    # [lo, end) split at full_end into unmasked tiles and tiles needing the mask (both may be empty)
    mid = tl.maximum(tl.minimum(full_end, end), lo)
    acc, acc2, l_i, m_i = _fwd_tile(acc, acc2, l_i, m_i, q, q2, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                                    offs_d, offs_d2, stride_kn, stride_vn, lo, mid, n_keys, qk_scale, False, CAUSAL,
                                    BLOCK_N, PRECISION, TMA, HEAD_DIM, BLOCK_D, 0)
    acc, acc2, l_i, m_i = _fwd_tile(acc, acc2, l_i, m_i, q, q2, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                                    offs_d, offs_d2, stride_kn, stride_vn, mid, end, n_keys, qk_scale, True, CAUSAL,
                                    BLOCK_N, PRECISION, TMA, HEAD_DIM, BLOCK_D, 0)

    seen = l_i > 0.0
    norm = tl.where(seen, l_i, 1.0)[:, None]
    o = acc / norm
    part = (split * n_bh + bh) * n_queries
    o_ptrs = O_PART + (part + offs_m[:, None]) * HEAD_DIM
    _store(o_ptrs + offs_d[None, :], o, q_rows, d_row, BLOCK_D > HEAD_DIM)
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(L_PART + part + offs_m, lse2, mask=offs_m < n_queries)


@triton.jit
def flash_fwd_combine_kernel(
    O_PART, L_PART, O, L, stride_oz, stride_oh, stride_on, n_queries, heads,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(Nq, BLOCK_M), BH): O = sum_s w_s O_s, w_s = 2^(L_s - L), L = log2 sum_s 2^L_s (then in
    natural-log units, as the unsplit kernel stores it).  Every row sees at least one key (Nk >= 1; causal
    rows see key 0), so some L_s is finite.  BLOCK_D is the padded power of two >= d (a memory-bound kernel:
    the padding costs no traffic)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n_bh = tl.num_programs(1)
    z = bh // heads
    h = bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < n_queries
    d_row = offs_d[None, :] < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(L_PART + (s * n_bh + bh) * n_queries + offs_m, mask=rows, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        part = (s * n_bh + bh) * n_queries
        w = tl.math.exp2(tl.load(L_PART + part + offs_m, mask=rows, other=float("-inf")) - m)
        o_s = _load(O_PART + (part + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], rows[:, None], d_row, True,
                    BLOCK_D > HEAD_DIM)
        acc += w[:, None] * o_s
        total += w
    total = tl.where(total > 0.0, total, 1.0)
    o = acc / total[:, None]
    _store(O + z * stride_oz + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], o.to(O.dtype.element_ty),
           rows[:, None], d_row, BLOCK_D > HEAD_DIM)
    tl.store(L + bh * n_queries + offs_m, (m + tl.math.log2(total)) * 0.6931471805599453, mask=rows)


@triton.jit
def _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, q_base, do_base, l_base, d_base, offs_n, offs_m0, offs_d, offs_d2,
               stride_qn, stride_don, start, end, n_queries, n_keys, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
               PART: tl.constexpr):
    """Accumulate dK (unscaled) and dV for one key tile over query tiles [start, end), transposed form.
    PART 0: both; 1: dV only (no dP, no delta); 2: dK only (the other accumulator is left as it came).
    BLOCK_D2 > 0: a split head dim, the columns offs_d2 in their own tiles (k2, v2; dk2, dv2)."""
    d_col = offs_d[:, None] < HEAD_DIM
    d_row = offs_d[None, :] < HEAD_DIM
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        rows = offs_m < n_queries
        qT = _load(q_base + offs_m[None, :] * stride_qn + offs_d[:, None], rows[None, :], d_col, MASK,
                   BLOCK_D > HEAD_DIM)  # (BLOCK_D, BLOCK_M)
        do = _load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], rows[:, None], d_row, MASK,
                   BLOCK_D > HEAD_DIM)  # (BLOCK_M, BLOCK_D)
        if MASK:
            lse = tl.load(l_base + offs_m, mask=rows, other=0.0) * 1.4426950408889634
        else:
            lse = tl.load(l_base + offs_m) * 1.4426950408889634
        sT = tl.dot(k, qT, input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        if BLOCK_D2 > 0:
            qT2 = _load(q_base + offs_m[None, :] * stride_qn + offs_d2[:, None], rows[None, :],
                        offs_d2[:, None] < HEAD_DIM, MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)
            do2 = _load(do_base + offs_m[:, None] * stride_don + offs_d2[None, :], rows[:, None],
                        offs_d2[None, :] < HEAD_DIM, MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)
            sT = tl.dot(k2, qT2, acc=sT, input_precision=PRECISION)
        # P^T = exp(S^T - L): (BLOCK_N, BLOCK_M), one FMA + exp2 per score (L converted to base 2 above)
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        if MASK:
            visible = (offs_m[None, :] < n_queries) & (offs_n[:, None] < n_keys)
            if CAUSAL:
                visible = visible & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(visible, pT, 0.0)
        if PART != 2:
            dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
            if BLOCK_D2 > 0:
                dv2 += tl.dot(pT.to(do2.dtype), do2, input_precision=PRECISION)
        if PART != 1:
            if MASK:
                delta = tl.load(d_base + offs_m, mask=rows, other=0.0)
            else:
                delta = tl.load(d_base + offs_m)
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
            if BLOCK_D2 > 0:
                dpT = tl.dot(v2, tl.trans(do2), acc=dpT, input_precision=PRECISION)
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PRECISION)
            if BLOCK_D2 > 0:
                dk2 += tl.dot(dsT.to(qT2.dtype), tl.trans(qT2), input_precision=PRECISION)
    return dk, dv, dk2, dv2


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, L, Dvec, DK, DV,
    stride_qz, stride_qh, stride_qn, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_don, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    n_queries, n_keys, heads, group, heads_per_split, stride_dks, stride_dvs,
    sm_scale: tl.constexpr, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr = 0, BLOCK_D2: tl.constexpr = 0,
):
    """Grid (cdiv(Nk, BLOCK_N), BH_kv * (group // heads_per_split)).  K, V tile resident; loop over the
    query heads of this K/V head's share of the group, and over their query tiles; no atomics.

    PART 0 computes and writes dK and dV; 1 only dV; 2 only dK (a launch of each is the two-pass form,
    `TileConfig.parts`: one float32 accumulator per program, for d = 256).  The arithmetic of each output is
    the same in every form, so the results are bit-equal.

    Grouped-query attention: program (n, kv * splits + s) sums dK and dV over query heads
    kv * group + s * heads_per_split ... + heads_per_split - 1 and writes the sum to DK + s * stride_dks
    (float32 partials the launcher adds up when the group is split over several programs, for
    parallelism; stride_dks = 0 and one split when it is not).  Causal: key tile 0 is seen by every
    query, so program order is already longest-first.
    """
    start_n = tl.program_id(0) * BLOCK_N
    pid = tl.program_id(1).to(tl.int64)
    splits = group // heads_per_split
    kv = pid // splits  # the K/V slice z * heads_kv + kvh
    split = pid % splits
    heads_kv = heads // group
    z = kv // heads_kv
    kvh = kv % heads_kv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols = offs_n[:, None] < n_keys
    d_row = offs_d[None, :] < HEAD_DIM
    k_ptrs = K + z * stride_kz + kvh * stride_kh + offs_n[:, None] * stride_kn
    k = _load(k_ptrs + offs_d[None, :], cols, d_row, True, BLOCK_D > HEAD_DIM)
    v_ptrs = V + z * stride_vz + kvh * stride_vh + offs_n[:, None] * stride_vn
    if PART != 1:
        v = _load(v_ptrs + offs_d[None, :], cols, d_row, True, BLOCK_D > HEAD_DIM)
    else:  # the dV pass never reads V
        v = k
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 > 0:  # a split head dim: columns [BLOCK_D, BLOCK_D + BLOCK_D2) in their own tiles
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        k2 = _load(k_ptrs + offs_d2[None, :], cols, offs_d2[None, :] < HEAD_DIM, True, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        if PART != 1:
            v2 = _load(v_ptrs + offs_d2[None, :], cols, offs_d2[None, :] < HEAD_DIM, True,
                       BLOCK_D + BLOCK_D2 > HEAD_DIM)
        else:
            v2 = k2
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
        dv2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
    else:  # placeholders, never read
        offs_d2, k2, v2, dk2, dv2 = offs_d, k, v, dk, dv

    if CAUSAL:
        # Queries before start_n see none of these keys.  Query tiles starting at or after the tile's
        # last key see all of them; only the band in between needs the causal mask.
        lo = start_n // BLOCK_M * BLOCK_M
        band_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_queries)
    else:
        lo = 0
        band_end = 0
    full_end = tl.maximum(band_end, n_queries // BLOCK_M * BLOCK_M)
    for i in range(heads_per_split):
        h = kvh * group + split * heads_per_split + i  # the query head
        bh = z * heads + h  # its (batch, head) slice, the row block of L and D
        q_base = Q + z * stride_qz + h * stride_qh
        do_base = DO + z * stride_doz + h * stride_doh
        l_base = L + bh * n_queries
        d_base = Dvec + bh * n_queries
        if CAUSAL:
            dk, dv, dk2, dv2 = _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, q_base, do_base, l_base, d_base, offs_n,
                                          offs_m0, offs_d, offs_d2, stride_qn, stride_don, lo, band_end, n_queries,
                                          n_keys, qk_scale, True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM,
                                          BLOCK_D, BLOCK_D2, PART)
        # Unmasked tiles need every key in bounds as well: a ragged key tile takes the masked path throughout.
        if start_n + BLOCK_N <= n_keys:
            dk, dv, dk2, dv2 = _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, q_base, do_base, l_base, d_base, offs_n,
                                          offs_m0, offs_d, offs_d2, stride_qn, stride_don, band_end, full_end,
                                          n_queries, n_keys, qk_scale, False, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM,
                                          BLOCK_D, BLOCK_D2, PART)
        else:
            dk, dv, dk2, dv2 = _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, q_base, do_base, l_base, d_base, offs_n,
                                          offs_m0, offs_d, offs_d2, stride_qn, stride_don, band_end, full_end,
                                          n_queries, n_keys, qk_scale, True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM,
                                          BLOCK_D, BLOCK_D2, PART)
        dk, dv, dk2, dv2 = _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, q_base, do_base, l_base, d_base, offs_n,
                                      offs_m0, offs_d, offs_d2, stride_qn, stride_don, full_end, n_queries, n_queries,
                                      n_keys, qk_scale, True, CAUSAL, BLOCK_M, PRECISION, HEAD_DIM,
                                      BLOCK_D, BLOCK_D2, PART)

    if PART != 1:
        dk_ptrs = DK + split * stride_dks + z * stride_dkz + kvh * stride_dkh + offs_n[:, None] * stride_dkn
        _store(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), cols, d_row, BLOCK_D > HEAD_DIM)
        if BLOCK_D2 > 0:
            _store(dk_ptrs + offs_d2[None, :], (dk2 * sm_scale).to(DK.dtype.element_ty), cols,
                   offs_d2[None, :] < HEAD_DIM, BLOCK_D + BLOCK_D2 > HEAD_DIM)
    if PART != 2:
        dv_ptrs = DV + split * stride_dvs + z * stride_dvz + kvh * stride_dvh + offs_n[:, None] * stride_dvn
        _store(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), cols, d_row, BLOCK_D > HEAD_DIM)
        if BLOCK_D2 > 0:
            _store(dv_ptrs + offs_d2[None, :], dv2.to(DV.dtype.element_ty), cols, offs_d2[None, :] < HEAD_DIM,
                   BLOCK_D + BLOCK_D2 > HEAD_DIM)


@triton.jit
def _dq_tile(dq, dq2, q, q2, do, do2, lse2, delta, k_base, v_base, k_desc, v_desc, row0, offs_m, offs_n0, offs_d,
             offs_d2, stride_kn, stride_vn, start, end, n_keys, qk_scale,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
             TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Accumulate dQ (unscaled) for one query tile over key tiles [start, end) (TMA and BLOCK_D2: as in
    `_fwd_tile`; dq2 holds dQ's columns offs_d2)."""
    d_col = offs_d[:, None] < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASK and TMA < 2:
            kT = _load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], offs_n[None, :] < n_keys, d_col, True,
                       BLOCK_D > HEAD_DIM)
            vT = _load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None], offs_n[None, :] < n_keys, d_col, True,
                       BLOCK_D > HEAD_DIM)
        elif TMA > 0:
            kT = tl.trans(k_desc.load([row0 + start_n, 0]))  # (BLOCK_D, BLOCK_N)
            vT = tl.trans(v_desc.load([row0 + start_n, 0]))
        else:
            kT = _load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], offs_n[None, :] < n_keys, d_col, False,
                       BLOCK_D > HEAD_DIM)  # (BLOCK_D, BLOCK_N)
            vT = _load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None], offs_n[None, :] < n_keys, d_col, False,
                       BLOCK_D > HEAD_DIM)
        s = tl.dot(q, kT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
        if BLOCK_D2 > 0:
            d2_col = offs_d2[:, None] < HEAD_DIM
            kT2 = _load(k_base + offs_n[None, :] * stride_kn + offs_d2[:, None], offs_n[None, :] < n_keys, d2_col,
                        MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)  # (BLOCK_D2, BLOCK_N)
            vT2 = _load(v_base + offs_n[None, :] * stride_vn + offs_d2[:, None], offs_n[None, :] < n_keys, d2_col,
                        MASK, BLOCK_D + BLOCK_D2 > HEAD_DIM)
            s = tl.dot(q2, kT2, acc=s, input_precision=PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASK:
            visible = offs_n[None, :] < n_keys
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        if BLOCK_D2 > 0:
            dp = tl.dot(do2, vT2, acc=dp, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PRECISION)
        if BLOCK_D2 > 0:
            dq2 += tl.dot(ds.to(kT2.dtype), tl.trans(kT2), input_precision=PRECISION)
    return dq, dq2


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, L, Dvec, DQ, O, K_DESC, V_DESC,
    stride_qz, stride_qh, stride_qn, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_don, stride_dqz, stride_dqh, stride_dqn, stride_oz, stride_oh, stride_on,
    n_queries, n_keys, heads, group, sm_scale: tl.constexpr, qk_scale: tl.constexpr,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr, LONGEST_FIRST: tl.constexpr = True,
    BLOCK_D2: tl.constexpr = 0,
):
    """Grid (cdiv(Nq, BLOCK_M), BH).  Q, dO resident; loop over key tiles; no atomics.

    Causal: longest-first like the forward (program 0 takes the last query tile).
    The backward's preprocess is this kernel's prologue: D = rowsum(O * dO) for the program's query rows
    (each row belongs to exactly one program), used here and stored to Dvec for the dK/dV kernel, which
    runs after this one.  No separate preprocess launch.
    """
    tl.static_assert(BLOCK_D2 == 0 or TMA == 0, "a split head dim takes pointer loads")
    pid_m = tl.program_id(0)
    if CAUSAL and LONGEST_FIRST:
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # the (batch z, query head h) slice, z * heads + h
    z = bh // heads
    h = bh % heads
    kv = bh // group  # its K/V slice, z * (heads // group) + h // group: the descriptors' row block
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < n_queries
    d_row = offs_d[None, :] < HEAD_DIM
    q_ptrs = Q + z * stride_qz + h * stride_qh + offs_m[:, None] * stride_qn
    q = _load(q_ptrs + offs_d[None, :], rows[:, None], d_row, True, BLOCK_D > HEAD_DIM)
    do_ptrs = DO + z * stride_doz + h * stride_doh + offs_m[:, None] * stride_don
    do = _load(do_ptrs + offs_d[None, :], rows[:, None], d_row, True, BLOCK_D > HEAD_DIM)
    lse2 = tl.load(L + bh * n_queries + offs_m, mask=rows, other=0.0) * 1.4426950408889634
    o_ptrs = O + z * stride_oz + h * stride_oh + offs_m[:, None] * stride_on
    o = _load(o_ptrs + offs_d[None, :], rows[:, None], d_row, True, BLOCK_D > HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if BLOCK_D2 > 0:  # a split head dim: columns [BLOCK_D, BLOCK_D + BLOCK_D2) in their own tiles
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_row = offs_d2[None, :] < HEAD_DIM
        q2 = _load(q_ptrs + offs_d2[None, :], rows[:, None], d2_row, True, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        do2 = _load(do_ptrs + offs_d2[None, :], rows[:, None], d2_row, True, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        o2 = _load(o_ptrs + offs_d2[None, :], rows[:, None], d2_row, True, BLOCK_D + BLOCK_D2 > HEAD_DIM)
        delta += tl.sum(o2.to(tl.float32) * do2.to(tl.float32), 1)
    tl.store(Dvec + bh * n_queries + offs_m, delta, mask=rows)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 > 0:
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    else:  # placeholders, never read
        offs_d2, q2, do2, dq2 = offs_d, q, do, dq
    k_base = K + z * stride_kz + (h // group) * stride_kh
    v_base = V + z * stride_vz + (h // group) * stride_vh
    row0 = (kv * n_keys).to(tl.int32)

    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, n_keys)
        full_end = tl.minimum(start_m, n_keys) // BLOCK_N * BLOCK_N
    else:
        hi = n_keys
        full_end = n_keys // BLOCK_N * BLOCK_N
    dq, dq2 = _dq_tile(dq, dq2, q, q2, do, do2, lse2, delta, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                       offs_d, offs_d2, stride_kn, stride_vn, 0, full_end, n_keys, qk_scale, False, CAUSAL, BLOCK_N,
                       PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_D2)
    dq, dq2 = _dq_tile(dq, dq2, q, q2, do, do2, lse2, delta, k_base, v_base, K_DESC, V_DESC, row0, offs_m, offs_n0,
                       offs_d, offs_d2, stride_kn, stride_vn, full_end, hi, n_keys, qk_scale, True, CAUSAL, BLOCK_N,
                       PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_D2)
    dq_ptrs = DQ + z * stride_dqz + h * stride_dqh + offs_m[:, None] * stride_dqn
    _store(dq_ptrs + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), rows[:, None], d_row, BLOCK_D > HEAD_DIM)
    if BLOCK_D2 > 0:
        _store(dq_ptrs + offs_d2[None, :], (dq2 * sm_scale).to(DQ.dtype.element_ty), rows[:, None],
               offs_d2[None, :] < HEAD_DIM, BLOCK_D + BLOCK_D2 > HEAD_DIM)


# The tile loops and masked tile I/O, under public names for the packed-sequence kernels (`varlen`), which run
# them on one sequence's rows as the kernels above run them on one (batch, head) slice.
load_tile, store_tile, fwd_tile, dq_tile, dkdv_tile = _load, _store, _fwd_tile, _dq_tile, _dkdv_tile
