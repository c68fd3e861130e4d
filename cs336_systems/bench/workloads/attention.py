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

Before any timing, `attention_step` checks the implementation once in the case's mode against a float32
reference on the same inputs (`check_accuracy`): the output, and dQ, dK, dV for the backward modes.
The error is max|x - ref| / max|ref| per tensor, the worst tensor counts, against a tolerance per dtype
(`TOLERANCE`); a wrong implementation raises `AccuracyError` (an AssertionError: the case fails, nothing is
timed).  The reference (`reference`) is written here, independently of the registry: matmul, mask,
softmax, matmul in float32, over blocks of query rows so that the scores of one block stay under
`REFERENCE_BLOCK_BYTES` (one block while they fit: then it is exactly the naive computation).  dK and dV
are summed over the blocks.  Memory stays bounded at N = 65536, and it needs no fused kernel, whose
shape and dtype rules (the pinned SDPA backends take only 4-D inputs) would otherwise decide which
cases can be checked.  An implementation that has no kernel for the inputs ("No available kernel")
raises `Unsupported`, which the perf suite reports as a skip.

``compile=True`` wraps the registered function in torch.compile(fullgraph=True, dynamic=False): one static
graph per case, and a graph break is an error rather than a silent slowdown.  Dynamo's caches are
reset when a step is built so cases never share (and exhaust) a recompile budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cs336_systems import attention
from cs336_systems.bench import flops

MODES = ("forward", "backward", "forward-backward")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Allowed max|x - ref| / max|ref| per input dtype.  fp32: ~10^4 float32 ulps of headroom for sums
# reordered over N up to 65536, yet an implementation that silently rounds through bf16 (~4e-3) fails.
# bf16 / fp16: the inputs, the probabilities and dO @ V^T are rounded to 8 / 11 significant bits inside
# the implementations; a few units of that rounding on the largest element.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 1e-2}

# Scores of one block of query rows in the float32 reference; a block lives as ~4 such tensors (scores,
# probabilities and their gradients), so the reference needs ~4 GiB beyond its inputs at most.
REFERENCE_BLOCK_BYTES = 2**30


class AccuracyError(AssertionError):
    """The implementation's result differs from the float32 reference by more than the tolerance."""


class Unsupported(Exception):
    """The implementation has no kernel for these inputs (e.g. SDPA's FlashAttention-2 and cuDNN
    backends take no float32): a property of the kernel, reported as a skip, not a failure."""


def qkv_shape(batch_size: int, heads: int | None, seq_len: int, head_dim: int) -> tuple[int, ...]:
    """(B, N, d) without heads, (B, H, N, d) with."""
    if heads is None:
        return (batch_size, seq_len, head_dim)
    return (batch_size, heads, seq_len, head_dim)


def case_flops(case: dict) -> float:
    """Model FLOPs of one step of an attention case (`flops.attention_flops`; causal halves them)."""
    batch_heads = case["batch_size"] * (case.get("heads") or 1)
    n = case["seq_len"]
    return flops.attention_flops(batch_heads, n, n, case["head_dim"], causal=case["causal"], mode=case["mode"])


def step_arguments(case: dict) -> dict:
    """The `attention_step` keyword arguments named by a benchmarks.json attention case."""
    return dict(
        impl=case["impl"], batch_size=case["batch_size"], heads=case.get("heads"), seq_len=case["seq_len"],
        head_dim=case["head_dim"], dtype=case["dtype"], causal=case["causal"], mode=case["mode"],
        compile=case.get("compile", False),
    )


def attention_function(impl: str, *, compile: bool = False) -> Callable[..., torch.Tensor]:
    """The registered ``fn(q, k, v, is_causal)`` of ``impl``, optionally under torch.compile(fullgraph=True)."""
    fn = attention.get(impl).fn
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
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, requires_grad: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v and dO of ``shape``: standard normal, drawn in float32 from a seeded generator, then cast."""
    generator = torch.Generator(device).manual_seed(seed)
    q, k, v, grad_out = (
        torch.randn(shape, device=device, generator=generator).to(dtype) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad_out


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None, *, causal: bool
) -> list[torch.Tensor]:
    """[o] or, when ``grad_out`` is given, [o, dQ, dK, dV]: float32 attention of the same input values.

    Shapes as the inputs, (..., N, d); computed over (B*H, rows, Nk) blocks of query rows (see the
    module docstring), the causal mask offset by each block's first row.
    """
    backward = grad_out is not None
    lead, n_queries, n_keys, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    qf, kf, vf = (t.detach().float().reshape(-1, t.shape[-2], d) for t in (q, k, v))  # (BH, N, d)
    kf.requires_grad_(backward)
    vf.requires_grad_(backward)
    do = grad_out.float().reshape(-1, n_queries, d) if backward else None
    rows = max(1, min(n_queries, REFERENCE_BLOCK_BYTES // (qf.shape[0] * n_keys * 4)))
    out = torch.empty_like(qf)
    dq = torch.empty_like(qf) if backward else None
    dk = torch.zeros_like(kf) if backward else None
    dv = torch.zeros_like(vf) if backward else None
    keys = torch.arange(n_keys, device=q.device)
    with torch.set_grad_enabled(backward):
        for start in range(0, n_queries, rows):
            stop = min(start + rows, n_queries)
            q_block = qf[:, start:stop].detach().requires_grad_(backward)
            # Causal: rows < stop see only keys < stop; the rest of K and V gets no gradient from them.
            seen = min(stop, n_keys) if causal else n_keys
            scores = q_block @ kf[:, :seen].transpose(-2, -1) / math.sqrt(d)  # (BH, rows, seen)
            if causal:
                allowed = torch.arange(start, stop, device=q.device)[:, None] >= keys[None, :seen]
                scores = scores.masked_fill(~allowed, -math.inf)  # key 0 is always allowed: no empty row
            o_block = torch.softmax(scores, dim=-1) @ vf[:, :seen]  # (BH, rows, d)
            out[:, start:stop] = o_block.detach()
            if backward:
                g_q, g_k, g_v = torch.autograd.grad(o_block, (q_block, kf, vf), do[:, start:stop])
                dq[:, start:stop] = g_q
                dk += g_k
                dv += g_v
            del scores, o_block
    results = [out] if not backward else [out, dq, dk, dv]
    return [t.reshape(*lead, -1, d) for t in results]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref| (both in float32); inf if x has a NaN."""
    diff = (x.float() - ref).abs().max()
    if torch.isnan(diff):
        return math.inf
    return float(diff / ref.abs().max().clamp_min(1e-30))


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
) -> dict:
    """Run ``fn`` once as ``mode`` does and compare with `reference`; AccuracyError past `TOLERANCE`.

    Returns {"accuracy_error": worst relative error, "accuracy_tolerance": its bound}.  Raises `Unsupported`
    if ``fn`` has no kernel for these inputs.
    """
    _check_mode(mode)
    backward = mode != "forward"
    try:
        with torch.set_grad_enabled(backward):
            out = fn(q, k, v, is_causal=causal)
            results = {"o": out.detach()}
            if backward:
                results.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad_out)))
    except RuntimeError as exc:  # an OOM is a RuntimeError too: it propagates to the harness as is
        if "No available kernel" not in str(exc):
            raise
        raise Unsupported(
            f"{impl} has no kernel for {dtype} inputs of shape {tuple(q.shape)}, causal={causal}, "
            f"on {q.device.type}"
        ) from None
    out = None  # the implementation's graph is not needed while the reference runs
    expected = reference(q, k, v, grad_out if backward else None, causal=causal)
    errors = {key: relative_error(results[key], ref) for key, ref in zip(results, expected)}
    worst = max(errors, key=errors.get)
    tolerance = TOLERANCE[dtype]
    if not errors[worst] <= tolerance:
        detail = ", ".join(f"{key} {err:.2e}" for key, err in errors.items())
        raise AccuracyError(
            f"{impl} ({mode}, {dtype}, shape {tuple(q.shape)}, causal={causal}) disagrees with the float32 "
            f"reference: max|x - ref| / max|ref| = {detail}; tolerance {tolerance:.0e}"
        )
    return {"accuracy_error": errors[worst], "accuracy_tolerance": tolerance}


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
    dtype: str = "fp32",
    causal: bool = False,
    mode: str = "forward",
    compile: bool = False,
    device: torch.device | str = "cpu",
    seed: int = 0,
    check: bool = True,
    metrics: dict | None = None,
) -> AttentionStep:
    """Build inputs, check ``impl`` against the float32 reference (``check``), return the step to time.

    Raises `Unsupported` if the check finds that ``impl`` has no kernel for these inputs, `AccuracyError`
    if it is wrong.  Pass it to the harness as a setup (``lambda: attention_step(...)``): an OOM while building the
    inputs, compiling or checking is then recorded like any other.
    """
    _check_mode(mode)
    torch_dtype = _check_dtype(dtype)
    device = torch.device(device)
    metrics = {} if metrics is None else metrics
    torch._dynamo.reset()  # every case compiles from scratch (naive-compiled, compile=True)
    fn = attention_function(impl, compile=compile)
    q, k, v, grad_out = random_inputs(
        qkv_shape(batch_size, heads, seq_len, head_dim), torch_dtype, device, requires_grad=mode != "forward",
        seed=seed,
    )
    if check:
        metrics.update(check_accuracy(fn, q, k, v, grad_out, causal=causal, mode=mode, dtype=dtype, impl=impl))
    return AttentionStep(fn, q, k, v, grad_out, causal=causal, mode=mode, metrics=metrics)
