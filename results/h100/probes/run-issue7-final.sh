#!/bin/bash
# Device run (H100): GPU correctness of the tuned flash-triton configs, then the leaderboard and bf16 flash sweeps.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
step gpu-tests
timeout 230 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$?" | tee -a $log; tail -5 $OUT/gpu-tests.log | tee -a $log
step leaderboard
timeout 70 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=leaderboard --benchmark-json=$OUT/leaderboard.json 2>&1 | tail -2 | tee -a $log
step flash-bf16-long
timeout 120 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-bf16-long --benchmark-json=$OUT/flash-bf16-long.json 2>&1 | tail -2 | tee -a $log
step flash-bf16-short
timeout 110 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-bf16-short --benchmark-json=$OUT/flash-bf16-short.json 2>&1 | tail -2 | tee -a $log
step host-probe
timeout 40 python results/h100/probes/host_overhead_probe.py $OUT/host-overhead.json 2>&1 | tail -13 | tee -a $log
step done
