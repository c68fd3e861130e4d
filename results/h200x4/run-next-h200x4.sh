#!/bin/bash
# Issue 9 on what is lent (prepared 2026-11-21): 4xH200, the all-reduce suite at world 2/4 (and gloo),
# then the scaling groups at world 4 (DDP variants, ZeRO-1; per-rank batch 2, XL, ctx 512), < 10 min.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi topo -m > $OUT/topo.txt 2>&1
step allreduce-nccl
timeout -s INT -k 20 150 python -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=allreduce-nccl -k "ranks2 or ranks4" --benchmark-json=$OUT/allreduce-nccl.json 2>&1 | tail -2 | tee -a $log
for p in fp32 bf16; do
  step scaling-$p
  timeout -s INT -k 20 170 torchrun --nproc-per-node=4 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=full --perf-group=scaling-$p --benchmark-json=$OUT/scaling-$p-w4.json 2>&1 | tail -2 | tee -a $log
done
step done
