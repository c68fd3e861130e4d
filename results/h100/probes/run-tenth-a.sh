#!/bin/bash
# Tenth session, call A (H100): tf32x3 fp32 tiles tuned from an empty cache (B*H 1, d 64/128, N 1024/4096/16384),
# then the bf16 leaderboard again (Must 1's second confirming run; same code as the ninth session for bf16).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS336_FLASH_CACHE=$OUT/tune-cache.json
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step leaderboard
timeout -s INT -k 20 120 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=leaderboard --benchmark-json=$OUT/leaderboard.json 2>&1 | tail -3 | tee -a $log
# Triton's disk cache makes a second N at the same d mostly free (N is not a constexpr), hence the limits.
for spec in 1,16384,64:130 1,4096,64:60 1,16384,128:130 1,4096,128:60 1,1024,64:40 1,1024,128:40; do
  shape=${spec%:*}; limit=${spec#*:}
  step tune fp32 $shape
  timeout -s INT -k 10 $limit python -m cs336_systems.attention.flash_autotune --dtype fp32 --shape $shape --json $OUT/tune-fp32-${shape//,/-}.json 2>&1 | grep -v Warning | tail -4 | tee -a $log
done
step done
