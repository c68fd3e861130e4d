"""Packed-attention benchmarks (cases from benchmarks.json; workload: cs336_systems.bench.workloads.packed_attention).

packed_attention  documents of a fixed long-tailed draw summing to `total` tokens, packed in one row, attention
                  within each document: flash-triton's varlen kernels against FlexAttention with a document
                  mask, SDPA on nested tensors (without the causal mask, which nested SDPA refuses) and
                  flash-triton on the documents padded to the longest (causal), in one run.  Tokens/s counts
                  the documents' tokens; the FLOPs are each document's attention.

Every case first checks its implementation against the float64 reference computed on each document alone;
a case an implementation cannot take is skipped with the reason.
"""

import pytest

from cs336_systems.bench import flops
from cs336_systems.bench.workloads import packed_attention as workloads
from cs336_systems.bench.workloads.attention import Unsupported


@pytest.mark.suite("packed_attention")
def test_packed_attention(case, bench, perf_device):
    lengths = workloads.lengths_of(case["total"], case["docs"])
    step_flops = sum(flops.attention_flops(case["heads"], n, n, case["head_dim"], causal=case["causal"],
                                           mode=case["mode"]) for n in lengths)
    try:
        bench(lambda: workloads.packed_step(
                  impl=case["impl"], total=case["total"], docs=case["docs"], heads=case["heads"],
                  head_dim=case["head_dim"], dtype=case["dtype"], causal=case["causal"], mode=case["mode"],
                  device=perf_device),
              case=case, flops_per_step=step_flops, tokens=case["total"])
    except Unsupported as exc:  # raised before any timing
        pytest.skip(str(exc))
