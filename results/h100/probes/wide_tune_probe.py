"""Probe (fifth session): a wider tile search for the leaderboard shape, then the winners against the
committed table in the harness, same run, interleaved (A B A B: the GPU's clocks drift under sustained load).

The committed search space has ~10 candidates per kernel; here every (BLOCK_M, BLOCK_N, warps, stages)
in a grid that fits the shared-memory estimate is timed by the same tuner (`flash_autotune.tune`).
    PYTHONPATH=$PWD python results/h100/probes/wide_tune_probe.py OUT_DIR
"""

import itertools
import json
import sys

import torch

from cs336_systems import benchmarking
from cs336_systems.attention import flash_autotune, flash_configs
from cs336_systems.attention.flash_configs import ShapeKey, TileConfig
from cs336_systems.attention_workloads import attention_step

GRID = {
    "fwd": itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)),
    "dkdv": itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3, 4, 5)),
    "dq": itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4, 5)),
}


def main(out_dir):
    for kernel, specs in GRID.items():
        flash_configs.SEARCH_SPACE[(kernel, "half")] = tuple(TileConfig(*s) for s in specs)
    result = flash_autotune.tune(16, 16384, 16384, 64, torch.bfloat16, True, "cuda", save=False)
    out = {"tune": result.as_json()}
    print(json.dumps({"chosen": out["tune"]["chosen"], "seconds": out["tune"]["seconds"]}), flush=True)
    for kernel, timings in result.timings_ms.items():
        best = sorted((v, k) for k, v in timings.items() if isinstance(v, float))[:6]
        print(kernel, best, flush=True)

    key = ShapeKey.of(16, 16384, 16384, 64, torch.bfloat16, True)
    committed = flash_configs.tuned_for_device(key, torch.device("cuda"))
    variants = {"committed": committed, "wide": result.chosen}
    times = {name: [] for name in variants}
    for _ in range(2):
        for name, cfg in variants.items():
            flash_autotune._selected.clear()
            flash_autotune._selected[(key, "cuda:0")] = cfg
            setup = lambda: attention_step(impl="flash-triton", batch_size=1, heads=16, seq_len=16384, head_dim=64,
                                           dtype="bf16", causal=True, mode="forward-backward", compile=True,
                                           device="cuda", check=False)
            m = benchmarking.measure(setup, warmup=10, rounds=50, device="cuda",
                                     before_each=benchmarking.L2Flush("cuda"), timing="device")
            times[name].append(round(m.stats.median * 1e3, 4))
            print(name, times[name], flush=True)
    out["interleaved_fwd_bwd_ms"] = times
    out["variants"] = {name: {k: c.short() for k, c in cfg.items()} for name, cfg in variants.items()}
    json.dump(out, open(f"{out_dir}/wide-tune-probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
