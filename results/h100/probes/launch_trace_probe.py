"""Probe (fifth session): where the leaderboard backward's extra ~0.3 ms goes, and what a small call's host
time is made of.

A. torch.profiler trace of the leaderboard case (B=1, H=16, N=16384, d=64, bf16, causal), compiled
   forward+backward and backward alone, L2 flushed before each round: kernel names, durations, gaps.
   Same run: each kernel alone through triton.testing.do_bench (as the autotuner times them).
B. Host time per call at N=1024, d=64, B*H=1 (perf_counter over many calls, no sync inside; the GPU work
   per call is shorter than the host's, so this is the host's cost): the eager forward, forward+backward,
   sdpa-flash forward+backward, one Triton launch through the JIT, one through the compiled kernel's
   runner, torch.empty_like; and a cProfile of the eager forward+backward.
    PYTHONPATH=$PWD python results/h100/probes/launch_trace_probe.py OUT_DIR
"""

import cProfile
import io
import json
import math
import pstats
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention import flash_triton
from cs336_systems.attention import triton_kernels as kernels
from cs336_systems.attention.flash_autotune import select


def inputs(bh_shape, n, d, grad=True):
    q, k, v = (torch.randn(*bh_shape, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    return q, k, v, torch.randn_like(q)


def trace(out_dir):
    q, k, v, do = inputs((1, 16), 16384, 64)
    fn = torch.compile(flash_triton.FlashAttentionTriton.apply, fullgraph=True, dynamic=False)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    o = fn(q, k, v, True)
    summary = {}
    for mode in ("forward-backward", "backward"):
        def round_():
            flush.zero_()
            if mode == "backward":
                out = fn(q, k, v, True)
                torch.cuda.synchronize()
            else:
                out = None
            if out is None:
                out = fn(q, k, v, True)
            torch.autograd.grad(out, (q, k, v), do)
            torch.cuda.synchronize()
            time.sleep(0.005)
        for _ in range(3):
            round_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                round_()
        path = f"{out_dir}/trace-{mode}.json"
        prof.export_chrome_trace(path)
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
        events.sort(key=lambda e: e["ts"])
        rounds, current = [], []
        for e in events:
            if current and e["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 2000:
                rounds.append(current)
                current = []
            current.append(e)
        rounds.append(current)
        summary[mode] = [
            [{"name": e["name"][:70], "start_us": round(e["ts"] - r[0]["ts"], 1), "dur_us": round(e["dur"], 1)} for e in r]
            for r in rounds
        ]
        print(mode, json.dumps(summary[mode][-1], indent=0), flush=True)
    # Each kernel alone, as the autotuner times them.
    q3, k3, v3, do3 = (t.detach().reshape(16, 16384, 64) for t in (q, k, v, do))
    cfg = select(16, 16384, 16384, 64, torch.bfloat16, True, q.device)
    o3, lse = torch.empty_like(q3), torch.empty(16, 16384, device="cuda", dtype=torch.float32)
    delta, dq, dk, dv = torch.empty_like(lse), torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")
    summary["alone_ms"] = {
        "fwd": bench(lambda: launch.forward(q3, k3, v3, o3, lse, True, cfg["fwd"])),
        "dq": bench(lambda: launch.dq(q3, k3, v3, do3, lse, delta, dq, True, cfg["dq"], o=o3)),
        "dkdv": bench(lambda: launch.dkdv(q3, k3, v3, do3, lse, delta, dk, dv, True, cfg["dkdv"])),
        "configs": {name: c.short() for name, c in cfg.items()},
    }
    print(summary["alone_ms"], flush=True)
    return summary


def per_call_us(fn, calls=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)  # host time: no sync inside the loop
        torch.cuda.synchronize()
    return round(best, 1)


def host(out_dir):
    q, k, v, do = inputs((1, 1), 1024, 64)
    res = {}

    def flash_fwd():
        with torch.no_grad():
            flash_triton.FlashAttentionTriton.apply(q, k, v, True)

    def flash_fwd_bwd():
        torch.autograd.grad(flash_triton.FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), do)

    def sdpa_fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q3, k3, v3 = (t.detach().reshape(1, 1024, 64) for t in (q, k, v))
    o3, lse = torch.empty_like(q3), torch.empty(1, 1024, device="cuda", dtype=torch.float32)
    cfg = select(1, 1024, 1024, 64, torch.bfloat16, True, q.device)["fwd"]
    grid = (triton.cdiv(1024, cfg.block_m), 1)
    kwargs = dict(qk_scale=launch.LOG2E / 8.0, CAUSAL=True, HEAD_DIM=64, PRECISION="tf32", LONGEST_FIRST=True,
                  **cfg.launch_kwargs())
    args = [q3, k3, v3, o3, lse, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
            o3.stride(0), o3.stride(1), 1024, 1024]
    compiled = kernels.flash_fwd_kernel[grid](*args, **kwargs)
    ordered = args + [kwargs[name] for name in kernels.flash_fwd_kernel.arg_names[len(args):]]
    runner = compiled[grid + (1,)]  # the runner indexes all three grid dims

    res["flash fwd (no grad)"] = per_call_us(flash_fwd)
    res["flash fwd+bwd"] = per_call_us(flash_fwd_bwd)
    res["sdpa-flash fwd (no grad)"] = per_call_us(sdpa_fwd)
    res["sdpa-flash fwd+bwd"] = per_call_us(sdpa_fwd_bwd)
    res["launch.forward (preallocated)"] = per_call_us(lambda: launch.forward(q3, k3, v3, o3, lse, True, cfg))
    res["jit kernel[grid](...)"] = per_call_us(lambda: kernels.flash_fwd_kernel[grid](*args, **kwargs))
    res["compiled[grid](*ordered)"] = per_call_us(lambda: runner(*ordered))
    print(res, flush=True)
    res["torch.empty_like"] = per_call_us(lambda: torch.empty_like(q3))
    res["select (memoized)"] = per_call_us(lambda: select(1, 1024, 1024, 64, torch.bfloat16, True, q.device))
    print(json.dumps(res, indent=1), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        flash_fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    open(f"{out_dir}/cprofile-fwd-bwd.txt", "w").write(text.getvalue())
    return res


if __name__ == "__main__":
    out_dir = sys.argv[1]
    result = {"host_us_per_call": host(out_dir)}
    result["trace"] = trace(out_dir)
    json.dump(result, open(f"{out_dir}/launch-trace-probe.json", "w"), indent=1)
