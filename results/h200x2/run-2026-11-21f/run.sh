#!/bin/bash
# Next 2xH200 run (prepared 2026-11-21, fourth session), < 10 min: issues 4 and 5 with the DDP wrappers'
# sync timing on CUDA events (no host sync in the step any more), DDP and sharding variants in ONE session
# per precision so every ratio is same-run. NCCL correctness tests first (they cover the event timing).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/gpus.txt 2>&1
step nccl-tests
timeout -k 10 100 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
for p in fp32 bf16; do
  step ddp+sharding-$p
  timeout -s INT -k 20 200 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-$p,sharding-$p --benchmark-json=$OUT/dp-$p.json 2>&1 | tail -2 | tee -a $log
done
step done
# exit status 1 with "ratio gates: violated" is the regression gate speaking, not a crash: the JSON is written.
