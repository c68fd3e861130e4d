"""flash_attention_varlen (cs336_systems.attention.flash_varlen): packed sequences against the float64
reference run on each sequence alone, forward and backward, grouped heads, empty and one-token sequences,
causal or not; bad offsets refused naming the argument; torch.compile(fullgraph=True).  On CPU the kernels
run in Triton's interpreter (float32, float16); the GPU tests add bfloat16 and longer sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import max_examples

from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_varlen import flash_attention_varlen

CPU = torch.device("cpu")
INTERPRETED = pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED,
                                 reason="the interpreter's CPU run (TRITON_INTERPRET=1)")


def packed(lengths, heads, kv_heads, d, dtype, device, seed, k_lengths=None):
    """q (total_q, H, d), k, v (total_k, H_kv, d) leaves, dO, and the int32 offsets of both."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k_lengths = lengths if k_lengths is None else k_lengths
    cu_q = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, d, generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, d, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, generator=g).to(device, dtype)
    return q, k, v, do, cu_q.to(device), cu_k.to(device)


def per_sequence_reference(q, k, v, do, cu_q, cu_k, causal):
    """O, dQ, dK, dV in float64: each sequence's attention computed alone (top-left causal alignment)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs:
            continue
        qq = q64[qs:qe].transpose(0, 1)
        kk, vv = (t[ks:ke].transpose(0, 1).repeat_interleave(group, 0) for t in (k64, v64))
        scores = qq @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))
    o = torch.cat(outs) if outs else q64.new_zeros(q.shape)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.double(), allow_unused=True)
    return (o, *[g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (q64, k64, v64))])


def assert_matches(q, k, v, do, cu_q, cu_k, causal, fn=flash_attention_varlen):
    n_q, n_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    o = fn(q, k, v, cu_q, cu_k, int(n_q.max()) if n_q.numel() else 0, int(n_k.max()) if n_k.numel() else 0, causal)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    want = [t.detach() for t in per_sequence_reference(q, k, v, do, cu_q, cu_k, causal)]
    tol = 2e-4 if q.dtype == torch.float32 else 2e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        scale = max(float(b.abs().max()), 1.0)
        assert float((a.double() - b).abs().max()) <= tol * scale, (name, float((a.double() - b).abs().max()))


@INTERPRETED
@settings(deadline=None, max_examples=max_examples(12))
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=5), heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
       d=st.sampled_from([16, 24, 64]), causal=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16]),
       seed=st.integers(0, 2**16))
def test_packed_sequences_match_each_sequence_alone(lengths, heads, d, causal, dtype, seed):
    if sum(lengths) == 0:
        lengths = [*lengths, 1]
    assert_matches(*packed(lengths, *heads, d, dtype, CPU, seed), causal)


@INTERPRETED
@pytest.mark.parametrize("lengths", [[1], [1, 1, 1, 1], [0, 5, 0, 0, 3], [130, 1, 2]])
def test_one_token_empty_and_uneven_sequences(lengths):
    assert_matches(*packed(lengths, 2, 1, 32, torch.float32, CPU, 7), True)


@INTERPRETED
@pytest.mark.parametrize("causal", [True, False])
def test_wide_rows_take_the_small_tiles_and_match(causal):
    # float32 at d 128: 512-byte rows, the 32 x 32 tiles (portable.varlen.tiles)
    from cs336_systems.attention.kernels.portable import varlen

    assert varlen.tiles(torch.float32, 128)[:2] == (32, 32) and varlen.tiles(torch.bfloat16, 128)[:2] == (64, 64)
    assert varlen.tiles(torch.bfloat16, 256)[:2] == (32, 32) and varlen.tiles(torch.float32, 256)[3] == 1
    # dK/dV takes 128-key tiles where a row is at most 128 bytes (16-bit d <= 64), the others keep theirs
    assert varlen.tiles(torch.bfloat16, 64, "dkdv") == (32, 128, 4, 3) == varlen.tiles(torch.float32, 32, "dkdv")
    assert varlen.tiles(torch.bfloat16, 64, "dq") == varlen.tiles(torch.bfloat16, 64, "fwd") == (64, 64, 4, 3)
    assert varlen.tiles(torch.bfloat16, 128, "dkdv") == (64, 64, 4, 3)
    with pytest.raises(ValueError, match="kernel must be one of .*got 'bwd'"):
        varlen.tiles(torch.bfloat16, 64, "bwd")
    assert_matches(*packed([1, 45, 0, 70], 4, 2, 128, torch.float32, CPU, 9), causal)


@INTERPRETED
def test_more_keys_than_queries_per_sequence():
    assert_matches(*packed([3, 40], 2, 2, 32, torch.float32, CPU, 3, k_lengths=[10, 50]), False)


@INTERPRETED
def test_compiled_fullgraph_matches_eager_at_two_packings():
    compiled = torch.compile(flash_attention_varlen, fullgraph=True)
    for lengths in ([5, 17, 2], [40, 1, 9, 30]):
        assert_matches(*packed(lengths, 2, 1, 32, torch.float32, CPU, 11), True, fn=compiled)


@INTERPRETED
@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 9, 5, 20], dtype=torch.int32)}, "cu_seqlens_q must not decrease"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 5, 9, 19], dtype=torch.int32)}, "cu_seqlens_q must end at the token count 20"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([1, 5, 9, 20], dtype=torch.int32)}, "cu_seqlens_k must start at 0"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "cu_seqlens_q must be a 1-D int32 tensor"),
    (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:-1]}, "one length"),
    (lambda a: {**a, "max_seqlen_q": 4}, "max_seqlen_q = 4 is below the longest sequence's 11 tokens"),
    (lambda a: {**a, "max_seqlen_k": -1}, "max_seqlen_k must be an int >= 0"),
    (lambda a: {**a, "is_causal": 1}, "is_causal must be a bool"),
    (lambda a: {**a, "q": a["q"][None]}, "q must be a .tokens, heads, head_dim. tensor"),
    (lambda a: {**a, "k": a["k"][:, :1], "v": a["v"][:, :1]}, None),  # grouped: 1 K/V head for 2 query heads, fine
    (lambda a: {**a, "k": torch.randn(20, 3, 32), "v": torch.randn(20, 3, 32)}, "k's heads .3. must divide q's .2."),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 9, 9, 20], dtype=torch.int32),
                "cu_seqlens_q": torch.tensor([0, 4, 9, 20], dtype=torch.int32)}, "sequence 1 has 5 queries and no keys"),
])
def test_bad_arguments_are_refused_naming_them(change, match):
    q, k, v, _, cu_q, cu_k = packed([4, 5, 11], 2, 2, 32, torch.float32, CPU, 1)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=11, max_seqlen_k=11, is_causal=True)
    args = change(args)
    if match is None:
        flash_attention_varlen(**args)
        return
    with pytest.raises(ValueError, match=match):
        flash_attention_varlen(**args)


@INTERPRETED
def test_offsets_are_read_once_until_they_change(monkeypatch):
    """The value checks read the offsets on the host (a synchronization): the same unchanged pair is read once;
    an in-place change, other sizes or other tensors are read again."""
    from cs336_systems.attention import flash_varlen

    reads = []
    check = flash_varlen._check_offsets
    monkeypatch.setattr(flash_varlen, "_check_offsets", lambda name, *a: reads.append(name) or check(name, *a))
    q, k, v, _, cu_q, cu_k = packed([4, 5, 11], 2, 2, 32, torch.float32, CPU, 1)
    for _ in range(3):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 11, 11, True)
    assert reads == ["cu_seqlens_q", "cu_seqlens_k"]
    flash_attention_varlen(q, k, v, cu_q, cu_k, 12, 11, True)  # another max_seqlen_q: read again
    flash_attention_varlen(q, k, v, cu_q.clone(), cu_k, 11, 11, True)  # equal values, another tensor: read again
    assert len(reads) == 6
    cu_q[2] = 3  # in place: decreasing now
    with pytest.raises(ValueError, match="cu_seqlens_q must not decrease"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 11, 11, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_packed_documents_match_each_document_alone(dtype, causal):
    lengths = [1, 0, 700, 33, 2048, 5, 129]
    assert_matches(*packed(lengths, 8, 2, 64, dtype, torch.device("cuda"), 5), causal)
    assert_matches(*packed([300, 77], 4, 4, 128, dtype, torch.device("cuda"), 6), causal)
    assert_matches(*packed([200, 1, 90], 4, 1, 256, dtype, torch.device("cuda"), 7), causal)
