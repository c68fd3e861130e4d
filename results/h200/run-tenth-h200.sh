#!/bin/bash
# Tenth session, H200 contrast run of the current code: leaderboard (bf16), the bf16 and fp32 graph-timed sweeps.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
group leaderboard leaderboard 150
group graph-sweep flash-bf16-graph 200
group fp32-graph flash-fp32-graph 200
step done
