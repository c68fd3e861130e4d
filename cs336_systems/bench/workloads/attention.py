"""What the attention benchmarks time: one call of a registered attention implementation.

Shapes: q, k, v and the output gradient dO are (B, N, d), or (B, H, N, d) when ``heads`` is given
(Nq = Nk = N).  Inputs are standard-normal (never zeros: zeros make softmax uniform and hide bugs),
drawn from a seeded generator in float32 and then cast, so every implementation and the reference see
the same values.

Modes (`MODES`):
  "forward"           o = attn(q, k, v) under torch.no_grad(), inputs without requires_grad: no graph
                      and no saved activations, the inference cost;
  "backward"          the backward pass alone: the step's ``before_each`` runs the forward (requires_grad
                      inputs) outside the timed region, the round times torch.autograd.grad(o, (q, k, v),
                      dO); ``before_each`` also records torch.cuda.memory_allocated() right after the
                      forward ("memory in use before backward", handout 1.2.1);
  "forward-backward"  forward and backward in one round.
Gradients come from torch.autograd.grad, not .backward(): nothing accumulates into .grad between rounds.

Before any timing, `attention_step` checks the implementation in the case's mode (`check_accuracy`) on
the calls the rounds repeat: the first call, a second one (flash-triton's replayed launches, a compiled
graph's cached path) and, for timing "graph", one replay of the call captured in a CUDA graph, its outputs
filled with NaN before the replay.  Each call's output, and dQ, dK, dV for the backward modes, is held to
FlashAttention's rule (an implementation may be at most twice as wrong as PyTorch's own naive attention in
the same dtype, plus a small floor), applied to each row against the magnitude of the rows around it:

    ref: float64 attention of the same input values;  y: PyTorch's naive attention in the inputs' dtype
    rows r: the query rows of O and dQ, the key rows of dK and dV, in every batch*head slice
        scale_r = max(max |ref[r', :]| over the rows r' within ROW_WINDOW of r, ROW_SCALE_FLOOR * M)
                                                      M = max |ref| over the tensor
        err_r   = max_j |x[r, j] - ref[r, j]|         the implementation's error on the row
        naive   = max_r max_j |y[r, j] - ref[r, j]| / scale_r
                                                      naive's worst error relative to its rows' magnitude
    pass iff, on every row,
        err_r <= (NAIVE_FACTOR * naive + FLOOR[dtype]) * scale_r + ABS_FLOOR[dtype] * M     (NAIVE_FACTOR = 2)

Rows are held to their local magnitude, so a wrong tail cannot hide: in causal attention row i's output is
~1/sqrt(i) of the first rows', and a metric normalised by the largest value of the whole tensor (the
earlier max|x - ref| / max|ref| <= 5e-2 for bf16) passed a kernel that zeroed every row past 4096 at
N = 16384.  Here a zeroed row is off by about its neighbours' magnitude and a row copied from its neighbour
by more, where a correct bf16 kernel is off by a few 1e-3 of it and naive's worst row by ~1e-2; only
rows below ~ABS_FLOOR of the tensor's largest (1e-4 in bf16: the last keys' dK and dV in causal attention)
are judged by the absolute floor alone.  The scale is the rows' neighbourhood (ROW_WINDOW = 8 rows each
side), not the row alone: a gradient row can be much smaller than the terms it sums (dQ of a query that
sees a few keys, where dP - D nearly cancels), and there a fused kernel, whose D = rowsum(O * dO) uses
the rounded O, is off by a larger share of the row than the naive computation on the same row, which can
be exact by luck.  For the same reason the naive baseline is its worst row over the tensor, not the same
row.  A row the implementation computes as NaN or inf always fails, and so does a row of exact zeros
where the reference's is above 1e-6 of the tensor's largest (`zeroed_rows`: a dropped row that the floors
would let through when it is small, as the last key's dK and dV rows of a causal case are).  On top of the per-row rule, the
earlier whole-tensor bound max|x - ref| / max|ref| <= TOLERANCE[dtype] still applies (it never fails a
correct implementation and bounds the case where the naive computation itself is far off).  A wrong
implementation raises `AccuracyError` (an AssertionError: the case fails, nothing is timed).

Recorded in the case's extra_info:
  ``accuracy_ratio``      the worst row's err_r / its allowance (the right-hand side above), over the
                          compared tensors: the check passes at <= 1, a correct kernel sits well below it
                          (the naive implementation itself at <= 0.5);
  ``accuracy_error``      max|x - ref| / max|ref| of the worst tensor (the whole-tensor relative error, as
                          reports show it; before the per-row rule this was the only check, against a
                          float32 reference);
  ``accuracy_tolerance``  TOLERANCE[dtype], the whole-tensor bound on ``accuracy_error``;
  ``accuracy_calls``      the calls checked ("first+repeat", "+graph-replay" for timing "graph"); the ratio
                          and error above are the worst over them.

The references (`reference`, in float64, and `naive_same_dtype`) are written here, independently of the
registry: matmul, mask, softmax, matmul, over blocks of query rows so that the scores of one block stay
under `REFERENCE_BLOCK_BYTES` (one block while they fit: then it is exactly the naive computation).  dK
and dV are summed over the blocks (for the naive pass: its per-block gradients, rounded to the dtype, are
summed in float32 and rounded once, so at many blocks its error is a little larger than one naive call's,
which only loosens the bound).  Memory stays bounded at N = 65536, and it needs no fused kernel, whose
shape and dtype rules (the pinned SDPA backends take only 4-D inputs) would otherwise decide which cases
can be checked.  An implementation that has no kernel for the inputs ("No available kernel") raises
`Unsupported`, which the perf suite reports as a skip.

``compile=True`` wraps the registered function in torch.compile(fullgraph=True, dynamic=False): one static
graph per case, and a graph break is an error rather than a silent slowdown.  Dynamo's caches are
reset when a step is built so cases never share (and exhaust) a recompile budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cs336_systems import attention
from cs336_systems.attention.plan import FlashOptions
from cs336_systems.bench import flops, harness

MODES = ("forward", "backward", "forward-backward")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The whole-tensor bound on max|x - ref| / max|ref| per input dtype (the check's only rule before the
# per-row one; kept as a backstop).  fp32: ~10^4 float32 ulps of headroom for sums reordered over N up to
# 65536, yet an implementation that silently rounds through bf16 (~4e-3) fails.  bf16 / fp16: the inputs, the
# probabilities and dO @ V^T are rounded to 8 / 11 significant bits inside the implementations; a few units
# of that rounding on the largest element.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 1e-2}

# FlashAttention's rule, per row (module docstring):
#   err_r <= (NAIVE_FACTOR * naive + FLOOR) * s_r + ABS_FLOOR * M.
# FLOOR, relative to the row, matters only where the naive computation is nearly exact on every row (its
# worst row is ~1e-2 of itself for bf16 and ~1e-3 for fp16 on random inputs, ~1e-6 for fp32): a few units of
# the output's rounding (half an ulp: 2e-3, 5e-4, 6e-8 of a row's largest value).  ABS_FLOOR, relative to
# the tensor's largest value, covers rows whose reference is ~0, where a fused kernel's error is rounding
# noise of the tensor's scale (~3e-7 of it in fp32 at d = 128 when a query sees one key): fp32's 1e-5 is
# 30x that, and a zeroed row is still caught unless it is below ~1e-5 of the tensor's largest row.
NAIVE_FACTOR = 2.0
FLOOR = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}
ABS_FLOOR = {"fp32": 1e-5, "bf16": 1e-4, "fp16": 5e-5}
ROW_WINDOW = 8  # a row's scale is the largest |ref| of the rows within this many rows of it (same slice)
ROW_SCALE_FLOOR = 1e-3  # ... and at least this fraction of the tensor's largest |ref|
# A zeroed row: every entry of x's row exactly 0 where the reference row's largest |value| is above
# ZERO_ROW_FLOOR of the tensor's largest and above TINY (where fp16 still has subnormals).  The floors above
# let such a row through when it is small next to the tensor (the last key's dK and dV rows of a causal
# case are ~1e-4 of the tensor's largest); a correct kernel rounds a row, it never returns a clean zero row
# for a reference that large (a float64 reference of an exactly-zero row, such as dQ with one key, is
# ~1e-16 of the tensor).
ZERO_ROW_FLOOR = 1e-6
TINY = {"fp32": 1e-30, "bf16": 1e-30, "fp16": 1e-6}
REFERENCE_DTYPE = torch.float64

# Scores of one block of query rows in a reference pass; a block lives as ~4 such tensors (scores,
# probabilities and their gradients), so a pass needs ~4 GiB beyond its inputs at most.
REFERENCE_BLOCK_BYTES = 2**30


class AccuracyError(AssertionError):
    """The implementation's result breaks the accuracy rule (module docstring) on some row or tensor."""


class Unsupported(Exception):
    """The implementation has no kernel for these inputs (e.g. SDPA's FlashAttention-2 and cuDNN
    backends take no float32): a property of the kernel, reported as a skip, not a failure."""


def qkv_shape(batch_size: int, heads: int | None, seq_len: int, head_dim: int) -> tuple[int, ...]:
    """(B, N, d) without heads, (B, H, N, d) with."""
    if heads is None:
        return (batch_size, seq_len, head_dim)
    return (batch_size, heads, seq_len, head_dim)


def kv_shape(batch_size: int, heads: int | None, kv_heads: int | None, seq_len: int, head_dim: int) -> tuple[int, ...]:
    """K and V's shape: q's, or (B, Hkv, N, d) for grouped-query attention (``kv_heads`` dividing ``heads``)."""
    if kv_heads is None:
        return qkv_shape(batch_size, heads, seq_len, head_dim)
    if heads is None or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads (grouped-query attention); got heads={heads}, kv_heads={kv_heads}")
    return (batch_size, kv_heads, seq_len, head_dim)


def case_flops(case: dict) -> float:
    """Model FLOPs of one step of an attention case (`flops.attention_flops`; causal halves them)."""
    batch_heads = case["batch_size"] * (case.get("heads") or 1)
    n = case["seq_len"]
    return flops.attention_flops(batch_heads, n, n, case["head_dim"], causal=case["causal"], mode=case["mode"])


def step_arguments(case: dict) -> dict:
    """The `attention_step` keyword arguments named by a benchmarks.json attention case."""
    return dict(
        impl=case["impl"], batch_size=case["batch_size"], heads=case.get("heads"), kv_heads=case.get("kv_heads"),
        seq_len=case["seq_len"], head_dim=case["head_dim"], dtype=case["dtype"], causal=case["causal"],
        mode=case["mode"], compile=case.get("compile", False), flash_options=case.get("flash_options", ""),
        timing=case.get("timing", "host"),
    )


def attention_function(impl: str, *, compile: bool = False, flash_options: str = "") -> Callable[..., torch.Tensor]:
    """The registered ``fn(q, k, v, is_causal)`` of ``impl``, optionally under torch.compile(fullgraph=True);
    ``flash_options`` (`FlashOptions.text`): flash-triton's explicit kernel choices (other implementations
    take none: ValueError)."""
    registered = attention.get(impl).fn
    if not flash_options:
        fn = registered
    elif impl != "flash-triton":
        raise ValueError(f"flash_options apply to impl 'flash-triton' only; got impl {impl!r} with "
                         f"flash_options {flash_options!r}")
    else:
        from cs336_systems.attention.flash_triton import flash_attention  # (imports Triton: only when asked)

        text = FlashOptions.parse(flash_options).text()  # a bad string fails here, naming itself

        def fn(q, k, v, is_causal=False):  # the options string is a constant of the compiled graph
            return flash_attention(q, k, v, is_causal, text)
    if compile:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    return fn


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def random_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, requires_grad: bool, seed: int = 0,
    kv: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v and dO of ``shape`` (k and v of shape ``kv`` when given: grouped-query attention): standard
    normal, drawn in float32 from a seeded generator, then cast."""
    generator = torch.Generator(device).manual_seed(seed)
    q, k, v, grad_out = (
        torch.randn(s, device=device, generator=generator).to(dtype) for s in (shape, kv or shape, kv or shape, shape)
    )
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad_out


def _blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None, *, causal: bool,
    dtype: torch.dtype, mask_value: float,
) -> list[torch.Tensor]:
    """[o] or [o, dQ, dK, dV] of matmul, mask, softmax, matmul computed in ``dtype``, over blocks of query rows.

    Shapes as the inputs, (..., N, d); results in ``dtype``.  The causal mask is offset by each block's first
    row; masked scores get ``mask_value``.  dK and dV are summed over the blocks in float64 or float32 (the
    wider of ``dtype`` and float32) and rounded to ``dtype`` once.
    """
    backward = grad_out is not None
    kv_lead, group = k.shape[:-2], 1
    if q.shape[:-2] != kv_lead:  # grouped-query attention: each K/V head serves `group` query heads
        group = q.shape[-3] // k.shape[-3]
        k, v = (t.detach().repeat_interleave(group, dim=-3) for t in (k, v))
    lead, n_queries, n_keys, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    qf, kf, vf = (t.detach().to(dtype).reshape(-1, t.shape[-2], d) for t in (q, k, v))  # (BH, N, d)
    kf.requires_grad_(backward)
    vf.requires_grad_(backward)
    do = grad_out.to(dtype).reshape(-1, n_queries, d) if backward else None
    element = torch.finfo(dtype).bits // 8
    rows = max(1, min(n_queries, REFERENCE_BLOCK_BYTES // max(1, qf.shape[0] * n_keys * element)))
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty_like(qf)
    dq = torch.empty_like(qf) if backward else None
    dk = torch.zeros_like(kf, dtype=accumulate) if backward else None
    dv = torch.zeros_like(vf, dtype=accumulate) if backward else None
    keys = torch.arange(n_keys, device=q.device)
    scale = 1.0 / math.sqrt(d)
    with torch.set_grad_enabled(backward):
        for start in range(0, n_queries, rows):
            stop = min(start + rows, n_queries)
            q_block = qf[:, start:stop].detach().requires_grad_(backward)
            # Causal: rows < stop see only keys < stop; the rest of K and V gets no gradient from them.
            seen = min(stop, n_keys) if causal else n_keys
            scores = (q_block @ kf[:, :seen].transpose(-2, -1)) * scale  # (BH, rows, seen)
            if causal:
                allowed = torch.arange(start, stop, device=q.device)[:, None] >= keys[None, :seen]
                scores = scores.masked_fill(~allowed, mask_value)  # key 0 is always allowed: no empty row
            o_block = torch.softmax(scores, dim=-1) @ vf[:, :seen]  # (BH, rows, d)
            out[:, start:stop] = o_block.detach()
            if backward:
                g_q, g_k, g_v = torch.autograd.grad(o_block, (q_block, kf, vf), do[:, start:stop])
                dq[:, start:stop] = g_q
                dk += g_k
                dv += g_v
            del scores, o_block
    if not backward:
        return [out.reshape(*lead, -1, d)]
    # dK, dV of the repeated heads summed over each group (in the accumulation dtype), then rounded once
    dk, dv = (t.reshape(*kv_lead, group, n_keys, d).sum(-3) for t in (dk, dv))
    return [out.reshape(*lead, -1, d), dq.reshape(*lead, -1, d), dk.to(dtype), dv.to(dtype)]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None, *, causal: bool,
    dtype: torch.dtype = REFERENCE_DTYPE,
) -> list[torch.Tensor]:
    """[o] or, when ``grad_out`` is given, [o, dQ, dK, dV]: attention of the same input values in ``dtype``
    (float64 by default: the accuracy check's reference), with -inf for masked scores.

    Shapes as the inputs, (..., N, d); computed over (B*H, rows, Nk) blocks of query rows (see the
    module docstring), the causal mask offset by each block's first row.
    """
    return _blocked_attention(q, k, v, grad_out, causal=causal, dtype=dtype, mask_value=-math.inf)


def naive_same_dtype(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None, *, causal: bool
) -> list[torch.Tensor]:
    """What PyTorch's naive attention (`cs336_systems.attention.naive`: scores scaled by 1/sqrt(d), masked,
    softmax, matmul, all in the inputs' dtype) computes on these inputs: the accuracy rule's baseline.  Over
    blocks of query rows as `reference` (module docstring)."""
    mask = max(-1e6, torch.finfo(q.dtype).min)  # the naive implementation's mask, clamped to the dtype
    return _blocked_attention(q, k, v, grad_out, causal=causal, dtype=q.dtype, mask_value=mask)


def relative_error(x: torch.Tensor, ref: torch.Tensor, fallback: float = 1e-30) -> float:
    """max|x - ref| / max|ref| (in ref's precision), with ``fallback`` as max|ref| when ref is all zero; inf
    if x has a NaN."""
    diff = (x.to(ref.dtype) - ref).abs().max()
    if torch.isnan(diff):
        return math.inf
    return float(diff) / (float(ref.abs().max()) or fallback)


def row_errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """max_j |x[r, j] - ref[r, j]| per row r of the (..., N, d) tensors, flattened to (rows,), in ref's
    dtype; inf where x is NaN or infinite."""
    diff = (x.to(ref.dtype) - ref).abs().reshape(-1, ref.shape[-1]).amax(dim=-1)
    return torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)


def zeroed_rows(x: torch.Tensor, ref: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per row of the (..., N, d) tensors, flattened to (rows,): whether x's row is all zeros where the
    reference row is not (`ZERO_ROW_FLOOR`, `TINY`): a dropped row of any size."""
    d = ref.shape[-1]
    ref_max = ref.abs().reshape(-1, d).amax(dim=-1)
    x_zero = (x.reshape(-1, d) == 0).all(dim=-1)
    top = float(ref_max.max()) if ref_max.numel() else 0.0
    return x_zero & (ref_max > max(ZERO_ROW_FLOOR * top, TINY[dtype]))


def row_scales(ref: torch.Tensor, fallback: float = 1.0) -> tuple[torch.Tensor, float]:
    """(scale_r per row (rows,), M): the largest |ref| of the rows within ROW_WINDOW of each row of the
    (..., N, d) reference (within its batch*head slice), at least ROW_SCALE_FLOOR * M, with M the tensor's
    largest |ref| (``fallback`` when the whole tensor is zero)."""
    n_rows, d = ref.shape[-2], ref.shape[-1]
    row_max = ref.abs().reshape(-1, n_rows, d).amax(dim=-1)  # (slices, N)
    top = float(row_max.max()) or fallback
    window = torch.nn.functional.max_pool1d(row_max[:, None], 2 * ROW_WINDOW + 1, stride=1, padding=ROW_WINDOW)
    return window.reshape(-1).clamp_min(ROW_SCALE_FLOOR * top), top


def row_allowance(naive: torch.Tensor, ref: torch.Tensor, dtype: str,
                  fallback: float = 1.0) -> tuple[torch.Tensor, float]:
    """(allowance per row (rows,), naive's worst relative row error) of the per-row rule (module docstring):
    (NAIVE_FACTOR * naive + FLOOR[dtype]) * scale_r + ABS_FLOOR[dtype] * M, in ref's dtype.  A non-finite
    naive row (the naive computation overflowed) counts as 0, leaving the floors."""
    scale, top = row_scales(ref, fallback)
    naive_rel = row_errors(naive, ref) / scale
    naive_rel = torch.where(torch.isfinite(naive_rel), naive_rel, torch.zeros_like(naive_rel))
    naive_worst = float(naive_rel.max())
    return (NAIVE_FACTOR * naive_worst + FLOOR[dtype]) * scale + ABS_FLOOR[dtype] * top, naive_worst


def _call_once(fn, q, k, v, grad_out, *, causal: bool, backward: bool) -> dict[str, torch.Tensor]:
    """One call as the mode times it: {"o": output} and, for the backward modes, {"dq", "dk", "dv"}."""
    with torch.set_grad_enabled(backward):
        out = fn(q, k, v, is_causal=causal)
        results = {"o": out.detach()}
        if backward:
            results.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad_out)))
    return results


def _graph_replayed_call(fn, q, k, v, grad_out, *, causal: bool, backward: bool,
                         capture: Callable) -> dict[str, torch.Tensor]:
    """The results of one replay of the call captured as timing="graph" captures its step (``capture``:
    `harness.capture_cuda_graph`).  The captured outputs live in the graph's memory pool and are filled with
    NaN before the replay, so a row the replay does not write fails the check; copies are returned and the
    graph is released."""
    holder: dict[str, torch.Tensor] = {}

    def step() -> None:
        holder.clear()
        holder.update(_call_once(fn, q, k, v, grad_out, causal=causal, backward=backward))

    replay = capture(step, q.device)
    for tensor in holder.values():
        tensor.fill_(math.nan)
    replay()
    results = {key: tensor.clone() for key, tensor in holder.items()}
    harness.synchronize(q.device)
    holder.clear()
    del replay
    return results


def check_accuracy(
    fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    causal: bool,
    mode: str,
    dtype: str,
    impl: str = "impl",
    timing: str = "host",
    capture: Callable | None = None,
) -> dict:
    """Run ``fn`` as ``mode`` does and check each call by the per-row rule and the whole-tensor bound (module
    docstring); AccuracyError naming the call, the worst row and tensor if one breaks either.

    The calls checked are the ones the timed rounds repeat: the first call (Triton's JIT, autotuning,
    torch.compile's tracing), a second one (what every later round runs: flash-triton's replayed launches,
    the compiled graph's cached path) and, for ``timing="graph"``, one replay of the call captured in a CUDA
    graph (``capture``, `harness.capture_cuda_graph` by default; injectable for tests).

    Returns {"accuracy_ratio": the worst row's error / allowance (<= 1), "accuracy_error": the worst
    tensor's max|x - ref| / max|ref|, "accuracy_tolerance": TOLERANCE[dtype], "accuracy_calls": the calls
    checked, "+"-joined}, the worst over the calls.  Raises `Unsupported` if ``fn`` has no kernel for these
    inputs.
    """
    _check_mode(mode)
    if timing not in harness.TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; valid: {', '.join(harness.TIMINGS)}")
    if timing == "graph" and capture is None and q.device.type != "cuda":
        raise ValueError(f"timing 'graph' captures a CUDA graph; the inputs are on {q.device}")
    backward = mode != "forward"
    try:
        calls = {"first": _call_once(fn, q, k, v, grad_out, causal=causal, backward=backward)}
    except RuntimeError as exc:  # an OOM is a RuntimeError too: it propagates to the harness as is
        if "No available kernel" not in str(exc):
            raise
        raise Unsupported(
            f"{impl} has no kernel for {dtype} inputs of shape {tuple(q.shape)}, causal={causal}, "
            f"on {q.device.type}"
        ) from None
    calls["repeat"] = _call_once(fn, q, k, v, grad_out, causal=causal, backward=backward)
    if timing == "graph":
        calls["graph-replay"] = _graph_replayed_call(fn, q, k, v, grad_out, causal=causal, backward=backward,
                                                     capture=capture or harness.capture_cuda_graph)
    expected = dict(zip(calls["first"], reference(q, k, v, grad_out if backward else None, causal=causal)))
    naive = dict(zip(calls["first"], naive_same_dtype(q, k, v, grad_out if backward else None, causal=causal)))
    # stands in for a tensor's max|ref| where that is 0 (dQ when every query sees one key): the case's scale
    fallback = max([float(ref.abs().max()) for ref in expected.values() if ref.numel()] + [0.0]) or 1.0
    allowances = {}
    for key, ref in expected.items():
        if ref.numel():
            allowances[key] = row_allowance(naive[key], ref, dtype, fallback)
    naive = None
    where = f"{impl} ({mode}, {dtype}, shape {tuple(q.shape)}, causal={causal}"
    worst_ratio, worst_error = 0.0, 0.0
    for call, results in calls.items():
        ratio, error = _judge(results, expected, allowances, dtype, fallback, f"{where}, {call} call)")
        worst_ratio, worst_error = max(worst_ratio, ratio), max(worst_error, error)
    return {"accuracy_ratio": worst_ratio, "accuracy_error": worst_error, "accuracy_tolerance": TOLERANCE[dtype],
            "accuracy_calls": "+".join(calls)}


def _judge(results: dict, expected: dict, allowances: dict, dtype: str, fallback: float,
           where: str) -> tuple[float, float]:
    """(worst row error / allowance, worst whole-tensor error) of one call's ``results``; AccuracyError
    naming ``where`` if a row is dropped or either rule breaks."""
    errors, ratios, worst_rows = {}, {}, {}
    for key, ref in expected.items():
        errors[key] = relative_error(results[key], ref, fallback) if ref.numel() else 0.0
        if not ref.numel():
            ratios[key] = 0.0
            continue
        err = row_errors(results[key], ref)
        allowance, naive_worst = allowances[key]
        ratio = err / allowance  # allowance >= ABS_FLOOR * M > 0
        row = int(ratio.argmax())
        ratios[key] = float(ratio[row])
        worst_rows[key] = (row // ref.shape[-2], row % ref.shape[-2], ref.shape[-2], float(err[row]),
                           float(allowance[row]), naive_worst)
        del err, ratio
    for key, ref in expected.items():
        lost = zeroed_rows(results[key], ref, dtype) if ref.numel() else torch.zeros(0, dtype=torch.bool)
        if bool(lost.any()):
            row = int(lost.nonzero()[0])
            raise AccuracyError(
                f"{where} is less accurate than allowed: "
                f"{key} row {row % ref.shape[-2]} of {ref.shape[-2]} (batch*head {row // ref.shape[-2]}) is all "
                f"zeros where the float64 reference's is not ({int(lost.sum())} such row(s)): a dropped row")
    worst = max(ratios, key=ratios.get)
    worst_global = max(errors, key=errors.get)
    tolerance = TOLERANCE[dtype]
    if not ratios[worst] <= 1.0:
        slice_, row, rows_per_slice, err, allowance, naive_worst = worst_rows[worst]
        detail = ", ".join(f"{key} {ratio:.2g}" for key, ratio in ratios.items())
        raise AccuracyError(
            f"{where} is less accurate than allowed: "
            f"{worst} row {row} of {rows_per_slice} (batch*head {slice_}) is off by {err:.3e} against float64, "
            f"above its allowance {allowance:.3e} = ({NAIVE_FACTOR:g} x {naive_worst:.2e}, naive {dtype}'s worst "
            f"relative row error, + {FLOOR[dtype]:.0e}) x the rows' magnitude there + {ABS_FLOOR[dtype]:.0e} x "
            f"the tensor's; worst row error / allowance per tensor: {detail}")
    if not errors[worst_global] <= tolerance:
        detail = ", ".join(f"{key} {err:.2e}" for key, err in errors.items())
        raise AccuracyError(
            f"{where} disagrees with the float64 "
            f"reference: max|x - ref| / max|ref| = {detail}; tolerance {tolerance:.0e}"
        )
    return ratios[worst], errors[worst_global]


class AttentionStep:
    """One round of an attention case; ``before_each`` is set for the backward mode only (see module doc).

    ``metrics`` (a dict supplied by the caller) receives the accuracy check's result and, on CUDA, the
    memory in use before backward; it holds numbers only, never tensors, so it can outlive the step.
    """

    def __init__(self, fn, q, k, v, grad_out, *, causal: bool, mode: str, metrics: dict) -> None:
        _check_mode(mode)
        self.fn, self.q, self.k, self.v, self.grad_out = fn, q, k, v, grad_out
        self.causal = causal
        self.mode = mode
        self.metrics = metrics
        self._out: torch.Tensor | None = None
        # The harness calls step.before_each() untimed before every round, when it is not None.
        self.before_each = self._forward_for_backward if mode == "backward" else None

    def _forward_for_backward(self) -> None:
        self._out = None  # free the previous round's graph (if a round failed) before building the next
        self._out = self.fn(self.q, self.k, self.v, is_causal=self.causal)
        if self.q.device.type == "cuda":
            # Allocation is tracked on the host when kernels are queued: no sync needed.
            self.metrics["memory_before_backward_gib"] = torch.cuda.memory_allocated(self.q.device) / 2**30

    def __call__(self) -> None:
        if self.mode == "forward":
            with torch.no_grad():
                self.fn(self.q, self.k, self.v, is_causal=self.causal)
            return
        if self.mode == "backward":
            if self._out is None:
                raise RuntimeError("the backward step needs its before_each() (the forward) before every round")
            out, self._out = self._out, None
        else:
            out = self.fn(self.q, self.k, self.v, is_causal=self.causal)
        torch.autograd.grad(out, (self.q, self.k, self.v), self.grad_out)


def attention_step(
    *,
    impl: str,
    batch_size: int,
    seq_len: int,
    head_dim: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    dtype: str = "fp32",
    causal: bool = False,
    mode: str = "forward",
    compile: bool = False,
    flash_options: str = "",
    timing: str = "host",
    device: torch.device | str = "cpu",
    seed: int = 0,
    check: bool = True,
    metrics: dict | None = None,
) -> AttentionStep:
    """Build inputs, check ``impl``'s accuracy (``check``; `check_accuracy`, on the calls ``timing`` repeats),
    return the step to time.

    Raises `Unsupported` if the check finds that ``impl`` has no kernel for these inputs, `AccuracyError`
    if it is wrong.  Pass it to the harness as a setup (``lambda: attention_step(...)``): an OOM while building the
    inputs, compiling or checking is then recorded like any other.
    """
    _check_mode(mode)
    torch_dtype = _check_dtype(dtype)
    device = torch.device(device)
    metrics = {} if metrics is None else metrics
    torch._dynamo.reset()  # every case compiles from scratch (naive-compiled, compile=True)
    fn = attention_function(impl, compile=compile, flash_options=flash_options)
    q, k, v, grad_out = random_inputs(
        qkv_shape(batch_size, heads, seq_len, head_dim), torch_dtype, device, requires_grad=mode != "forward",
        seed=seed, kv=kv_shape(batch_size, heads, kv_heads, seq_len, head_dim),
    )
    if check:
        metrics.update(check_accuracy(fn, q, k, v, grad_out, causal=causal, mode=mode, dtype=dtype, impl=impl,
                                      timing=timing))
    return AttentionStep(fn, q, k, v, grad_out, causal=causal, mode=mode, metrics=metrics)
