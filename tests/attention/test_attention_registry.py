"""Attention registry and the reference implementations against a float64 softmax reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems import attention


def reference(q, k, v, is_causal):
    """float64 softmax attention with the handout's -1e6 mask, computed independently of the package."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        s = torch.where(i >= j, s, torch.tensor(-1e6, dtype=s.dtype))
    return torch.einsum("...qk,...kd->...qd", torch.softmax(s, -1), v)


def test_registry_names_and_availability():
    assert {"naive", "sdpa"} <= set(attention.names())
    assert {"naive", "sdpa"} <= set(attention.available("cpu"))
    assert attention.get("naive").description


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown attention implementation 'flash-nope'; valid: .*naive.*sdpa"):
        attention.attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), impl="flash-nope")


def test_duplicate_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        attention.register("naive", lambda q, k, v, is_causal=False: q)


@settings(max_examples=40, deadline=None)
@given(
    impl=st.sampled_from(["naive", "sdpa"]),
    lead=st.sampled_from([(), (3,), (2, 3)]),
    nq=st.integers(1, 70),
    nk=st.integers(1, 70),
    d=st.sampled_from([8, 16, 32, 64]),
    is_causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(impl, lead, nq, nk, d, is_causal, seed):
    if impl == "sdpa" and not lead:
        lead = (1,)  # SDPA needs at least one leading dim
    if is_causal and nq > nk:
        nq = nk  # keep every query row with at least one visible key (no fully masked rows)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, nq, d, generator=g)
    k = torch.randn(*lead, nk, d, generator=g)
    v = torch.randn(*lead, nk, d, generator=g)
    out = attention.attention(q, k, v, is_causal=is_causal, impl=impl)
    assert out.shape == (*lead, nq, d)
    torch.testing.assert_close(out.double(), reference(q, k, v, is_causal), rtol=1e-4, atol=1e-4)


def test_causal_alignment_is_top_left_when_nq_differs_from_nk():
    q, k, v = torch.randn(1, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    out = attention.attention(q, k, v, is_causal=True, impl="naive")
    # Query 0 sees only key 0, so its output is exactly v[0].
    torch.testing.assert_close(out[0, 0], v[0, 0])
    torch.testing.assert_close(out, attention.attention(q, k, v, is_causal=True, impl="sdpa"), rtol=1e-5, atol=1e-5)


def test_naive_gradients_match_sdpa():
    torch.manual_seed(0)
    inputs = [torch.randn(2, 4, 33, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    grads = []
    for impl in ("naive", "sdpa"):
        out = attention.attention(*inputs, is_causal=True, impl=impl)
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
