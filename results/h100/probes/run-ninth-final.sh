#!/bin/bash
# Ninth session, last H100 call, current code (TMA forward at d 64, TMA dQ at B*H 1, d128 dQ tiles):
# the leaderboard (Must 1) and the bf16 graph-timed sweep (Must 2 in kernel time).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
group leaderboard leaderboard 200
group graph-sweep flash-bf16-graph 200
step done
