"""Probe (fifth session): the host time of torch.compile(FlashAttentionTriton.apply) per call.

The leaderboard trace (launch_trace_probe.py) showed ~0.3 ms from the round's start to the compiled
forward's first kernel. Here, at a small shape (B*H = 1, N = 1024, d = 64, bf16, causal: the GPU work
is shorter than the host's), per-call host times of the compiled and eager paths, and a cProfile of the
compiled forward+backward, sorted by cumulative and by internal time.
    PYTHONPATH=$PWD python results/h100/probes/compiled_host_probe.py OUT_DIR
"""

import cProfile
import io
import json
import pstats
import sys

import torch

from cs336_systems.attention import flash_triton

sys.path.insert(0, "results/h100/probes")
from launch_trace_probe import per_call_us  # noqa: E402


def main(out_dir):
    q, k, v = (torch.randn(1, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    compiled = torch.compile(flash_triton.FlashAttentionTriton.apply, fullgraph=True, dynamic=False)
    eager = flash_triton.FlashAttentionTriton.apply
    res = {}
    for name, fn in (("compiled", compiled), ("eager", eager)):
        def fwd(fn=fn):
            with torch.no_grad():
                fn(q, k, v, True)

        def fwd_grad(fn=fn):
            fn(q, k, v, True)

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(q, k, v, True), (q, k, v), do)

        res[f"{name} fwd (no grad)"] = per_call_us(fwd)
        res[f"{name} fwd (grad, no bwd)"] = per_call_us(fwd_grad)
        res[f"{name} fwd+bwd"] = per_call_us(fwd_bwd)
        print(res, flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fwd_bwd()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        open(f"{out_dir}/cprofile-{name}-fwd-bwd.txt", "w").write(text.getvalue())
    json.dump(res, open(f"{out_dir}/compiled-host-probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
