#!/bin/bash
# Eighth session, last H100 call, with the new dQ tiles: GPU tests of the flash kernels, the leaderboard
# (Must 1), the bf16 graph-timed sweep (Must 2 in kernel time).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step gpu-tests
timeout -s INT -k 20 230 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu-tests.log | tee -a $log
group leaderboard leaderboard 130
group graph-sweep flash-bf16-graph 150
step done
