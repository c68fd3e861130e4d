"""Memory and communication accounting: the XXL FFN stack on H100s / TPU v5p, and the DDP bucket model.

Run ``python -m cs336_systems.accounting`` for the worked answer.  Pure Python (no torch import), so
the numbers can be checked by hand from the docstrings below.

The model (handout problem "communication_accounting")
------------------------------------------------------
XXL keeps only the feed-forward matmuls: ``n_blocks = 126`` blocks, each two bias-free linears,
``W_in: d_model -> d_ff`` then ``W_out: d_ff -> d_model``, with d_model = 16384 and d_ff = 53248
(= 13 * 4096; *not* 54328, a digit swap seen in other write-ups).  No activation function, no
attention, embeddings, norms or LM head; no activation checkpointing.

Parameters  P = n_blocks * 2 * d_model * d_ff = 126 * 2 * 16384 * 53248 = 219,848,638,464.

Training state, per parameter (all FP32):  master weight 4 B + accumulated gradient 4 B + AdamW
first and second moments 2 * 4 B = 16 B.  16 * P = 3,517,578,215,424 B = 3517.58 GB = 3276 GiB
exactly (P = 1638 * 2**27, so 16 P = 3276 * 2**30).
H100 80GB equivalents = ceil(16 P / 80e9) = ceil(43.97) = 44 (decimal GB, the label's unit; with
80 GiB per card it would be ceil(3276 / 80) = ceil(40.95) = 41; write-ups that divide GiB by "80 GB"
get the latter).

Activations saved for backward (BF16, 2 B per element), per token.  For one block with input
x (T, d_model):
    h = x @ W_in^T   (T, d_ff)        y = h @ W_out^T   (T, d_model)
Backward needs dW_in = dh^T @ x  -> saves x  (d_model values per token),
               dW_out = dy^T @ h -> saves h  (d_ff values per token);
dx = dh @ W_in and dh = dy @ W_out need only the weights.  y is the next block's x, so it is not
counted twice; the last block's y feeds a loss that is outside the model and is not counted.
    bytes per token = n_blocks * 2 * (d_model + d_ff) = 126 * 2 * 69632 = 17,547,264 B  (~17.5 MB)
    A(T) = 17,547,264 * T bytes for T tokens.

FSDP (part b).  Weights, gradients and optimizer state are sharded N ways, and half of the
activations (every second layer's) are sharded too, the other half kept whole:
    M(N) = (16 P + A(T)/2) / N + A(T)/2.
Here T is the number of tokens whose activations one device would keep without sharding (its
micro-batch); the answer depends on it, so it is a parameter.  The smallest N with M(N) <= 95 GB is
    N = ceil((16 P + A/2) / (95e9 - A/2)):
    T = 0     -> ceil(37.03) = 38  (state alone)
    T = 1024  -> ceil(40.999) = 41 (default: one 1024-token sequence per device; note the margin is
                 only ~2 MB, so a GiB reading of "95 GB" changes the answer -- it is a parameter too)
    T = 2048  -> 46,  T = 4096 -> 61.

Compute-bound batch on a TPU v5p mesh (part c), Scaling Book notation ("How to Scale Your Model",
Training chapter, "Mixed FSDP and Tensor Parallelism").  B = global batch in tokens, D = d_model,
F = d_ff, X = FSDP degree over M_X mesh axes, Y = TP degree over M_Y axes, N = X * Y chips,
W = W_ici (one-way bandwidth per axis), C = peak FLOP/s, alpha = C / W.  Forward pass of one block,
In[B_X, D_Y] *_D W_in[D_X, F_Y] *_F W_out[F_Y, D_X] -> Out[B_X, D_Y], all traffic in BF16:
  * FSDP AllGather_X of W_in[D, F_Y] and W_out[F_Y, D]: 2 * (2 D F / Y) bytes gathered over M_X axes
        T_fsdp = 4 D F / (Y W M_X)
  * TP AllGather_Y of In[B_X, D] and ReduceScatter_Y of Out[B_X, D]: 2 * (2 B D / X) bytes over M_Y
        T_tp   = 4 B D / (X W M_Y)
  * two matmuls of 2 (B/X)(D)(F/Y) FLOPs on each chip
        T_math = 4 B D F / (N C)
Comms overlap compute, so the block is compute bound when T_fsdp + T_tp <= T_math.  Divide by
4 D / (N C) and use N = X Y:
        X C F / (W M_X) + B Y C / (W M_Y) <= B F
        X alpha / M_X <= B (1 - Y alpha / (F M_Y))
        B >= B* = (X alpha / M_X) / (1 - Y alpha / (F M_Y))        [needs Y alpha < F M_Y]
and per chip b* = B* / N = alpha / (Y M_X (1 - Y alpha / (F M_Y))).
v5p: W = 2 * 9e10 = 1.8e11 B/s, C = 4.6e14 FLOP/s, alpha = 23000/9 = 2555.6; X = 16, Y = 4,
M_X = 2, M_Y = 1, N = 64, F = 53248:
        Y alpha / (F M_Y) = 10222.2 / 53248 = 0.19197  (the TP term; must stay below 1)
        B* = (16 * 2555.6 / 2) / 0.80803 = 20444.4 / 0.80803 = 25,301.7 tokens
        b* = B* / 64 = 395.34 tokens per chip
so the smallest compute-bound per-chip batch is 396 tokens and the overall batch 396 * 64 = 25,344
tokens (each FSDP shard, i.e. each TP group of 4 chips, holds B / X = 1584 tokens).  For comparison,
with X chosen optimally for N = 64 the Scaling Book's bound is 4 alpha^2 / (F M_X M_Y) = 245.3 per chip.

DDP bucket overhead (handout problem "ddp_bucketed_benchmarking")
-----------------------------------------------------------------
With s total gradient bytes, w all-reduce algorithm bandwidth (bytes/s), o seconds of fixed cost
per communication call and n_b buckets, the model is
        overhead(n_b) = n_b * o + s / (n_b * w).
d/dn_b = o - s / (n_b^2 w) = 0 gives n_b* = sqrt(s / (o w)) and the bucket size
s / n_b* = sqrt(s o w); the minimum overhead is 2 sqrt(s o / w).  o and w come from a
least-squares fit of all-reduce timings t = o + size / w (`fit_allreduce_model`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

# ---- units and byte widths -------------------------------------------------------------------
GB = 10**9
GiB = 2**30
FP32_BYTES = 4
BF16_BYTES = 2
ADAMW_MOMENTS = 2
# FP32 master weight + FP32 accumulated gradient + AdamW's two FP32 moments.
STATE_BYTES_PER_PARAM = FP32_BYTES + FP32_BYTES + ADAMW_MOMENTS * FP32_BYTES  # 16
ACTIVATION_BYTES = BF16_BYTES
COMM_BYTES = BF16_BYTES  # gathered weights and activations travel in BF16

# ---- devices ---------------------------------------------------------------------------------
H100_HBM_BYTES = 80 * GB
TPU_V5P_HBM_BYTES = 95 * GB
TPU_V5P_ICI_BANDWIDTH_BPS = 2 * 9 * 10**10  # W_ici as the handout gives it (1.8e11 B/s)
TPU_V5P_PEAK_FLOPS = 46 * 10**13  # C = 4.6e14 bf16 FLOP/s

# Tokens of activations one device keeps in the FSDP question (one 1024-token sequence).
DEFAULT_ACTIVATION_TOKENS = 1024


# ---- validation ------------------------------------------------------------------------------
def _check_int(name: str, value, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _check_positive(name: str, value) -> float:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return float(value)


# ---- part (a): parameters, state, activations ------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FFNStack:
    """n_blocks blocks of two bias-free linears (d_model -> d_ff -> d_model), nothing else."""

    d_model: int = 16384
    d_ff: int = 53248
    n_blocks: int = 126

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "n_blocks"):
            _check_int(name, getattr(self, name))

    @property
    def n_params(self) -> int:
        """n_blocks * (d_model * d_ff + d_ff * d_model)."""
        return self.n_blocks * 2 * self.d_model * self.d_ff

    @property
    def state_bytes(self) -> int:
        """FP32 weights + FP32 grads + AdamW moments: 16 bytes per parameter."""
        return STATE_BYTES_PER_PARAM * self.n_params

    @property
    def activation_bytes_per_token(self) -> int:
        """BF16 inputs of both linears of every block: n_blocks * 2 * (d_model + d_ff)."""
        return self.n_blocks * ACTIVATION_BYTES * (self.d_model + self.d_ff)

    def activation_bytes(self, tokens: int) -> int:
        """Bytes saved for backward over ``tokens`` tokens (0 allowed)."""
        return _check_int("tokens", tokens, minimum=0) * self.activation_bytes_per_token


XXL = FFNStack()


def devices_to_hold(total_bytes: int, device_bytes: int = H100_HBM_BYTES) -> int:
    """How many devices of ``device_bytes`` the bytes fill: ceil(total / device)."""
    _check_int("total_bytes", total_bytes, minimum=0)
    _check_int("device_bytes", device_bytes)
    return -(-total_bytes // device_bytes)


# ---- part (b): FSDP --------------------------------------------------------------------------
def fsdp_bytes_per_device(n_fsdp: int, tokens: int = DEFAULT_ACTIVATION_TOKENS, model: FFNStack = XXL) -> float:
    """M(N) = (16 P + A/2) / N + A/2: state and half the activations sharded N ways."""
    _check_int("n_fsdp", n_fsdp)
    a = model.activation_bytes(tokens)
    return (model.state_bytes + a / 2) / n_fsdp + a / 2


def min_fsdp_degree(
    tokens: int = DEFAULT_ACTIVATION_TOKENS, device_bytes: int = TPU_V5P_HBM_BYTES, model: FFNStack = XXL
) -> int:
    """Smallest N with M(N) <= device_bytes.

    M(N) <= cap  <=>  2 * 16 P + A <= N (2 cap - A), solved in integers (no rounding at the
    boundary).  Raises ValueError when the unsharded half of the activations alone fills the device.
    """
    _check_int("device_bytes", device_bytes)
    a = model.activation_bytes(tokens)
    room = 2 * device_bytes - a
    if room <= 0:
        raise ValueError(
            f"tokens={tokens}: the unsharded half of the activations ({a / 2 / GB:.1f} GB) does not fit "
            f"in device_bytes={device_bytes} at any FSDP degree"
        )
    return -(-(2 * model.state_bytes + a) // room)


# ---- part (c): compute-bound batch on a 2-D FSDP x TP mesh ----------------------------------
@dataclass(frozen=True, kw_only=True)
class Mesh:
    """A TPU mesh split into X-way FSDP over M_X axes and Y-way TP over M_Y axes (Scaling Book)."""

    fsdp: int = 16  # X
    tp: int = 4  # Y
    fsdp_axes: int = 2  # M_X
    tp_axes: int = 1  # M_Y
    ici_bandwidth_Bps: float = TPU_V5P_ICI_BANDWIDTH_BPS  # W
    peak_flops: float = TPU_V5P_PEAK_FLOPS  # C

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp", "fsdp_axes", "tp_axes"):
            _check_int(name, getattr(self, name))
        _check_positive("ici_bandwidth_Bps", self.ici_bandwidth_Bps)
        _check_positive("peak_flops", self.peak_flops)

    @property
    def n_chips(self) -> int:
        return self.fsdp * self.tp

    @property
    def alpha(self) -> float:
        """ICI arithmetic intensity C / W (FLOPs per byte moved)."""
        return self.peak_flops / self.ici_bandwidth_Bps


@dataclass(frozen=True)
class ForwardBlockTimes:
    """Seconds per block in the forward pass: matmuls, FSDP weight gathers, TP activation comms."""

    math_s: float
    fsdp_comm_s: float
    tp_comm_s: float

    @property
    def compute_bound(self) -> bool:
        return self.fsdp_comm_s + self.tp_comm_s <= self.math_s


def forward_block_times(global_tokens: float, mesh: Mesh = Mesh(), model: FFNStack = XXL) -> ForwardBlockTimes:
    """T_math = 4BDF/(NC), T_fsdp = 4DF/(Y W M_X), T_tp = 4BD/(X W M_Y) for one block (see module doc)."""
    b = _check_positive("global_tokens", global_tokens)
    d, f, w = model.d_model, model.d_ff, mesh.ici_bandwidth_Bps
    return ForwardBlockTimes(
        math_s=2 * 2 * b * d * f / (mesh.n_chips * mesh.peak_flops),
        fsdp_comm_s=2 * COMM_BYTES * d * f / (mesh.tp * w * mesh.fsdp_axes),
        tp_comm_s=2 * COMM_BYTES * b * d / (mesh.fsdp * w * mesh.tp_axes),
    )


@dataclass(frozen=True)
class CriticalBatch:
    """Where T_fsdp + T_tp = T_math, and the smallest whole per-chip batch at or above it."""

    global_tokens_threshold: float  # B*
    per_device_threshold: float  # B* / N
    per_device_tokens: int  # ceil(B* / N)
    global_tokens: int  # per_device_tokens * N


def critical_batch(mesh: Mesh = Mesh(), model: FFNStack = XXL) -> CriticalBatch:
    """B* = (X alpha / M_X) / (1 - Y alpha / (F M_Y)); per chip B*/N (derivation in the module doc)."""
    tp_fraction = mesh.tp * mesh.alpha / (model.d_ff * mesh.tp_axes)
    if tp_fraction >= 1:
        raise ValueError(
            f"tp={mesh.tp}: tensor-parallel comms alone take {tp_fraction:.2f}x the matmul time "
            f"(need tp < d_ff * tp_axes / alpha = {model.d_ff * mesh.tp_axes / mesh.alpha:.1f}); "
            "no batch size is compute bound"
        )
    threshold = (mesh.fsdp * mesh.alpha / mesh.fsdp_axes) / (1 - tp_fraction)
    per_device = threshold / mesh.n_chips
    whole = math.ceil(per_device)
    return CriticalBatch(threshold, per_device, whole, whole * mesh.n_chips)


def optimal_mix_min_tokens_per_device(mesh: Mesh = Mesh(), model: FFNStack = XXL) -> float:
    """Scaling Book bound with X chosen optimally for N chips: 4 alpha^2 / (F M_X M_Y)."""
    return 4 * mesh.alpha**2 / (model.d_ff * mesh.fsdp_axes * mesh.tp_axes)


# ---- DDP bucket model ------------------------------------------------------------------------
def ddp_overhead_s(total_bytes: float, bandwidth_Bps: float, per_call_overhead_s: float, n_buckets: float) -> float:
    """overhead(n_b) = n_b * o + s / (n_b * w)  (n_b may be fractional for the continuous optimum)."""
    s = _check_positive("total_bytes", total_bytes)
    w = _check_positive("bandwidth_Bps", bandwidth_Bps)
    o = _check_positive("per_call_overhead_s", per_call_overhead_s)
    n = _check_positive("n_buckets", n_buckets)
    return n * o + s / (n * w)


def optimal_bucket_bytes(total_bytes: float, bandwidth_Bps: float, per_call_overhead_s: float) -> float:
    """sqrt(s o w): the bucket size at n_b* = sqrt(s / (o w))."""
    s = _check_positive("total_bytes", total_bytes)
    w = _check_positive("bandwidth_Bps", bandwidth_Bps)
    o = _check_positive("per_call_overhead_s", per_call_overhead_s)
    return math.sqrt(s * o * w)


def optimal_n_buckets(total_bytes: float, bandwidth_Bps: float, per_call_overhead_s: float) -> float:
    """s / sqrt(s o w) = sqrt(s / (o w)); continuous -- round to a neighbouring integer >= 1 to use it."""
    return _check_positive("total_bytes", total_bytes) / optimal_bucket_bytes(
        total_bytes, bandwidth_Bps, per_call_overhead_s
    )


@dataclass(frozen=True)
class AllReduceFit:
    """t = o + size / w fitted by least squares."""

    per_call_overhead_s: float  # o (intercept; may come out <= 0 when noise swamps it)
    bandwidth_Bps: float  # w (1 / slope)


def fit_allreduce_model(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> AllReduceFit:
    """Ordinary least squares of times on sizes: slope 1/w, intercept o.

    Centred sums (slope = sum dx dt / sum dx^2) keep the fit accurate when sizes span 1e3..1e10.
    """
    sizes, times = list(sizes_bytes), list(times_s)
    if len(sizes) != len(times):
        raise ValueError(f"sizes_bytes has {len(sizes)} points but times_s has {len(times)}")
    if len(sizes) < 2:
        raise ValueError(f"need at least 2 points to fit o and w, got {len(sizes)}")
    for name, values in (("sizes_bytes", sizes), ("times_s", times)):
        for i, v in enumerate(values):
            _check_positive(f"{name}[{i}]", v)
    mean_x = math.fsum(sizes) / len(sizes)
    mean_t = math.fsum(times) / len(times)
    sxx = math.fsum((x - mean_x) ** 2 for x in sizes)
    if sxx == 0:
        raise ValueError(f"sizes_bytes must contain at least two distinct sizes, got {sizes!r}")
    sxt = math.fsum((x - mean_x) * (t - mean_t) for x, t in zip(sizes, times))
    slope = sxt / sxx
    if slope <= 0:
        raise ValueError(
            f"times_s do not grow with sizes_bytes (fitted slope {slope:.3g} s/B), so no bandwidth can be fitted"
        )
    return AllReduceFit(per_call_overhead_s=mean_t - slope * mean_x, bandwidth_Bps=1 / slope)


# ---- CLI -------------------------------------------------------------------------------------
def report(tokens: int = DEFAULT_ACTIVATION_TOKENS, model: FFNStack = XXL, mesh: Mesh = Mesh()) -> str:
    """The worked answer as text."""
    p, state = model.n_params, model.state_bytes
    per_tok = model.activation_bytes_per_token
    acts = model.activation_bytes(tokens)
    n_fsdp = min_fsdp_degree(tokens, model=model)
    crit = critical_batch(mesh, model)
    t = forward_block_times(crit.global_tokens, mesh, model)
    d, f, L = model.d_model, model.d_ff, model.n_blocks
    lines = [
        f"XXL: d_model={d}, d_ff={f}, n_blocks={L};"
        " each block = Linear(d_model->d_ff) + Linear(d_ff->d_model), no biases",
        "",
        "(a) single device",
        f"  parameters P = {L} * 2 * {d} * {f} = {p:,}",
        f"  FP32 weights + grads + AdamW (m, v) = {STATE_BYTES_PER_PARAM} B/param -> {state:,} B"
        f" = {state / GB:,.2f} GB = {state / GiB:,.2f} GiB",
        f"  H100 80GB equivalents: ceil({state / GB:,.2f} / 80) = {devices_to_hold(state)}"
        f"  (with 80 GiB cards: ceil({state / GiB:,.2f} / 80) = {devices_to_hold(state, 80 * GiB)})",
        f"  activations saved for backward (BF16: each linear's input, x and h): {L} * 2 * ({d} + {f})"
        f" = {per_tok:,} B/token = {per_tok / 1e6:.2f} MB/token",
        f"  at T = {tokens:,} tokens: {acts:,} B = {acts / GB:,.2f} GB;"
        f" state + activations = {(state + acts) / GB:,.2f} GB = {devices_to_hold(state + acts)} H100s",
        "",
        f"(b) FSDP over N devices, half the activations sharded (T = {tokens:,} tokens per device)",
        "  M(N) = (16 P + A/2) / N + A/2",
        f"       = ({state / GB:,.2f} GB + {acts / 2 / GB:,.2f} GB) / N + {acts / 2 / GB:,.2f} GB",
        f"  smallest N with M(N) <= {TPU_V5P_HBM_BYTES / GB:g} GB (TPU v5p): N_FSDP = {n_fsdp}"
        f"  (M = {fsdp_bytes_per_device(n_fsdp, tokens, model) / GB:.3f} GB)",
        "  other token counts: "
        + ", ".join(f"T={t_}: {min_fsdp_degree(t_, model=model)}" for t_ in (0, 512, 1024, 2048, 4096)),
        "",
        f"(c) mesh: X={mesh.fsdp} FSDP over M_X={mesh.fsdp_axes} axes, Y={mesh.tp} TP over M_Y={mesh.tp_axes},"
        f" W_ici={mesh.ici_bandwidth_Bps:.3g} B/s, C={mesh.peak_flops:.3g} FLOP/s, alpha=C/W={mesh.alpha:.1f}",
        "  compute bound when 4DF/(Y W M_X) + 4BD/(X W M_Y) <= 4BDF/(N C)",
        "  <=> B >= (X alpha / M_X) / (1 - Y alpha / (F M_Y))"
        f" = {mesh.fsdp * mesh.alpha / mesh.fsdp_axes:,.1f} / {1 - mesh.tp * mesh.alpha / (f * mesh.tp_axes):.5f}"
        f" = {crit.global_tokens_threshold:,.1f} tokens",
        f"  per-device batch >= {crit.per_device_threshold:.2f} -> {crit.per_device_tokens} tokens per chip;"
        f" overall batch = {crit.per_device_tokens} * {mesh.n_chips} = {crit.global_tokens:,} tokens",
        f"  check at B = {crit.global_tokens:,}: T_math = {t.math_s * 1e6:.1f} us >="
        f" T_fsdp + T_tp = {t.fsdp_comm_s * 1e6:.1f} + {t.tp_comm_s * 1e6:.1f} us",
        f"  (optimal X for N={mesh.n_chips} would allow"
        f" {optimal_mix_min_tokens_per_device(mesh, model):.1f} tokens per chip)",
        "",
        "DDP buckets: overhead(n_b) = n_b o + s / (n_b w); optimum n_b* = sqrt(s / (o w)), bucket = sqrt(s o w)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cs336_systems.accounting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_ACTIVATION_TOKENS,
        help="tokens of activations per device in parts (a) and (b) (default %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        text = report(args.tokens)
    except ValueError as err:  # e.g. --tokens so large that no FSDP degree fits
        parser.error(f"--tokens {args.tokens}: {err}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
