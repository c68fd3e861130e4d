"""FlashAttentionPytorch (tiled forward, compiled recomputing backward) against a float64 reference.

Tolerance rule (FlashAttention's): the error of O, L, dQ, dK, dV against float64 may be at most twice
the error PyTorch's own naive attention makes in the same dtype, plus a small floor (which only matters
where the naive error happens to be ~0, e.g. Nk = 1: with one key softmax's backward is exactly zero in
PyTorch, while FlashAttention's D = rowsum(O∘dO) and dP = dO·Vᵀ round differently, so dS = P∘(dP − D)
is rounding noise that dK sums over every query).  The floor is relative to the example's largest
reference value, the scale those rounding errors are measured in.
"""

import contextlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import max_examples

from cs336_systems.attention import flash_pytorch
from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch, flash_attention_pytorch
from cs336_systems.attention.naive import naive_attention

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def reference(q, k, v, do, is_causal):
    """float64 O, L, dQ, dK, dV with the handout's -1e6 mask, computed independently of the package."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        s = torch.where(i >= j, s, torch.tensor(-1e6, dtype=s.dtype))
    o = torch.einsum("...qk,...kd->...qd", torch.softmax(s, -1), v)
    grads = torch.autograd.grad(o, (q, k, v), do.double())
    return (o.detach(), torch.logsumexp(s, -1).detach(), *grads)


def naive_scores(q, k, is_causal):
    """Scaled, masked scores in the inputs' dtype, as the naive implementation forms them."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        # -1e6 does not fit float16 (masked_fill raises), so there the mask uses float16's lowest value.
        s = s.masked_fill(i < j, max(-1e6, torch.finfo(s.dtype).min))
    return s


def naive_same_dtype(q, k, v, do, is_causal):
    """The same five quantities from the naive implementation in the inputs' dtype (the error baseline)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if is_causal and q.dtype == torch.float16:
        # naive_attention itself fails here (its -1e6 mask overflows float16): the same steps inline.
        o = torch.softmax(naive_scores(q, k, is_causal), dim=-1) @ v
    else:
        o = naive_attention(q, k, v, is_causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    with torch.no_grad():
        lse = torch.logsumexp(naive_scores(q, k, is_causal), -1)
    return (o.detach(), lse, *grads)


def flash(q, k, v, do, is_causal):
    """O, the saved L, and dQ, dK, dV from FlashAttentionPytorch."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = FlashAttentionPytorch.apply(q, k, v, is_causal)
    lse = o.grad_fn.saved_tensors[4]
    grads = torch.autograd.grad(o, (q, k, v), do)
    return (o.detach(), lse, *grads)


def max_error(x, ref):
    return (x.double() - ref).abs().max().item() if ref.numel() else 0.0


def random_qkv(lead, nq, nk, d, dtype, q_scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, nq, d, generator=g) * q_scale  # larger scale: peakier softmax, more rescaling
    k = torch.randn(*lead, nk, d, generator=g)
    v = torch.randn(*lead, nk, d, generator=g)
    do = torch.randn(*lead, nq, d, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, do))


@contextlib.contextmanager
def tile_sizes(q_tile, k_tile, backward_k_tile):
    """Temporarily set the module's tile sizes (read at call time), so small inputs span many tiles."""
    names = ("Q_TILE", "K_TILE", "BACKWARD_K_TILE")
    saved = [getattr(flash_pytorch, name) for name in names]
    for name, value in zip(names, (q_tile, k_tile, backward_k_tile)):
        setattr(flash_pytorch, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(flash_pytorch, name, value)


def check_against_reference(lead, nq, nk, d, is_causal, dtype, q_scale, seed):
    q, k, v, do = random_qkv(lead, nq, nk, d, dtype, q_scale, seed)
    ref = reference(q, k, v, do, is_causal)
    ours = flash(q, k, v, do, is_causal)
    baseline = naive_same_dtype(q, k, v, do, is_causal)
    expected_dtypes = (dtype, torch.float32, dtype, dtype, dtype)
    floor = FLOOR[dtype] * max([1.0] + [r.abs().max().item() for r in ref if r.numel()])
    for name, x, r, b, want in zip(("O", "L", "dQ", "dK", "dV"), ours, ref, baseline, expected_dtypes):
        assert x.shape == r.shape, name
        assert x.dtype == want, name
        err, naive_err = max_error(x, r), max_error(b, r)
        assert err <= 2 * naive_err + floor, (
            f"{name}: error {err:.3g} vs naive {naive_err:.3g} ({dtype}, lead {lead}, Nq {nq}, Nk {nk}, d {d}, "
            f"causal {is_causal})"
        )


# Leading dims: none up to three; lengths 1..150 span one to ten tiles (with ragged edges) of the
# default 128 rows or of the smaller tile sizes drawn below (forward Q x K tile, backward key block).
leads = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)
lengths = st.integers(1, 150)
tiles = st.sampled_from([None, (16, 16, 16), (16, 48, 32), (64, 32, 64)])


@settings(max_examples=max_examples(25), deadline=None)
@given(
    lead=leads,
    nq=lengths,
    nk=lengths,
    d=st.sampled_from([16, 32, 64]),
    is_causal=st.booleans(),
    q_scale=st.sampled_from([0.5, 1.0, 4.0]),
    tile=tiles,
    seed=st.integers(0, 2**31 - 1),
)
# found by Hypothesis: one key, many queries, a peaky q; PyTorch's dK error is exactly 0 there (module docstring)
@example(lead=(), nq=126, nk=1, d=32, is_causal=False, q_scale=4.0, tile=None, seed=0)
def test_float32_matches_float64_reference(lead, nq, nk, d, is_causal, q_scale, tile, seed):
    with tile_sizes(*tile) if tile else contextlib.nullcontext():
        check_against_reference(lead, nq, nk, d, is_causal, torch.float32, q_scale, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@settings(max_examples=max_examples(5), deadline=None)
@given(
    lead=st.lists(st.integers(1, 2), min_size=1, max_size=2).map(tuple),
    nq=st.integers(1, 100),
    nk=st.integers(1, 100),
    d=st.sampled_from([16, 32, 64]),
    is_causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_half_precision_matches_float64_reference(dtype, lead, nq, nk, d, is_causal, seed):
    check_against_reference(lead, nq, nk, d, is_causal, dtype, 1.0, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_saves_exactly_q_k_v_o_and_logsumexp(dtype):
    q, k, v, _ = random_qkv((2, 3), 70, 90, 32, dtype, 1.0, seed=0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attention_pytorch(q, k, v, is_causal=True)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    for got, want in zip(saved[:4], (q, k, v, out)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)
    lse = saved[4]
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32


def test_sum_backward_and_top_left_causal_alignment():
    # .sum() hands backward an expanded (stride-0) dO; query 0 sees only key 0, so o[..., 0, :] = v[..., 0, :].
    q, k, v, _ = random_qkv((2,), 3, 200, 16, torch.float32, 1.0, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attention_pytorch(q, k, v, is_causal=True)
    torch.testing.assert_close(out[:, 0], v[:, 0].detach())
    out.sum().backward()
    ref = reference(q, k, v, torch.ones_like(out), is_causal=True)
    for x, r in zip((q.grad, k.grad, v.grad), ref[2:]):
        torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-5)
    # Keys 3.. are seen by no query.
    assert not k.grad[:, 3:].any() and not v.grad[:, 3:].any()


def test_autocast_does_not_change_the_float32_computation():
    """Under bf16 autocast the forward and backward still compute in float32 (the backward recomputes
    P from L: both must come from the same float32 scores)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, 32, generator=gen, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 70, 32, generator=gen)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = FlashAttentionPytorch.apply(q, k, v, True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for plain, autocast in zip(*results):
        assert autocast.dtype == torch.float32
        torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_meta_tensors_give_shapes_only():
    """Meta-device model builds (shape checks, memory planning) run attention on meta tensors."""
    q = torch.empty(2, 3, 40, 16, device="meta")
    out = flash_attention_pytorch(q, q, q, True)
    assert out.device.type == "meta" and out.shape == q.shape


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    """The recomputing backward builds no graph: a create_graph=True backward through it would give
    gradients whose own derivatives miss every term through attention (silently), so it raises."""
    q, k, v = (torch.randn(1, 16, 16, requires_grad=True) for _ in range(3))
    for loss in (lambda o: o.square().sum(), lambda o: o.sum()):  # dO with and without a graph of its own
        out = FlashAttentionPytorch.apply(q, k, v, True)
        with pytest.raises(RuntimeError, match="flash-pytorch does not support double backward"):
            torch.autograd.grad(loss(out), q, create_graph=True)
    # a plain backward still works afterwards, with no graph on its gradients
    out = FlashAttentionPytorch.apply(q, k, v, True)
    (dq,) = torch.autograd.grad(out.square().sum(), q)
    assert dq.shape == q.shape and not dq.requires_grad


@pytest.mark.parametrize("is_causal", [False, True])
def test_float64_computes_in_float64(is_causal):
    """float64 in, float64 arithmetic (not float32 and back): O, L, dQ, dK, dV within 1e-12 of the reference."""
    with tile_sizes(16, 32, 16):  # several tiles each way
        q, k, v, do = random_qkv((2,), 70, 90, 32, torch.float64, 1.0, seed=4)
        ours = flash(q, k, v, do, is_causal)
    ref = reference(q, k, v, do, is_causal)
    for name, x, r in zip(("O", "L", "dQ", "dK", "dV"), ours, ref):
        assert x.dtype == torch.float64, name
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("is_causal", ["false", 1, None])
def test_is_causal_must_be_a_bool(is_causal):
    q = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match=r"is_causal must be a bool \(True or False\), got"):
        FlashAttentionPytorch.apply(q, q, q, is_causal)


def test_no_keys_gives_zeros_like_the_naive_reference():
    q, k, v = torch.randn(2, 5, 16), torch.zeros(2, 0, 16), torch.zeros(2, 0, 16)
    out = flash_attention_pytorch(q, k, v)
    torch.testing.assert_close(out, naive_attention(q, k, v))


@pytest.mark.parametrize(
    "q, k, v, match",
    [
        (torch.zeros(2, 4, 16), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), "head dim"),
        (torch.zeros(2, 4, 16, dtype=torch.int64),) * 3 + ("floating-point",),
    ],
)
def test_bad_inputs_raise_value_error(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        flash_attention_pytorch(q, k, v)
