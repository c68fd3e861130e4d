#!/bin/bash
# Second 2xH200 call of 2026-11-21 (fourth session): the fp32 groups, then ddp-bf16 again (the first
# bf16 run of the day had IQRs of 10-25% of the median: a repeat shows what is reproducible).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,utilization.gpu --format=csv > $OUT/gpus.txt 2>&1
for g in ddp-fp32 sharding-fp32 ddp-bf16; do
  step $g
  timeout -s INT -k 20 150 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log
done
step done
