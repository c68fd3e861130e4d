"""Probe (ninth session): the library's TMA path (K/V tiles outside the masked band through host-side
descriptors, forward and dQ kernels) against its pointer loads, on the lent H100.

Prediction, from the eighth session's probe kernels (`run-2026-11-21-eighth-tma-all/`, same tiles): forward
-1.3%, dQ -6.4% at 128x64 and -14% at 64x128 (1.325 -> 1.144 ms); compiled forward+backward at the leaderboard
shape about -0.2 ms (5.26 -> ~5.06).

1. Each kernel alone, TMA on and off (the launchers' `tma` flag), at a few tiles per shape, two interleaved
   passes (device time, L2 flushed, harness warm-up); outputs compared with the pointer kernel's.
2. The compiled forward+backward at the leaderboard shape, committed tiles with pointer loads vs the same
   tiles with TMA in forward and dQ, interleaved A B A B, 50 rounds each.
First run (`run-2026-11-22-ninth-tma-library/`) at commit c783805 (TMA wherever allowed, chosen by the
CS336_FLASH_TMA variable in step 2); second (`run-2026-11-22-ninth-tma-2/`) at commit de55c54, dQ kernel only,
where the dQ kernel used the descriptor's K tile untransposed (no change measured; reverted afterwards) and
TMA had become a per-configuration flag.
    PYTHONPATH=$PWD python results/h100/probes/tma_library_probe.py OUT_DIR
"""

import json
import os
import sys

import torch

from cs336_systems import benchmarking
from cs336_systems.attention import flash_autotune, flash_configs, flash_triton
from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention.flash_configs import ShapeKey, TileConfig
from cs336_systems.attention_workloads import attention_step

SHAPES = {"leaderboard": (16, 16384, 64), "bh16-n16384-d128": (16, 16384, 128), "bh1-n65536-d64": (1, 65536, 64),
          "bh1-n16384-d64": (1, 16384, 64), "bh1-n4096-d64": (1, 4096, 64), "bh1-n4096-d128": (1, 4096, 128)}
if len(sys.argv) > 2:  # a comma-separated subset, and only these kernels: e.g. "leaderboard,bh1-n65536-d64" "dq"
    SHAPES = {name: SHAPES[name] for name in sys.argv[2].split(",")}
TILES = {
    "fwd": ["64x128w4s3", "128x64w4s3", "64x64w4s3", "128x128w8s2", "128x64w8s3"],
    "dq": ["64x128w4s3", "64x128w4s4", "128x64w8s3", "128x128w8s2", "64x64w4s3"],
}


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
        res = {"o": torch.empty_like(q), "lse": torch.empty_like(lse), "dq": torch.empty_like(q)}
        runs = {
            "fwd": lambda cfg, tma: launch.forward(q, k, v, res["o"], res["lse"], True, cfg, tma=tma, splits=1),
            "dq": lambda cfg, tma: launch.dq(q, k, v, do, lse, delta, res["dq"], True, cfg, o=o, tma=tma),
        }
        row = {"committed": {kern: sel[kern].short() for kern in runs}, "ms": {}, "rel_err": {}, "errors": {}}
        variants = {}
        for kern, fn in runs.items():
            if len(sys.argv) > 3 and kern not in sys.argv[3].split(","):
                continue
            tiles = [sel[kern].short()] + [t for t in TILES[kern] if t != sel[kern].short()]
            for text in tiles:
                cfg = TileConfig.parse(text)
                try:
                    fn(cfg, False)
                    torch.cuda.synchronize()
                    ref = (res["o"] if kern == "fwd" else res["dq"]).float().clone()
                    fn(cfg, True)
                    torch.cuda.synchronize()
                    got = (res["o"] if kern == "fwd" else res["dq"]).float()
                    row["rel_err"][f"{kern} {text}"] = float((got - ref).abs().max() / ref.abs().max())
                    for tma in (False, True):
                        variants[f"{kern} {text} {'tma' if tma else 'ptr'}"] = (fn, cfg, tma)
                except Exception as exc:
                    row["errors"][f"{kern} {text}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for _ in range(2):
            for label, (fn, cfg, tma) in variants.items():
                row["ms"].setdefault(label, []).append(timed(lambda fn=fn, cfg=cfg, tma=tma: fn(cfg, tma)))
        print(name, json.dumps(row), flush=True)
        out["kernels"][name] = row
        del q, k, v, do, o, lse, delta, res
        torch.cuda.empty_cache()


def fwd_bwd(out):
    """Committed tiles with pointer loads vs the same tiles with TMA in forward and dQ (the configuration flag)."""
    import dataclasses

    key = ShapeKey.of(16, 16384, 16384, 64, torch.bfloat16, True)
    committed = flash_configs.tuned_for_device(key, torch.device("cuda"))
    variants = {"ptr": {kern: dataclasses.replace(c, tma=False) for kern, c in committed.items()},
                "tma": {kern: dataclasses.replace(c, tma=kern != "dkdv") for kern, c in committed.items()}}
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
    path = f"{out_dir}/tma-library-probe.json"
    try:
        fwd_bwd(out)
    finally:
        json.dump(out, open(path, "w"), indent=1)
    try:
        kernels(out)
    finally:
        json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
