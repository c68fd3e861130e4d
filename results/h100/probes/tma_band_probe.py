"""Probe (tenth session): TMA "band" mode, the forward and dQ kernels loading the masked diagonal-band
K/V tiles through the descriptors too (TMA=2, when BLOCK_N divides N), against the ninth session's mode
(TMA=1: descriptors for the unmasked tiles, bounds-masked pointer loads for the band) and pointer loads.

Why: the ninth session's library dQ at 64x128 with TMA=1 ran 27% *slower* than pointer loads (1.67 vs
1.32 ms), while the eighth session's probe kernel, with descriptors in both loops, ran that tile in
1.144 ms.  The remaining difference between the two was the pointer-loaded masked loop.
Prediction: if that loop is the cause, dQ 64x128 band ~1.15-1.2 ms at the leaderboard shape (-10 to
-13% against the committed pointer tile), forward 64x128 unchanged within 1-2% (its mode-1 path already
won), and compiled forward+backward ~ -0.15 ms.

1. Each kernel alone (device time, L2 flushed, two interleaved passes): pointers / TMA=1 / TMA=2.
2. Compiled forward+backward at the leaderboard shape, interleaved A B C A B C, 50 rounds each:
   A committed tiles with band off (the ninth session's behaviour), B committed tiles with band on,
   C band on with dQ 64x128w4s3t.
    PYTHONPATH=$PWD python results/h100/probes/tma_band_probe.py OUT_DIR
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

SHAPES = {"leaderboard": (16, 16384, 64), "bh1-n65536-d64": (1, 65536, 64), "bh1-n16384-d64": (1, 16384, 64),
          "bh16-n16384-d128": (16, 16384, 128)}
TILES = {"fwd": ["64x128w4s3", "128x64w4s3", "64x64w4s3"], "dq": ["64x128w4s3", "128x64w8s3", "64x64w4s3"]}
MODES = {"ptr": (False, False), "tma1": (True, False), "tma2": (True, True)}  # (tma, band)


def timed(fn, rounds=30):
    m = benchmarking.measure(lambda: fn, warmup=5, rounds=rounds, device="cuda",
                             before_each=benchmarking.L2Flush("cuda"), timing="device")
    return round(m.stats.median * 1e3, 4)


def kernels(out):
    for name, (bh, n, d) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_triton._forward(q, k, v, True)
        delta = torch.empty_like(lse)
        res = {"o": torch.empty_like(q), "lse": torch.empty_like(lse), "dq": torch.empty_like(q)}
        runs = {
            "fwd": lambda cfg, tma, band: launch.forward(q, k, v, res["o"], res["lse"], True, cfg, tma=tma, band=band,
                                                         splits=1),
            "dq": lambda cfg, tma, band: launch.dq(q, k, v, do, lse, delta, res["dq"], True, cfg, o=o, tma=tma,
                                                   band=band),
        }
        row = {"ms": {}, "rel_err": {}, "errors": {}}
        variants = {}
        for kern, fn in runs.items():
            for text in TILES[kern]:
                cfg = TileConfig.parse(text)
                try:
                    ref = None
                    for mode, (tma, band) in MODES.items():
                        fn(cfg, tma, band)
                        torch.cuda.synchronize()
                        got = (res["o"] if kern == "fwd" else res["dq"]).float().clone()
                        if ref is None:
                            ref = got
                        else:
                            row["rel_err"][f"{kern} {text} {mode}"] = float((got - ref).abs().max() / ref.abs().max())
                        variants[f"{kern} {text} {mode}"] = (fn, cfg, tma, band)
                except Exception as exc:
                    row["errors"][f"{kern} {text}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for _ in range(2):
            for label, (fn, cfg, tma, band) in variants.items():
                row["ms"].setdefault(label, []).append(timed(lambda fn=fn, cfg=cfg, tma=tma, band=band: fn(cfg, tma, band)))
        print(name, json.dumps(row), flush=True)
        out["kernels"][name] = row
        del q, k, v, do, o, lse, delta, res
        torch.cuda.empty_cache()


def fwd_bwd(out):
    key = ShapeKey.of(16, 16384, 16384, 64, torch.bfloat16, True)
    committed = flash_configs.tuned_for_device(key, torch.device("cuda"))
    dq_tma = {**committed, "dq": dataclasses.replace(committed["dq"], tma=True)}
    variants = {"A committed, band off": (committed, False), "B committed, band on": (committed, True),
                "C dq 64x128t, band on": (dq_tma, True)}
    original = launch._kv_descriptors
    times = {v: [] for v in variants}
    setup = lambda: attention_step(impl="flash-triton", batch_size=1, heads=16, seq_len=16384, head_dim=64,
                                   dtype="bf16", causal=True, mode="forward-backward", compile=True,
                                   device="cuda", check=True)
    try:
        for _ in range(2):
            for label, (cfg, band_on) in variants.items():
                launch._kv_descriptors = (lambda k, v, c, tma, band, on=band_on: original(k, v, c, tma, band and on))
                flash_autotune._selected.clear()
                flash_autotune._selected[(key, "cuda:0")] = cfg
                m = benchmarking.measure(setup, warmup=10, rounds=50, device="cuda",
                                         before_each=benchmarking.L2Flush("cuda"), timing="device")
                times[label].append(round(m.stats.median * 1e3, 4))
                print("fwd+bwd compiled", label, times[label], flush=True)
    finally:
        launch._kv_descriptors = original
        flash_autotune._selected.clear()
    out["fwd_bwd_compiled_ms"] = times
    out["fwd_bwd_configs"] = {v: {kern: c.short() for kern, c in cfg.items()} for v, (cfg, _) in variants.items()}


def main(out_dir):
    out = {"device": torch.cuda.get_device_name(), "kernels": {}}
    path = f"{out_dir}/tma-band-probe.json"
    try:
        kernels(out)
        fwd_bwd(out)
    finally:
        json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
