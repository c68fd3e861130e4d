"""Probe (fifth session): GPU timeline of the harness's device-timed rounds on the leaderboard case.

The leaderboard's device-timed forward+backward (5.41 ms compiled) is ~0.37 ms above its three kernels
in a trace (5.04 ms), although device timing queues rounds without synchronizing. Here the harness's
own `measure(timing="device")` runs under torch.profiler (CUDA activity only): per round, the kernels and
the idle gaps inside the measured interval, beside the event-measured round times.
    PYTHONPATH=$PWD python results/h100/probes/harness_trace_probe.py OUT_DIR
"""

import json
import sys

import torch

from cs336_systems import benchmarking
from cs336_systems.attention_workloads import attention_step


def main(out_dir):
    summary = {}
    for compile_ in (True, False):
        name = "compiled" if compile_ else "eager"
        setup = lambda: attention_step(impl="flash-triton", batch_size=1, heads=16, seq_len=16384, head_dim=64,
                                       dtype="bf16", causal=True, mode="forward-backward", compile=compile_,
                                       device="cuda", check=False)
        flush = benchmarking.L2Flush("cuda")
        benchmarking.measure(setup, warmup=5, rounds=3, device="cuda", before_each=flush, timing="device")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            m = benchmarking.measure(setup, warmup=5, rounds=12, device="cuda", before_each=flush, timing="device")
        path = f"{out_dir}/harness-trace-{name}.json"
        prof.export_chrome_trace(path)
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset")]
        events.sort(key=lambda e: e["ts"])
        timeline = [(e["name"][:40], round(e["ts"], 1), round(e["dur"], 1)) for e in events[-40:]]
        gaps = [round(b[1] - (a[1] + a[2]), 1) for a, b in zip(timeline, timeline[1:])]
        summary[name] = {"event_times_ms": [round(t * 1e3, 3) for t in m.times_s], "last_kernels": timeline,
                         "gaps_us": gaps}
        print(name, json.dumps(summary[name]["event_times_ms"]), flush=True)
        for (kname, ts, dur), gap in zip(timeline[1:], gaps):
            print(f"  gap {gap:8.1f}  {kname:40s} {dur:8.1f}", flush=True)
    json.dump(summary, open(f"{out_dir}/harness-trace-probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
