"""Probe (eighth session): the atomic-dQ backward against the two-kernel backward, same run.

Two-kernel backward ("split", the committed one): dQ kernel (Q, dO resident, P recomputed) then dK/dV kernel
(K, V resident, P recomputed again): 7 matmuls and 2 exp2 per score.  Atomic-dQ backward ("atomic"): a
preprocess (D, and a zeroed float32 dQ accumulator), the dK/dV kernel adding dS K into the accumulator with
relaxed float32 atomics, a convert (scale, cast): 5 matmuls and 1 exp2 per score, plus B*H*Nq*d*(Nk/BLOCK_N)
atomic adds.  Each variant's backward kernels are timed alone (device time, L2 flushed before each round,
the harness's warm-up), per tile configuration of the dK/dV kernel, and the gradients compared.
    PYTHONPATH=$PWD python results/h100/probes/atomic_dq_probe.py OUT_DIR
Ran at commit 9d0bd97 (kernels, launchers and this script); the atomic path lost everywhere and was removed
afterwards (results/h100/flash-attention-log.md, eighth session), so this script needs that commit to run.
"""

import json
import sys
import time

import torch

from cs336_systems import benchmarking
from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_configs import TileConfig

SHAPES = {  # (BH, N, d): configs of the atomic dK/dV kernel to try
    "leaderboard-d64": ((16, 16384, 64), ["32x64w4s3", "64x64w4s3", "64x64w4s2", "32x128w4s3", "64x128w8s2",
                                          "64x128w8s3", "32x128w8s3", "128x128w8s2", "16x128w4s3"]),
    "d128-bh16": ((16, 16384, 128), ["64x128w8s2", "32x128w8s3", "64x64w4s3", "32x64w4s3"]),
    "d64-bh1-n65536": ((1, 65536, 64), ["32x64w4s3", "64x128w8s2", "32x128w4s3", "64x64w4s3"]),
    "d64-bh1-n4096": ((1, 4096, 64), ["32x64w4s3", "64x64w4s3", "32x128w4s3"]),
}


def timed(fn):
    m = benchmarking.measure(lambda: fn, warmup=5, rounds=30, device="cuda",
                             before_each=benchmarking.L2Flush("cuda"), timing="device")
    return round(m.stats.median * 1e3, 4)


def main(out_dir):
    out = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, ((bh, n, d), cfgs) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        sel = flash_triton._select(q, k, True)
        o, lse = flash_triton._forward(q, k, v, True)
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def split():
            launch.dq(q, k, v, do, lse, delta, dq, True, sel["dq"], o=o)
            launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, sel["dkdv"])

        split()
        ref = [t.float().clone() for t in (dq, dk, dv)]
        row = {"split_configs": {kk: c.short() for kk, c in sel.items()}, "split_ms": timed(split),
               "dq_only_ms": timed(lambda: launch.dq(q, k, v, do, lse, delta, dq, True, sel["dq"], o=o)),
               "dkdv_only_ms": timed(lambda: launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, sel["dkdv"])),
               "atomic": {}}
        print(name, row, flush=True)
        dq_acc = torch.empty(bh, n, d, device="cuda", dtype=torch.float32)
        row["preprocess_ms"] = timed(lambda: launch.preprocess(o, do, delta, dq_acc))
        row["convert_ms"] = timed(lambda: launch.dq_convert(dq_acc, dq))
        for text in cfgs:
            cfg = TileConfig.parse(text)

            def atomic():
                launch.preprocess(o, do, delta, dq_acc)
                launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, cfg, dq_acc=dq_acc)
                launch.dq_convert(dq_acc, dq)

            try:
                t0 = time.perf_counter()
                atomic()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                err = {}
                for label, new, old in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
                    err[label] = float((new.float() - old).abs().max() / old.abs().max())
                entry = {"ms": timed(atomic), "first_call_s": round(first_s, 2), "rel_err_vs_split": err,
                         "dkdv_nonatomic_ms": timed(lambda: launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, cfg))}
            except Exception as exc:  # a config that does not compile or launch is a recorded result
                entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            row["atomic"][text] = entry
            print(name, text, entry, flush=True)
        out["shapes"][name] = row
        json.dump(out, open(f"{out_dir}/atomic-dq-probe.json", "w"), indent=1)
        del q, k, v, do, o, lse, delta, dq, dk, dv, dq_acc, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
