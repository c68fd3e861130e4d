"""Shared float64 attention reference and FlashAttention's accuracy rule for the attention tests."""

from __future__ import annotations

import math

import torch

from cs336_systems.attention.naive import naive_attention

# Floor added to the "2x PyTorch's own error" bound, per dtype, relative to the example's largest reference
# value (see tests/attention/test_flash_pytorch.py for why it is needed where PyTorch's error is ~0).
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def reference(q, k, v, is_causal):
    """float64 (o, lse) with the handout's -1e6 mask, independent of the package's code.  K/V with fewer
    heads (dim -3) than q are repeated for each group of query heads (grouped-query attention)."""
    q, k, v = q.double(), k.double(), v.double()
    if q.shape[:-2] != k.shape[:-2]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        s = torch.where(i >= j, s, torch.tensor(-1e6, dtype=s.dtype, device=s.device))
    return torch.einsum("...qk,...kd->...qd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def token_major_view(batch, heads, n, d, dtype, seed, device="cuda"):
    """A (B, H, N, d) head-major view of token-major (B, N, H, d) memory, as the model passes q, k, v: a leaf
    that requires grad, standard normal drawn in float32 from a seeded generator, then cast."""
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(batch, n, heads, d, generator=g, device=device).to(dtype).transpose(1, 2).requires_grad_()


def random_qkv(lead, nq, nk, d, dtype, device, seed):
    g = torch.Generator(device).manual_seed(seed)
    return [torch.randn(*lead, n, d, generator=g, device=device).to(dtype).requires_grad_() for n in (nq, nk, nk)]


def outputs_and_grads(fn, q, k, v, is_causal, grad_out, inspect=None):
    """(o, dq, dk, dv) of fn on fresh leaf copies of q, k, v; ``inspect(o)`` sees o before backward."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, is_causal)
    if inspect is not None:
        inspect(o)
    dq, dk, dv = torch.autograd.grad(o, leaves, grad_out.to(o.dtype))
    return o, dq, dk, dv


def saved_tensors_check(q, k, v, saved: dict):
    """An ``inspect`` callback: checks o's autograd node saved exactly (q, k, v, o, L); keeps L."""

    def inspect(o):
        tensors = o.grad_fn.saved_tensors
        assert len(tensors) == 5, f"saved {len(tensors)} tensors, expected q, k, v, o, L"
        for t, ref in zip(tensors[:4], (q, k, v, o)):
            assert t.shape == ref.shape and t.dtype == ref.dtype
        saved["lse"] = tensors[4].detach()

    return inspect


def assert_flash_accuracy(fn, q, k, v, is_causal, *, check_saved=True, check_grads=True):
    """fn's O, dQ, dK, dV (and saved L) vs float64: error <= 2x naive-in-the-same-dtype's error + ATOL."""
    dtype = q.dtype
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64, device=q.device)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = reference(q64, k64, v64, is_causal)
    ref = (ref_o, *torch.autograd.grad(ref_o, (q64, k64, v64), grad_out))
    saved: dict = {}
    inspect = saved_tensors_check(q, k, v, saved) if check_saved else None
    ours = outputs_and_grads(fn, q, k, v, is_causal, grad_out, inspect)
    torchs = outputs_and_grads(lambda a, b, c, causal: naive_attention(a, b, c, is_causal=causal),
                               q, k, v, is_causal, grad_out)
    names = ("O", "dQ", "dK", "dV") if check_grads else ("O",)
    floor = ATOL[dtype] * max([1.0] + [r.abs().max().item() for r in ref[:len(names)] if r.numel()])
    for name, r, a, b in zip(names, ref, ours, torchs):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = (a.double() - r).abs().max().item()
        bound = 2 * (b.double() - r).abs().max().item() + floor
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (dtype {dtype})"
    if check_saved:
        lse = saved["lse"]
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1], (lse.dtype, lse.shape)
        err = (lse.double() - ref_lse).abs().max().item()
        assert err <= 1e-4 + ATOL[dtype], f"L: max error {err:.3e}"
