#!/bin/bash
# Seventh session's second 2xH200 run (< 10 min): after DDPIndividualParameters moved to in-place all-reduces.
# NCCL tests (the wrappers on NCCL), then the DDP groups in both precisions (same-run baselines), bf16 twice.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
{ uptime; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv; } > $OUT/host.txt 2>&1
step nccl-tests
timeout -k 10 100 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
for run in ddp-fp32:fp32 ddp-bf16:bf16 ddp-bf16:bf16-repeat; do
  g=${run%%:*}; name=${run##*:}
  step $g $name
  timeout -s INT -k 20 150 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/ddp-$name.json 2>&1 | tail -3 | tee -a $log
done
step done
