#!/bin/bash
# Tenth session, second H200 call: the final code (dQ band mode): leaderboard and the bf16 graph sweep.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -1 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
group leaderboard leaderboard 120
group graph-sweep flash-bf16-graph 150
step done
