"""linear_cross_entropy (the LM head and loss fused over token chunks) against F.cross_entropy(F.linear(...)):
values and gradients, float32 and under bf16 autocast, any chunking; and TransformerLM.loss with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems import model as lm
from cs336_systems.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(n, d, v, seed, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(DEVICE).to(w_dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    return x, w, t


def _grads(fn, x, w, t):
    x.grad = w.grad = None
    loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), d=st.integers(1, 24), v=st.integers(2, 50), chunk=st.integers(1, 80),
       seed=st.integers(0, 999))
def test_float32_matches_the_unfused_loss_values_and_gradients(n, d, v, chunk, seed):
    x, w, t = _case(n, d, v, seed)
    want = _grads(linear_cross_entropy_reference, x, w, t)
    got = _grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk), x, w, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.float32


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_bf16_autocast_matches_the_unfused_loss(chunk, w_dtype):
    # bf16 GEMMs on both sides; the fused form sums dW over chunks in float32 (the unfused GEMM rounds once)
    x, w, t = _case(96, 32, 40, 0, w_dtype)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        want = _grads(linear_cross_entropy_reference, x, w, t)
        got = _grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk), x, w, t)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"chunk_tokens": 0}, "chunk_tokens must be a positive integer, got 0"),
    ({"chunk_tokens": True}, "chunk_tokens must be a positive integer, got True"),
])
def test_bad_chunk_is_named(kwargs, match):
    x, w, t = _case(4, 3, 5, 0)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(x, w, t, **kwargs)


def test_bad_shapes_are_named():
    x, w, t = _case(4, 3, 5, 0)
    with pytest.raises(ValueError, match=r"x must be \(N, d\) and weight \(V, d\) with the same d"):
        linear_cross_entropy(x, w[:, :2], t)
    with pytest.raises(ValueError, match=r"targets must be an int64 tensor of shape \(4,\)"):
        linear_cross_entropy(x, w, t[:3])
    with pytest.raises(ValueError, match="at least one token"):
        linear_cross_entropy(x[:0], w, t[:0])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_loss_with_chunks_is_the_loss_on_full_logits(precision):
    torch.manual_seed(0)
    full = lm.build("tiny", context_length=16, device=DEVICE)
    chunked = lm.build("tiny", context_length=16, device=DEVICE, loss_chunk_tokens=5)
    chunked.load_state_dict(full.state_dict())
    tokens = torch.randint(0, 10_000, (2, 16), device=DEVICE)
    targets = torch.randint(0, 10_000, (2, 16), device=DEVICE)
    losses = []
    for m in (full, chunked):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = m.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0] == pytest.approx(F.cross_entropy(full(tokens).flatten(0, 1).float(), targets.flatten()).item(),
                                      rel=1e-2 if precision == "bf16" else 1e-6)
    tol = dict(rtol=2e-2, atol=1e-3) if precision == "bf16" else dict(rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=name)


def test_loss_chunk_tokens_is_validated_and_targets_must_match():
    with pytest.raises(ValueError, match="loss_chunk_tokens must be a non-negative integer .* got -1"):
        lm.config("tiny", loss_chunk_tokens=-1)
    m = lm.build("tiny", context_length=8)
    with pytest.raises(ValueError, match=r"targets must have the shape of tokens \(2, 8\), got \(2, 7\)"):
        m.loss(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
