#!/bin/bash
# Seventh session's 2xH200 run (one call, < 10 min): NCCL tests on the current DDP/ZeRO/FSDP code, the bf16
# affinity probe (world 1, world 2, world 2 pinned to split physical cores), then the DDP + sharding groups
# in both precisions unpinned (same-run ratios), then the bf16 groups again with pinned ranks.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
{ uptime; lscpu; nproc; command -v taskset; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv; } > $OUT/host.txt 2>&1
step nccl-tests
timeout -k 10 100 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
for cfg in "1 none" "2 none" "2 split"; do
  set -- $cfg
  step "probe world $1 pin $2"
  PIN=$2 timeout -k 10 100 torchrun --nproc-per-node=$1 results/h200x2/bf16_affinity_probe.py $OUT/probe-w$1-$2.json 2>&1 | grep -v Warning | tail -6 | tee -a $log
done
for p in fp32 bf16; do
  step ddp+sharding-$p
  timeout -s INT -k 20 150 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-$p,sharding-$p --benchmark-json=$OUT/dp-$p.json 2>&1 | tail -3 | tee -a $log
done
step "ddp-bf16 pinned"
timeout -s INT -k 20 120 torchrun --nproc-per-node=2 --no-python results/h200x2/pin-rank.sh python -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-bf16 --benchmark-json=$OUT/ddp-bf16-pinned.json 2>&1 | tail -3 | tee -a $log
step done
