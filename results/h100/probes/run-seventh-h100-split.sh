#!/bin/bash
# Seventh session's second H100 run (one call, < 10 min): the key-split forward for few (batch x head) slices.
# GPU tests first (flash properties at B*H = 1 now take the split path; fullgraph compile; CUDA-graph replay;
# committed tile configs vs float64), then a same-run A/B of the graph-timed sweep: splits forced off
# (CS336_FLASH_SPLITS=1) vs the heuristic (flash_launch.key_splits), and the small-d graph group.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step gpu-tests
timeout -k 10 260 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "rc=$?" | tee -a $log
tail -3 $OUT/gpu-tests.log | tee -a $log
python - <<'PY' 2>&1 | tee -a $log
import torch
from cs336_systems.attention import flash_launch
from cs336_systems.attention.flash_autotune import select
for d in (16, 32, 64, 128):
    for n in (1024, 2048, 4096, 8192, 16384):
        cfg = select(1, n, n, d, torch.bfloat16, True, torch.device("cuda"))["fwd"]
        q = torch.empty(1, n, d, device="cuda", dtype=torch.bfloat16)
        print(f"d{d} n{n} fwd {cfg.short()} splits {flash_launch.key_splits(q, n, cfg)}")
PY
CS336_FLASH_SPLITS=1 group graph-nosplit flash-bf16-graph 120
group graph-split flash-bf16-graph,flash-bf16-graph-small-d 160
step done
