"""FLOP counts and model FLOP utilisation (MFU), in one place.

Language model (Kaplan et al. 2020, "Scaling Laws", sec. 2.1; PaLM, Chowdhery et al. 2022, app. B):
  forward FLOPs per token  = 2 * N  +  attention term
  train FLOPs per token    = 3 x forward  (backward = 2 x forward: grads w.r.t. inputs and weights)
where N counts the parameters that take part in a matrix multiply: every Linear weight, the LM head
included, and not the token embedding (a lookup) or the norm gains (elementwise).  The attention term
is the two (T x T) matmuls QK^T and PV: 2 * 2 * T * d_model per token per layer forward, halved for a
causal model (the FlashAttention papers' convention: masked-out half of the score matrix is not
useful work).  PaLM's 6N + 12*L*H*Q*T per token is the non-causal train version of the same formula.

These are *model* FLOPs: recomputation (activation checkpointing, FlashAttention's backward) does not
count, so MFU compares implementations fairly.

Attention alone (the FlashAttention-2 benchmark convention): forward 4 * B * H * Nq * Nk * d, x0.5 causal; backward 2.5x
forward (it recomputes the scores), forward+backward 3.5x.

MFU = achieved FLOP/s / peak FLOP/s; the peak comes from `cs336_systems.bench.machine.peak_tflops`
(datasheet dense peak) unless the caller passes one.
"""

from __future__ import annotations

from torch import nn

from cs336_systems.model import ModelConfig

# Multiplier on forward FLOPs for each benchmark mode.
MODE_MULTIPLIER = {"forward": 1.0, "forward-backward": 3.0, "train-step": 3.0}


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that enter matmuls: attention (4 d^2), SwiGLU (3 d d_ff) per layer, plus the LM head."""
    per_layer = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size


def lm_forward_flops(cfg: ModelConfig, batch_size: int, context: int, *, causal: bool = True) -> float:
    """FLOPs of one forward pass over (batch_size, context) tokens."""
    tokens = batch_size * context
    dense = 2 * matmul_parameters(cfg) * tokens
    attention = 4 * cfg.n_layers * context * cfg.d_model * tokens * (0.5 if causal else 1.0)
    return float(dense + attention)


def lm_flops(cfg: ModelConfig, batch_size: int, context: int, mode: str) -> float:
    """Model FLOPs of one step of ``mode`` ("forward", "forward-backward", "train-step").

    The optimizer step's elementwise work (~10 FLOPs per parameter for AdamW) is negligible next to
    6 N per token and is not counted, as in the references above.
    """
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODE_MULTIPLIER)}")
    return MODE_MULTIPLIER[mode] * lm_forward_flops(cfg, batch_size, context)


def attention_flops(
    batch_heads: int, n_queries: int, n_keys: int, d_head: int, *, causal: bool, mode: str = "forward"
) -> float:
    """FLOPs of attention over batch_heads independent (Nq x d, Nk x d) problems.

    4 FLOPs per (query, key, d) for QK^T and PV.  Causal counts the unmasked area of the Nq x Nk score
    matrix under this package's mask (query i sees keys j <= i, aligned top-left), in the continuous form
    the FlashAttention benchmarks use, so Nq == Nk gives exactly half: Nq^2 / 2 when Nq <= Nk, else
    Nq * Nk - Nk^2 / 2 (every query past row Nk sees all keys).  The exact pair count differs by at most
    min(Nq, Nk) / 2 pairs.
    """
    multiplier = {"forward": 1.0, "backward": 2.5, "forward-backward": 3.5}
    if mode not in multiplier:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(multiplier)}")
    if not causal:
        pairs = float(n_queries) * n_keys
    elif n_queries <= n_keys:
        pairs = n_queries * n_queries / 2.0
    else:
        pairs = float(n_queries) * n_keys - n_keys * n_keys / 2.0
    return 4.0 * batch_heads * pairs * d_head * multiplier[mode]


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOP utilisation in [0, 1]; None if the peak is unknown."""
    if peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def count_matmul_parameters(model: nn.Module) -> int:
    """Parameters of the model's nn.Linear weights (the N of the formulas, counted from the module)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
