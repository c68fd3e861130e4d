#!/bin/bash
# Seventh session's H200 contrast run (< 10 min): issue 7's sweep as CUDA-graph replays (key-split forward on).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step graph
timeout -s INT -k 20 240 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-bf16-graph,flash-bf16-graph-small-d --benchmark-json=$OUT/flash-bf16-graph.json 2>&1 | tail -3 | tee -a $log
step done
