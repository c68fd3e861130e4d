#!/bin/bash
# Seventh session's third H100 run (one call, < 10 min), all with the key-split forward: the leaderboard
# (Must 1 re-checked with the current code), the bf16 graph sweep again (a second run of the same version:
# its spread is the noise floor of the split A/B), and the fp32 graph group (issue 7 asks for fp32 ratios).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $name $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
group leaderboard leaderboard 150
group graph-split-repeat flash-bf16-graph 110
group fp32-graph flash-fp32-graph 280
step done
