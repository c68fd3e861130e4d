#!/bin/bash
# Issue 7's H200 contrast (prepared 2026-11-21, fourth session), kind nvidia-h200, < 10 min: the leaderboard
# in both timings and issue 7's sweep in device time, as on the H100 (results/h100/probes/run-next-h100.sh).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { g=$1; t=$2; step $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
group leaderboard 200
group flash-bf16-device 300
step done
# The committed tile table (TUNED_SM90) was tuned on the H100; the H200 is sm_90 too and gets the same table.
