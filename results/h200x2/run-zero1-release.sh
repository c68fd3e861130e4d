#!/bin/bash
# 2xH200, 2026-11-21 (fourth session): zero1 after releasing gradients once packed and the two-deep
# all-gather pipeline; each precision's DDP baselines in the SAME session as the sharding variants
# (comma-separated groups), so zero1 / our DDP (bucketed 100 MiB, zero1's bucket size) is a same-run ratio.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
step nccl-tests
timeout -k 10 100 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
for p in fp32 bf16; do
  step sharding-$p
  timeout -s INT -k 20 120 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-$p,sharding-$p -k "none or ddp or 100MiB or zero" --benchmark-json=$OUT/zero1-$p.json 2>&1 | tail -2 | tee -a $log
done
step done
