#!/bin/bash
# Next H100 run (prepared 2026-11-21): what issues 3, 6 and 7 still need, in priority order, < 10 min.
#   issue 6: checkpointing-xl with the nested policy;
#   issue 7: GPU check of every committed tile config, the v2 long sweep;
#   issue 3: the handout sweep's flash-triton group and the fp32 flash sweeps.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { g=$1; t=$2; step $g; timeout $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log; }
group checkpointing-xl 90
step gpu-committed-configs
timeout 150 python -m pytest tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "rc=$?" | tee -a $log
group flash-bf16-long 150
group attention-flash 180
step done
# then: flash-fp32-short, flash-fp32-long (each ~2-3 min) in a second call.
