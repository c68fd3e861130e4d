"""Probe: per-call time of a small flash-triton forward+backward, eager fast path vs the registered ops.

Each round runs CALLS back-to-back forward+backward calls (B*H = 1, causal, bf16), so a host-bound
implementation shows its host time per call.  Timed with the shared harness (cs336_systems.benchmarking).
    PYTHONPATH=$PWD python results/h100/probes/host_overhead_probe.py OUT.json
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems import benchmarking
from cs336_systems.attention import flash_triton

CALLS = 50


def main(out):
    results = []
    fast_path = flash_triton._eager
    for n, d in [(1024, 64), (4096, 64), (1024, 128), (4096, 128)]:
        q, k, v = (torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16)

        def triton_fn():
            return flash_triton.FlashAttentionTriton.apply(q, k, v, True)

        def sdpa_fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for name, fn, eager in [("flash-triton eager path", triton_fn, True), ("flash-triton via ops", triton_fn, False),
                                ("sdpa-flash", sdpa_fn, True)]:
            flash_triton._eager = fast_path if eager else (lambda t: False)

            def setup(fn=fn):
                def step():
                    for _ in range(CALLS):
                        fn().backward(grad)
                return step

            m = benchmarking.measure(setup, warmup=3, rounds=10, device="cuda")
            per_call_us = m.stats.median / CALLS * 1e6
            results.append({"n": n, "d": d, "impl": name, "fwd+bwd us per call": round(per_call_us, 1)})
            print(results[-1], flush=True)
    json.dump(results, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
