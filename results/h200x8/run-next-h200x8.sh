#!/bin/bash
# Issue 9 (prepared 2026-11-21), for an 8xH200 machine if one is ever lent: all-reduce at world 2/4/6/8
# (full profile), then the scaling groups at world 8 and 4. Two calls may be needed (< 10 min each):
#   call 1: this script with PART=1; call 2: PART=2.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
if [ "${PART:-1}" = 1 ]; then
  nvidia-smi topo -m > $OUT/topo.txt 2>&1
  step allreduce-nccl
  timeout -s INT -k 20 240 python -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=full --perf-group=allreduce-nccl --benchmark-json=$OUT/allreduce-nccl.json 2>&1 | tail -2 | tee -a $log
  step scaling-fp32-w8
  timeout -s INT -k 20 200 torchrun --nproc-per-node=8 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=full --perf-group=scaling-fp32 --benchmark-json=$OUT/scaling-fp32-w8.json 2>&1 | tail -2 | tee -a $log
else
  for run in "8 bf16" "4 fp32" "4 bf16"; do
    set -- $run
    step scaling-$2-w$1
    timeout -s INT -k 20 170 torchrun --nproc-per-node=$1 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=full --perf-group=scaling-$2 --benchmark-json=$OUT/scaling-$2-w$1.json 2>&1 | tail -2 | tee -a $log
  done
fi
step done
