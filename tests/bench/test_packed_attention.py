"""The packed-attention workload (bench/workloads/packed_attention.py): every implementation is checked against
the float64 reference on each document alone before it is timed; what one cannot take is Unsupported."""

import pytest
import torch

from cs336_systems.attention import flash_triton
from cs336_systems.bench.workloads import packed_attention as packed
from cs336_systems.bench.workloads.attention import Unsupported

CPU = torch.device("cpu")
CASE = dict(total=96, docs=5, heads=2, head_dim=16, dtype="fp32", device=CPU)
needs_flash = pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="flash-triton on CPU: the interpreter")


@needs_flash
@pytest.mark.parametrize("impl, causal, mode", [("flash-varlen", True, "forward-backward"),
                                                ("flash-varlen", False, "forward"),
                                                ("flash-padded", True, "forward-backward"),
                                                ("sdpa-nested", False, "forward-backward")])
def test_implementations_pass_their_check_and_step(impl, causal, mode):
    packed.packed_step(impl=impl, causal=causal, mode=mode, **CASE)()


@pytest.mark.parametrize("impl, causal, mode, reason", [("sdpa-nested", True, "forward", "refuses is_causal"),
                                                        ("flash-padded", False, "forward", "causal cases only"),
                                                        ("flex-document", True, "forward-backward", "no backward")])
def test_what_an_implementation_cannot_take_is_unsupported(impl, causal, mode, reason):
    with pytest.raises(Unsupported, match=reason):
        packed.packed_step(impl=impl, causal=causal, mode=mode, **CASE)


def test_a_wrong_implementation_fails_its_check_before_timing(monkeypatch):
    monkeypatch.setattr(packed, "_function", lambda impl, cu, lengths, causal: lambda q, k, v: q * 1.0)
    with pytest.raises(AssertionError, match="o is off by"):
        packed.packed_step(impl="flash-varlen", causal=True, mode="forward", **CASE)


def test_the_reference_treats_each_document_alone():
    q = torch.randn(7, 1, 8, dtype=torch.float64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    (o,) = packed.reference(q, q, q, None, cu, causal=False)
    first = torch.softmax(q[:3, 0] @ q[:3, 0].T / 8 ** 0.5, -1) @ q[:3, 0]
    torch.testing.assert_close(o[:3, 0], first)


@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_in_chunks_of_heads_matches_all_heads_at_once(monkeypatch, causal):
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(40, 3, 8, generator=g) for _ in range(4))
    cu = torch.tensor([0, 1, 25, 40], dtype=torch.int32)
    whole = packed.reference(q, k, v, do, cu, causal)
    monkeypatch.setattr(packed, "REFERENCE_CHUNK_BYTES", 1)  # one head a chunk
    for a, b in zip(packed.reference(q, k, v, do, cu, causal), whole, strict=True):
        torch.testing.assert_close(a, b)
    # and the chunks give what autograd over the documents written out gives
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    outs = []
    for s, e in ((0, 1), (1, 25), (25, 40)):
        scores = torch.einsum("qhd,khd->hqk", q64[s:e], k64[s:e]) / 8 ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64[s:e]))
    o = torch.cat(outs)
    for a, b in zip(whole, (o, *torch.autograd.grad(o, (q64, k64, v64), do.double())), strict=True):
        torch.testing.assert_close(a, b.detach())
