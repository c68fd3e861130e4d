"""Packed documents through the LM (model.Packing): one row of several documents gives each document the
logits, loss and gradients it gives alone (positions restart per document, attention stays within each
through flash_attention_varlen).  CPU: Triton's interpreter, float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems import model
from cs336_systems.attention import flash_triton

pytestmark = pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED and not torch.cuda.is_available(),
                                reason="flash-triton needs CUDA or the interpreter (TRITON_INTERPRET=1)")
LENGTHS = [5, 9, 1, 3]


def tiny(checkpoint="none"):
    torch.manual_seed(0)
    return model.build("tiny", attention="flash-triton", context_length=16, vocab_size=50, dtype=torch.float32,
                       checkpoint=checkpoint)


def documents(device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (n,), generator=g).to(device) for n in LENGTHS]


def test_packing_positions_offsets_and_boundary_targets():
    packing = model.Packing.of(LENGTHS)
    assert packing.cu_seqlens.tolist() == [0, 5, 14, 15, 18] and packing.cu_seqlens.dtype == torch.int32
    assert packing.max_seqlen == 9 and packing.total == 18
    assert packing.positions.tolist() == [*range(5), *range(9), 0, *range(3)]
    assert torch.nonzero(~packing.target_mask()).flatten().tolist() == [4, 13, 14, 17]
    with pytest.raises(ValueError, match="lengths must be one or more document lengths >= 1"):
        model.Packing.of([3, 0])


# with checkpointing the same comparison recomputes every block (~4 s): slow, as .ci/run runs it
@pytest.mark.parametrize("checkpoint", ["none", pytest.param("every-1", marks=pytest.mark.slow)])
def test_a_packed_row_gives_each_document_its_own_logits_loss_and_gradients(checkpoint):
    lm, docs = tiny(checkpoint), documents()
    packing = model.Packing.of(LENGTHS)
    row = torch.cat(docs)[None]
    logits = lm(row, packing=packing)[0]
    alone = torch.cat([lm(doc[None])[0] for doc in docs])
    torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)

    # next-token loss over each document's own targets, packed (the boundary targets masked) and alone
    targets = torch.cat([torch.cat([doc[1:], doc[:1]]) for doc in docs])  # the last target of each is masked
    keep = packing.target_mask()
    packed_loss = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
    grads = torch.autograd.grad(packed_loss, list(lm.parameters()))
    alone_loss = sum(F.cross_entropy(lm(doc[None])[0][:-1], doc[1:], reduction="sum") for doc in docs if len(doc) > 1)
    alone_grads = torch.autograd.grad(alone_loss, list(lm.parameters()))
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, alone_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_bad_packings_are_refused_naming_them():
    lm, docs = tiny(), documents()
    packing = model.Packing.of(LENGTHS)
    with pytest.raises(ValueError, match=r"packed tokens must have shape \(1, 18\)"):
        lm(torch.cat(docs)[None, :-1], packing=packing)
    with pytest.raises(ValueError, match="exceeds context_length=16"):
        lm(torch.zeros(1, 20, dtype=torch.int64), packing=model.Packing.of([3, 17]))
    naive = model.build("tiny", attention="naive", context_length=16, vocab_size=50, dtype=torch.float32)
    with pytest.raises(ValueError, match="packed documents need attention='flash-triton'"):
        naive(torch.cat(docs)[None], packing=packing)
