#!/bin/bash
# Next H100 run (prepared 2026-11-21, fourth session): issue 7 in device time, after the v2.1 backward
# (preprocess in the dQ kernel's prologue: two launches). Two calls of < 10 min each:
#   PART=1: GPU tests (flash properties, compile fullgraph, every committed tile config vs float64, the
#           harness's device timing), then the leaderboard in both timings (host-synchronized, device);
#   PART=2: flash-bf16-device (issue 7's sweep: N >= 1024, d 64/128, bf16, device time).
# Then the same two groups on kind nvidia-h200 (results/h200/run-next-h200.sh) for the contrast.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { g=$1; t=$2; step $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log; }
if [ "${PART:-1}" = 1 ]; then
  step gpu-tests
  timeout -k 10 280 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py tests/test_benchmarking.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "rc=$?" | tee -a $log
  group leaderboard 240
else
  group flash-bf16-device 500
fi
step done
