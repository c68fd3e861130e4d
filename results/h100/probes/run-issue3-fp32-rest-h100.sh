#!/bin/bash
# The fp32 flash sweep cells the first run (run-issue3-h100.sh) did not reach within its time limit:
# flash-triton beside sdpa-efficient (fp32's only fused baseline) in one run, so their ratio is same-run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
step flash-fp32-short-rest
timeout -s INT -k 20 60 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-fp32-short -k "(flash-triton or sdpa-efficient) and (n2048 or n4096)" --benchmark-json=$OUT/flash-fp32-short-rest.json 2>&1 | tail -2 | tee -a $log
step flash-fp32-long-rest
timeout -s INT -k 20 170 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-fp32-long -k "(flash-triton or sdpa-efficient) and not n65536" --benchmark-json=$OUT/flash-fp32-long-rest.json 2>&1 | tail -2 | tee -a $log
step done
