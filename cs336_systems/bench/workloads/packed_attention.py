"""What the packed-attention benchmarks time: attention over documents packed into one row, by implementation.

    packed_step(impl, total, docs, heads, head_dim, dtype, causal, mode, device) -> step()

The documents are `lm.document_lengths(total, docs, total)` (a fixed long-tailed draw summing to ``total``
tokens); every implementation computes the same attention, within each document:

  "flash-varlen"   `flash_attention_varlen` on the packed (total, H, d) tensors and the offsets
  "flex-document"  FlexAttention (torch.compile'd) over the one packed row with a document mask (and the
                   causal one), its BlockMask built once, outside the timed step
  "sdpa-nested"    SDPA on jagged nested tensors, one document a row (PyTorch's own varlen path; torch 2.13
                   refuses ``is_causal`` for nested queries, so causal cases are unsupported)
  "flash-padded"   flash-triton on the documents padded to the longest, one a row (causal only: the padding
                   sits after each document's keys, where no query of the document looks)

The first call is checked against the float64 reference computed on each document alone (`reference`):
O, and dQ, dK, dV in the forward-backward mode, within the dtype's tolerance of the largest value.  An
implementation that cannot take a case raises `Unsupported` (a skip, with the reason).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cs336_systems.bench.workloads.attention import TOLERANCE, DTYPES, Unsupported
from cs336_systems.bench.workloads.lm import document_lengths

IMPLS = ("flash-varlen", "flex-document", "sdpa-nested", "flash-padded")
MODES = ("forward", "forward-backward")


REFERENCE_CHUNK_BYTES = 2 * 2**30  # float64 scores, probabilities and their gradient for one chunk of heads


def reference(q, k, v, do, cu, causal: bool) -> list[torch.Tensor]:
    """O (and dQ, dK, dV when ``do`` is given) in float64, each document computed alone; q, k, v (total, H, d)
    with as many K/V heads as query heads.  A long document's (H, L, L) float64 scores alone would not fit
    (16 heads of 12k tokens: 17 GiB), so heads go in chunks of about REFERENCE_CHUNK_BYTES, each chunk's
    gradients taken before the next."""
    backward = do is not None
    outs = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in ((q, q, k, v) if backward else (q,))]
    heads = q.shape[1]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = end - start
        chunk = max(1, min(heads, REFERENCE_CHUNK_BYTES // (3 * 8 * n * n)))
        for h in (slice(h0, h0 + chunk) for h0 in range(0, heads, chunk)):
            qq, kk, vv = (t[start:end, h].detach().double().transpose(0, 1).requires_grad_(backward)
                          for t in (q, k, v))
            scores = qq @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            o = scores.softmax(-1) @ vv
            outs[0][start:end, h] = o.detach().transpose(0, 1)
            if backward:
                grads = torch.autograd.grad(o, (qq, kk, vv), do[start:end, h].double().transpose(0, 1))
                for out, grad in zip(outs[1:], grads):
                    out[start:end, h] = grad.transpose(0, 1)
    return outs


def _function(impl: str, cu: torch.Tensor, lengths: list[int], causal: bool) -> Callable:
    """o = fn(q, k, v) for packed (total, H, d) tensors."""
    longest = max(lengths)
    if impl == "flash-varlen":
        from cs336_systems.attention.flash_varlen import flash_attention_varlen

        return lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal)
    if impl == "flex-document":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device),
                                      torch.tensor(lengths, device=cu.device))

        def mask(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        total = int(cu[-1])
        block_mask = create_block_mask(mask, None, None, total, total, device=cu.device)
        flex = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                    block_mask=block_mask)[0].transpose(0, 1)
    if impl == "sdpa-nested":
        if causal:
            raise Unsupported("SDPA on nested tensors refuses is_causal (torch's nested SDPA)")

        def nested(q, k, v):
            parts = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*parts)
            return out.transpose(1, 2).values()

        return nested
    if impl == "flash-padded":
        if not causal:
            raise Unsupported("flash-padded takes causal cases only (without the mask queries would see padding)")
        from cs336_systems.attention.flash_triton import flash_attention

        starts = cu[:-1].tolist()
        rows = torch.arange(longest, device=cu.device)[None] < torch.tensor(lengths, device=cu.device)[:, None]
        index = (torch.tensor(starts, device=cu.device)[:, None] + torch.arange(longest, device=cu.device)[None])[rows]

        def padded(q, k, v):
            def pad(t):  # (total, H, d) -> (D, H, longest, d), zeros past each document
                out = t.new_zeros(len(lengths), longest, *t.shape[1:])
                out[rows] = t[index]
                return out.transpose(1, 2)

            o = flash_attention(pad(q), pad(k), pad(v), True)
            return o.transpose(1, 2)[rows]

        return padded
    raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(IMPLS)}")


def packed_step(*, impl: str, total: int, docs: int, heads: int, head_dim: int, dtype: str, causal: bool,
                mode: str, device: torch.device, seed: int = 0) -> Callable[[], None]:
    """One step of ``mode`` over the packed documents (module docstring), checked once against `reference`."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    lengths = document_lengths(total, docs, total, seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    backward = mode == "forward-backward"
    q, k, v = (torch.randn(total, heads, head_dim, generator=g).to(device, DTYPES[dtype]).requires_grad_(backward)
               for _ in range(3))
    do = torch.randn(total, heads, head_dim, generator=g).to(device, DTYPES[dtype])
    if impl == "flex-document" and backward and device.type == "cpu":
        raise Unsupported("FlexAttention has no backward on the CPU")
    fn = _function(impl, cu, lengths, causal)
    got = [fn(q, k, v)]
    if backward:
        got += list(torch.autograd.grad(got[0], (q, k, v), do))
    want = reference(q, k, v, do if backward else None, cu, causal)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        error = float((a.detach().double() - b).abs().max()) / max(float(b.abs().max()), 1e-30)
        if not error <= TOLERANCE[dtype]:
            raise AssertionError(f"{impl}: {name} is off by {error:.2e} of its largest value against the float64 "
                                 f"reference (tolerance {TOLERANCE[dtype]:.0e})")
    got = want = None

    def step() -> None:
        o = fn(q, k, v)
        if backward:
            torch.autograd.grad(o, (q, k, v), do)

    return step


def lengths_of(total: int, docs: int, seed: int = 0) -> list[int]:
    """The documents' lengths of a case (for its FLOP count)."""
    return document_lengths(total, docs, total, seed)
