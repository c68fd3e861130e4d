#!/bin/bash
# Next H100 run (prepared 2026-11-21, fourth session), < 10 min: issue 7 in device time.
#   leaderboard: both timings (host-synchronized and CUDA-event device time, as do_bench) in one run;
#   flash-bf16-device: issue 7's sweep (N >= 1024, d 64/128, bf16) in device time;
#   GPU tests of the harness's device timing.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { g=$1; t=$2; step $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log; }
step gpu-tests
timeout -k 10 60 python -m pytest tests/test_benchmarking.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "rc=$?" | tee -a $log
group leaderboard 200
group flash-bf16-device 280
step done
# then (second call): the same two groups on kind nvidia-h200 for issue 7's H200 contrast.
