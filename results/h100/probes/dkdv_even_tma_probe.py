"""Probe (ninth session): the dK/dV kernel's full-tile variant (EVEN: no bounds masks, no ragged loops) and
its TMA loads of Q and dO, against the general pointer kernel, per tile.

Why: the TMA-reduce probe's dK/dV-only kernel (no bounds handling, Q/dO by descriptors, 64x64w4s3) ran the
leaderboard dK/dV in 2.23 ms against the library's 2.37 (`run-2026-11-22-ninth-tma-2/`), while the eighth
session's TMA variant with the library's three loops and bounds masks tied it.  Prediction: EVEN alone -2 to
-4% (less code per loop, fewer loop instances for the pipeliner), EVEN + TMA at 64-query tiles -5 to -7%.
Each variant alone, two interleaved passes, device time, L2 flushed, harness warm-up; dK, dV compared with
the general kernel's.  Then the compiled forward+backward at the leaderboard shape: committed configuration
vs the same with the best dK/dV variant, A B A B, 50 rounds each.
    PYTHONPATH=$PWD python results/h100/probes/dkdv_even_tma_probe.py OUT_DIR
Ran at commit d10c6b7 (the `even` / `tma` launcher arguments of dK/dV); both variants lost or tied and were
removed in the next commit, so this script needs that commit to run.
"""

import dataclasses
import json
import sys

import torch

from cs336_systems import benchmarking
from cs336_systems.attention import flash_autotune, flash_configs, flash_triton
from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention.flash_configs import ShapeKey, TileConfig
from cs336_systems.attention_workloads import attention_step

SHAPES = {"leaderboard": (16, 16384, 64), "bh1-n65536-d64": (1, 65536, 64), "bh16-n16384-d128": (16, 16384, 128)}
TILES = {64: ["32x64w4s3", "64x64w4s3", "64x64w4s2", "32x128w4s4", "64x128w8s3", "64x128w8s2"],
         128: ["64x128w8s2", "32x128w8s3", "64x64w4s3", "32x64w4s3"]}
VARIANTS = {"general": dict(tma=False, even=False), "even": dict(tma=False, even=True),
            "even-tma": dict(tma=True, even=True)}


def timed(fn, rounds=30):
    m = benchmarking.measure(lambda: fn, warmup=5, rounds=rounds, device="cuda",
                             before_each=benchmarking.L2Flush("cuda"), timing="device")
    return round(m.stats.median * 1e3, 4)


def kernels(out):
    for name, (bh, n, d) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        sel = flash_triton._select(q, k, True)
        o, lse = flash_triton._forward(q, k, v, True)
        delta = torch.empty_like(lse)
        launch.dq(q, k, v, do, lse, delta, torch.empty_like(q), True, sel["dq"], o=o)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        row = {"committed": sel["dkdv"].short(), "ms": {}, "rel_err": {}, "errors": {}}
        runs = {}
        for text in TILES[d]:
            cfg = TileConfig.parse(text)
            launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, cfg, even=False, tma=False)
            torch.cuda.synchronize()
            ref = (dk.float().clone(), dv.float().clone())
            for vname, kw in VARIANTS.items():
                label = f"{text} {vname}"
                try:
                    launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, cfg, **kw)
                    torch.cuda.synchronize()
                    row["rel_err"][label] = max(float((a.float() - b).abs().max() / b.abs().max())
                                                for a, b in zip((dk, dv), ref))
                    runs[label] = (cfg, kw)
                except Exception as exc:
                    row["errors"][label] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for _ in range(2):
            for label, (cfg, kw) in runs.items():
                row["ms"].setdefault(label, []).append(timed(
                    lambda cfg=cfg, kw=kw: launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, cfg, **kw)))
        print(name, json.dumps(row), flush=True)
        out["kernels"][name] = row
        del q, k, v, do, o, lse, delta, dk, dv
        torch.cuda.empty_cache()


def fwd_bwd(out):
    lead = out["kernels"]["leaderboard"]["ms"]
    best = min((label for label in lead if not label.endswith("general")), key=lambda t: sum(lead[t]))
    text, vname = best.split()
    key = ShapeKey.of(16, 16384, 16384, 64, torch.bfloat16, True)
    committed = flash_configs.tuned_for_device(key, torch.device("cuda"))
    best_cfg = dataclasses.replace(TileConfig.parse(text), tma=vname == "even-tma")
    variants = {"committed": committed, "dkdv " + best_cfg.short(): {**committed, "dkdv": best_cfg}}
    times = {v: [] for v in variants}
    setup = lambda: attention_step(impl="flash-triton", batch_size=1, heads=16, seq_len=16384, head_dim=64,
                                   dtype="bf16", causal=True, mode="forward-backward", compile=True,
                                   device="cuda", check=True)
    for _ in range(2):
        for label, cfg in variants.items():
            flash_autotune._selected.clear()
            flash_autotune._selected[(key, "cuda:0")] = cfg
            m = benchmarking.measure(setup, warmup=10, rounds=50, device="cuda",
                                     before_each=benchmarking.L2Flush("cuda"), timing="device")
            times[label].append(round(m.stats.median * 1e3, 4))
            print("fwd+bwd compiled", label, times[label], flush=True)
    flash_autotune._selected.clear()
    out["fwd_bwd_compiled_ms"] = times
    out["fwd_bwd_configs"] = {v: {kern: c.short() for kern, c in cfg.items()} for v, cfg in variants.items()}


def main(out_dir):
    out = {"device": torch.cuda.get_device_name(), "kernels": {}}
    path = f"{out_dir}/dkdv-even-tma-probe.json"
    try:
        kernels(out)
        fwd_bwd(out)
    finally:
        json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
