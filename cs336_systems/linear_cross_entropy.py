"""The LM head and its cross-entropy loss in one function that never holds the (tokens, vocab) float32 logits.

    loss = mean_i [ logsumexp_v (x_i . W_v) - x_i . W_{t_i} ]        x (N, d), W (V, d), targets t (N,)

`linear_cross_entropy_reference` is what the model computed before: ``F.cross_entropy(F.linear(x, W), t)``,
which under bf16 autocast makes the logits in bf16, casts them to a float32 copy, and keeps float32
log-probabilities for the backward: 2 × 4 × N × V bytes (164 MB at 2048 tokens and a 10000-token vocabulary,
GBs at 128k vocabularies).  `linear_cross_entropy` walks the tokens in chunks of ``chunk_tokens``:

  forward   per chunk, logits = x_c W^T in the compute dtype (bf16 under autocast), upcast, and keep only
            the float32 logsumexp and the target's logit (8 bytes a token);
  backward  per chunk, recompute the logits (one more GEMM of the head's size: 2 N d V FLOPs), form
            dlogits = (softmax - onehot(t)) * grad / N in float32, cast it to the compute dtype as autocast's
            cast would, and accumulate dx_c = dlogits W and dW += dlogits^T x_c (dW summed in float32).

Saved for the backward: x and W in the compute dtype and the (N,) logsumexp.  Peak extra memory: one chunk's
float32 logits.  The values are those of the reference up to float32 summation order (dW is summed over
chunks in float32 where the reference's single GEMM rounds once; tests/test_linear_cross_entropy.py).

Targets must lie in [0, V) (not checked: that would synchronize; an out-of-range id trips a device assert
on CUDA as F.cross_entropy's does).  No ignore_index, no label smoothing: the model's loss needs neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits F.linear(x, weight) (N, V) against targets (N,): the unfused form."""
    return F.cross_entropy(F.linear(x, weight), targets)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, chunk_tokens, compute_dtype):
        xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        picked = torch.empty(n, dtype=torch.float32, device=x.device)
        for start in range(0, n, chunk_tokens):
            stop = min(start + chunk_tokens, n)
            logits = (xc[start:stop] @ wc.T).float()  # (chunk, V): the only float32 logits alive
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            picked[start:stop] = logits.gather(1, targets[start:stop, None]).squeeze(1)
        ctx.save_for_backward(xc, wc, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.dtypes = (x.dtype, weight.dtype)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        xc, wc, targets, lse = ctx.saved_tensors
        n = xc.shape[0]
        scale = grad_loss.float() / n
        grad_x = torch.empty_like(xc)
        grad_w = torch.zeros(wc.shape, dtype=torch.float32, device=wc.device)
        for start in range(0, n, ctx.chunk_tokens):
            stop = min(start + ctx.chunk_tokens, n)
            probs = torch.exp((xc[start:stop] @ wc.T).float() - lse[start:stop, None])  # softmax, (chunk, V)
            probs[torch.arange(stop - start, device=probs.device), targets[start:stop]] -= 1.0
            dlogits = (probs * scale).to(wc.dtype)
            grad_x[start:stop] = dlogits @ wc
            grad_w += (dlogits.T @ xc[start:stop]).float()
        x_dtype, w_dtype = ctx.dtypes
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of F.linear(x, weight) against targets, chunked over tokens (module docstring).

    x: (N, d) float; weight: (V, d) float; targets: (N,) int64 in [0, V); chunk_tokens: tokens per chunk.
    Under autocast the GEMMs run in the autocast dtype, as F.linear's would.  Returns a float32 scalar.
    """
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be (N, d) and weight (V, d) with the same d; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if targets.shape != (x.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be an int64 tensor of shape ({x.shape[0]},); got {targets.dtype} of shape "
                         f"{tuple(targets.shape)}")
    if x.shape[0] == 0:
        raise ValueError("linear_cross_entropy needs at least one token (the mean of nothing is undefined)")
    return _LinearCrossEntropy.apply(x, weight, targets, chunk_tokens, _compute_dtype(x))
