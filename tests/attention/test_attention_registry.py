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


@pytest.mark.parametrize("impl", ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
def test_implementation_unavailable_on_the_inputs_device_is_refused(impl):
    """Pinned SDPA backends are CUDA kernels: on CPU tensors sdpa-cudnn / sdpa-efficient used to fail deep
    inside torch and sdpa-flash to run another kernel silently.  The registry refuses them up front."""
    q = torch.randn(1, 2, 16, 32)
    with pytest.raises(ValueError, match=rf"attention implementation '{impl}' is not available on device cpu; "
                                         r"available there: naive, naive-compiled, sdpa, .*flash-pytorch"):
        attention.attention(q, q, q, is_causal=True, impl=impl)
    with pytest.raises(ValueError, match=rf"'{impl}' is not available on device cpu"):
        attention.check_available(impl, "cpu")
    assert impl not in attention.available("cpu")


def test_check_available_names_head_dims_and_the_alternatives(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # flash-triton available on the CPU
    assert attention.check_available("flash-triton", "cpu", head_dim=64).name == "flash-triton"
    assert attention.check_available("flash-triton", "cpu", head_dim=80).name == "flash-triton"
    for bad in (84, 264):
        with pytest.raises(ValueError, match=rf"'flash-triton' supports head dims multiples of 8 from 8 to 256, got "
                                             rf"head_dim={bad}; available on device cpu for head_dim={bad}: naive, .*sdpa"):
            attention.check_available("flash-triton", "cpu", head_dim=bad)
    assert attention.check_available("naive", "meta", head_dim=84).name == "naive"


@pytest.mark.parametrize("is_causal", ["false", "False", "", 0, 1, None, 1.0])
@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash-pytorch"])
def test_is_causal_must_be_a_bool(impl, is_causal):
    """A string is truthy: is_causal="false" used to run causal attention."""
    q = torch.randn(1, 6, 8)
    with pytest.raises(ValueError, match=r"is_causal must be a bool \(True or False\), got"):
        attention.attention(q, q, q, is_causal=is_causal, impl=impl)


@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash-pytorch"])
def test_zero_head_dim_is_refused(impl):
    q = torch.randn(2, 5, 0)
    with pytest.raises(ValueError, match=r"head dim d \(the last dim of q, k, v\) must be >= 1; got q \(2, 5, 0\)"):
        attention.attention(q, q, q, impl=impl)


EMPTY_SHAPES = [((2, 0, 16), (2, 5, 16)), ((2, 5, 16), (2, 0, 16)), ((0, 5, 16), (0, 5, 16)),
                ((0, 2, 5, 16), (0, 2, 5, 16)), ((2, 3, 0, 16), (2, 3, 7, 16)), ((1, 0, 16), (1, 0, 16))]


@pytest.mark.parametrize("impl", ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
@pytest.mark.parametrize("q_shape, kv_shape", EMPTY_SHAPES)
def test_pinned_sdpa_handles_empty_problems(impl, q_shape, kv_shape):
    """No queries, no keys or an empty batch: what the reference gives (empty, or zeros for queries with no
    key), with gradients, instead of reshape's "cannot reshape tensor of 0 elements" (the kernels are never
    called for these, so this runs on any device)."""
    q = torch.randn(q_shape, requires_grad=True)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    for causal in (False, True):
        out = attention.get(impl).fn(q, k, v, is_causal=causal)
        assert out.shape == q.shape
        assert not out.any()
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
        for g, t in zip(grads, (q, k, v)):
            assert g is None or (g.shape == t.shape and not g.any())


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flash-triton", "naive", "sdpa"])
@pytest.mark.parametrize("q_shape, kv_shape", EMPTY_SHAPES)
def test_gpu_empty_problems_through_the_registry(impl, q_shape, kv_shape):
    q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    if impl == "flash-triton" and q.numel() and not k.shape[-2]:
        with pytest.raises(ValueError, match="flash-triton needs Nk >= 1"):
            attention.attention(q, k, v, is_causal=True, impl=impl)
        return
    out = attention.attention(q, k, v, is_causal=True, impl=impl)
    assert out.shape == q.shape and not out.any()
    out.sum().backward()


@pytest.mark.gpu
def test_gpu_pinned_backend_without_a_kernel_for_the_inputs_is_refused_with_the_reason():
    q = torch.randn(1, 2, 128, 64, device="cuda")  # float32: FlashAttention-2 and cuDNN take none
    for impl in ("sdpa-flash", "sdpa-cudnn"):
        with pytest.raises(ValueError, match=rf"'{impl}' does not support these inputs on device cuda.*float32.*"
                                             r"implementations that do: naive"):
            attention.attention(q, q, q, is_causal=True, impl=impl)
    assert attention.attention(q, q, q, is_causal=True, impl="sdpa-efficient").shape == q.shape


# naive-compiled is torch.compile of naive's code (~5.5 s to compile both passes): slow, as .ci/run runs it.
@pytest.mark.parametrize("impl", ["naive", pytest.param("naive-compiled", marks=pytest.mark.slow), "sdpa"])
def test_grouped_query_attention_matches_repeated_heads(impl):
    """k, v with fewer heads than q: the implementations that take it agree with MHA on K/V repeated per group
    (query head h reads K/V head h // group), values and gradients."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 20, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 20, 16, generator=g, requires_grad=True) for _ in range(2))
    out = attention.attention(q, k, v, is_causal=True, impl=impl)
    rep = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = attention.attention(rep[0], rep[1].repeat_interleave(3, dim=1), rep[2].repeat_interleave(3, dim=1),
                                   is_causal=True, impl="naive")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, rep, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_implementation_without_grouped_query_attention_refuses_it():
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"'flash-pytorch' does not support grouped-query attention .*4 query heads, "
                                         r"2 K/V heads\); implementations that do on device cpu: naive, naive-compiled, "
                                         r"sdpa"):
        attention.attention(q, kv, kv, impl="flash-pytorch")


def test_a_compiled_first_call_of_flash_triton_does_not_recompile_its_caller(monkeypatch):
    """The registry's flash-triton entry imports its implementation on first use.  When that first use is
    traced, it must not leave the module global set behind: torch.compile guards on it, so the next call
    would fail the guard and compile the caller's frame again (every block of a compiled model, once)."""
    monkeypatch.setattr(attention, "_flash_triton_fn", None)
    torch._dynamo.reset()
    entry = attention.get("flash-triton").fn
    compiled = torch.compile(lambda q, k, v: entry(q, k, v, is_causal=True), backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    first = compiled(q, k, v)
    assert attention._flash_triton_fn is None  # the traced call kept nothing
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(q, k, v), first)
    entry(q, k, v, is_causal=True)  # an eager call keeps the function for its successors
    assert attention._flash_triton_fn is not None
    torch._dynamo.reset()
