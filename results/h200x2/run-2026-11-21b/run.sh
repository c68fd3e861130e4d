#!/bin/bash
# Next 2xH200 run (prepared 2026-11-21): issues 4 and 5 after the overlapped zero1, the flag-read skip and
# the O(buckets) DDP copy-out; never-run NCCL correctness tests first.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
step nccl-tests
timeout -k 10 120 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
for g in ddp-bf16 sharding-bf16; do
  step $g
  timeout -s INT -k 20 170 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -2 | tee -a $log
done
step done
