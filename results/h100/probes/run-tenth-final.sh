#!/bin/bash
# Tenth session, last H100 call, current code (dQ band mode at the leaderboard shape): leaderboard (Must 1),
# bf16 graph sweep (Must 2), then the GPU flash tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -1 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
group leaderboard leaderboard 120
group graph-sweep flash-bf16-graph 150
step gpu-tests
timeout -k 10 330 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1
tail -1 $OUT/gpu-tests.log | tee -a $log
step done
