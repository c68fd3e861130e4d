"""FlashAttention-2 in plain PyTorch tiles: a tiled online-softmax forward and a recomputing backward.

Shapes: q (..., Nq, d), k and v (..., Nk, d) -> o (..., Nq, d); leading dims are flattened to one
batch dim B internally.  Inputs may be float32, bfloat16 or float16, whose arithmetic is float32, or
float64, computed in float64 throughout (a reference: its backward runs the block eagerly, not compiled);
the outputs (o, and dq, dk, dv in backward) come back in the input dtype.  The saved L is float32, or
float64 for float64 inputs.  ``is_causal`` must be a bool.  Double backward (``create_graph=True``) raises a
RuntimeError: the recomputing backward's gradients carry no graph, so second derivatives would silently
lose their terms through attention.

Forward (Algorithm 1 of the FlashAttention-2 paper), for each query tile Q_i (Q_TILE rows):

    m = -inf, l = 0, acc = 0                              # running row max, row sum, unnormalised O_i
    for each key tile K_j, V_j (K_TILE rows):
        S = Q_i K_jᵀ / √d                                 # (B, Q_TILE, K_TILE)
        m_new = max(m, rowmax(S));  P = exp(S - m_new)
        l   = exp(m - m_new) · l   + rowsum(P)
        acc = exp(m - m_new) · acc + P V_j
        m = m_new
    O_i = acc / l;  L_i = m + log(l)                      # L: logsumexp of the scaled scores per row

Only (q, k, v, o, L) are saved; the (Nq, Nk) probability matrix never exists in memory at once.

Backward recomputes P from L instead of storing it:

    D = rowsum(O ∘ dO);  P = exp(S - L);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP - D)
    dQ = dS K / √d;  dK = dSᵀ Q / √d

It is tiled over keys only (BACKWARD_K_TILE rows of K and V at a time against all queries, or in causal
mode against the queries from the block's first key on), which bounds the recomputed S to
(B, Nq, BACKWARD_K_TILE) floats; each key block is one call of the top-level `_flash_backward_block`,
compiled with `torch.compile` on first use.

Causal masking is aligned at position 0 (query i sees keys j <= i); masked scores get the reference's
-1e6 (`naive.MASK_VALUE`).  Every row sees key 0, so no row is ever fully masked, and key tiles entirely
above the diagonal are skipped (their probabilities would be exp(-1e6 - m) = 0 anyway).
"""

from __future__ import annotations

import contextlib
import math

import torch

from cs336_systems.attention.checks import check_is_causal, check_qkv
from cs336_systems.attention.naive import MASK_VALUE
from cs336_systems.nvtx import nvtx_range

# Forward tile sizes (query rows x key rows per step; read at call time, so tests can shrink them).
# The Python tile loop is launch-bound on a GPU, so its time scales with the number of tiles: on an
# H200 (Nq = Nk = 4096, d = 64, bf16, non-causal) a forward took 512 ms with 64x64 tiles, 130 ms with
# 128x128 and 37 ms with 256x256.  128x128 (a 64 KiB fp32 score tile per batch element) keeps the
# algorithm visibly tiled at modest lengths while costing a quarter of 64x64.
Q_TILE = 128
K_TILE = 128
# Backward key-block size.  The queries are not tiled there, so this alone bounds the recomputed scores
# to (B, Nq, BACKWARD_K_TILE); the backward ran in ~10 ms in the setting above whatever the tiles.
BACKWARD_K_TILE = 128


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other input dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flatten(t: torch.Tensor, batch: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., N, d) -> (B, N, d) in ``dtype`` (a no-op copy-wise for contiguous input already in it)."""
    return t.reshape(batch, t.shape[-2], t.shape[-1]).to(dtype)


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, d), k and v (B, Nk, d), all float32 (or all float64) -> o (B, Nq, d), L (B, Nq), both in
    the inputs' dtype."""
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    q = q * (1.0 / math.sqrt(d))  # scale once here rather than every score tile
    o = torch.empty_like(q)
    lse = torch.empty(batch, n_queries, dtype=q.dtype, device=q.device)
    if n_keys == 0:
        # Softmax over no keys: the reference gives zeros (an empty matmul); logsumexp of nothing is -inf.
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    for q_start in range(0, n_queries, Q_TILE):
        q_end = min(q_start + Q_TILE, n_queries)
        q_tile = q[:, q_start:q_end]  # (B, bq, d)
        m = torch.full((batch, q_end - q_start), -math.inf, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_tile)
        # Causal: the tile's last query (q_end - 1) sees keys < q_end, so later keys are masked for
        # every row of the tile and their tiles are skipped.
        k_stop = min(n_keys, q_end) if is_causal else n_keys
        for k_start in range(0, k_stop, K_TILE):
            k_end = min(k_start + K_TILE, k_stop)
            scores = q_tile @ k[:, k_start:k_end].transpose(1, 2)  # (B, bq, bk)
            if is_causal and k_end - 1 > q_start:  # the tile reaches above the diagonal
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                cols = torch.arange(k_start, k_end, device=q.device)[None, :]
                scores = scores.masked_fill(rows < cols, MASK_VALUE)
            # The first key tile holds key 0, which every row sees, so m_new is finite from then on and
            # exp(m - m_new) is 0 (not NaN) for the initial m = -inf.
            m_new = torch.maximum(m, scores.amax(dim=-1))
            p = torch.exp(scores - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v[:, k_start:k_end]
            m = m_new
        # l >= 1 here: the row's maximum contributes exp(0) = 1.
        o[:, q_start:q_end] = acc / l[..., None]
        lse[:, q_start:q_end] = m + torch.log(l)
    return o, lse


def _flash_backward_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    visible_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one key block, with P recomputed from the saved logsumexp.

    q (B, M, d) already scaled by 1/√d, k and v (B, n, d), do (B, M, d), lse and delta (B, M); all
    float32.  Key column c is visible to query row r iff c <= r + visible_offset (a 0-d integer tensor).
    Returns (dS K, dk, dv) with shapes (B, M, d), (B, n, d), (B, n, d): the caller scales the first by
    1/√d to get this block's share of dQ; dk needs no extra scale, since q is pre-scaled.
    """
    scores = q @ k.transpose(1, 2)  # (B, M, n)
    rows = torch.arange(q.shape[1], device=q.device)[:, None]
    cols = torch.arange(k.shape[1], device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows + visible_offset, MASK_VALUE)  # exp(-1e6 - L) = 0 below
    p = torch.exp(scores - lse[..., None])
    dv = p.transpose(1, 2) @ do
    dp = do @ v.transpose(1, 2)
    ds = p * (dp - delta[..., None])
    return ds @ k, ds.transpose(1, 2) @ q, dv


_backward_block_compiled = None


def _compiled_backward_block():
    """`torch.compile` of `_flash_backward_block`, built on first use so importing stays cheap.

    dynamic=True compiles shape-generic code at once.  Only sizes 0 and 1 still specialise (B, M or n
    equal to 1), so there are at most 8 graphs, within Dynamo's default recompile limit of 8 (past it
    the block would silently run eagerly).  That is also why the mask offset is a tensor: a Python bool
    or int would be guarded on and double the graphs.
    """
    global _backward_block_compiled
    if _backward_block_compiled is None:
        _backward_block_compiled = torch.compile(_flash_backward_block, dynamic=True)
    return _backward_block_compiled


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """Contiguous (dO may arrive expanded, stride 0) and not a view of a larger tensor: Dynamo guards on
    a view's base (its sizes, strides, equalities among them), so passing slices recompiles the block
    for nearly every new problem shape."""
    return t.contiguous().detach()


def _flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, o, do (B, Nq, d), k, v (B, Nk, d), lse (B, Nq); all float32 -> dq (B, Nq, d), dk, dv (B, Nk, d).
    All float64 works too, with the block run eagerly (the compiled block stays float32-only, within its
    recompile budget)."""
    n_queries, d = q.shape[1], q.shape[2]
    n_keys = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    block = _flash_backward_block if q.dtype == torch.float64 else _compiled_backward_block()
    q = q * scale
    delta = (o * do).sum(dim=-1)  # D = rowsum(O ∘ dO), (B, Nq)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    # Causal: each block gets the queries from its first key position on (earlier ones see none of its
    # keys), so row r and column c share an offset and the mask is c <= r.  Otherwise nothing is masked.
    offset = torch.full((), 0 if is_causal else n_keys, dtype=torch.int64, device=q.device)
    for k_start in range(0, n_keys, BACKWARD_K_TILE):
        k_end = min(k_start + BACKWARD_K_TILE, n_keys)
        q_start = k_start if is_causal else 0
        if q_start >= n_queries:  # causal with Nk > Nq: no query sees the remaining keys (zero grads)
            break
        rows = slice(q_start, n_queries)
        keys = slice(k_start, k_end)
        inputs = (q[:, rows], k[:, keys], v[:, keys], do[:, rows], lse[:, rows], delta[:, rows])
        dq_part, dk[:, keys], dv[:, keys] = block(*map(_standalone, inputs), offset)
        dq[:, rows] += dq_part
    return dq * scale, dk, dv


def _no_autocast(device_type: str):
    """Autocast off for this device type (a no-op where autocast does not exist, e.g. meta tensors)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 with tiled PyTorch forward and `torch.compile`d recomputing backward.

    `FlashAttentionPytorch.apply(q, k, v, is_causal=False)`; saves exactly (q, k, v, o, L) for backward,
    with L (q.shape[:-1], float32; float64 for float64 inputs) the logsumexp of the scaled scores per query row.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_qkv(q, k, v)
        check_is_causal(is_causal)
        batch = math.prod(q.shape[:-2])
        compute = _compute_dtype(q.dtype)
        # float32 (float64) throughout, under autocast too: the backward recomputes P from L, so a forward
        # whose score matmuls autocast ran in bf16 would hand it an L that does not match its own scores
        with nvtx_range("flash-pytorch forward"), _no_autocast(q.device.type):
            o, lse = _flash_forward(_flatten(q, batch, compute), _flatten(k, batch, compute),
                                    _flatten(v, batch, compute), is_causal)
        o = o.reshape(q.shape).to(q.dtype)
        lse = lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, do)):
            # create_graph=True: the recomputed gradients below carry no graph, so a second derivative
            # through attention would silently lose its terms
            raise RuntimeError(
                "flash-pytorch does not support double backward: its backward ran with create_graph=True and "
                "its gradients would not be differentiable; use the 'naive' attention for higher-order gradients")
        batch = math.prod(q.shape[:-2])
        compute = _compute_dtype(q.dtype)
        with nvtx_range("flash-pytorch backward"), _no_autocast(q.device.type):
            dq, dk, dv = _flash_backward(
                _flatten(q, batch, compute),
                _flatten(k, batch, compute),
                _flatten(v, batch, compute),
                _flatten(o, batch, compute),
                lse.reshape(batch, q.shape[-2]),
                _flatten(do, batch, compute),
                ctx.is_causal,
            )
        return (
            dq.reshape(q.shape).to(q.dtype),
            dk.reshape(k.shape).to(k.dtype),
            dv.reshape(v.shape).to(v.dtype),
            None,
        )


def flash_attention_pytorch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    """The registry-signature wrapper around `FlashAttentionPytorch.apply`."""
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
