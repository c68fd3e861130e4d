#!/bin/bash
# Next 2xH200 run, part 1 (prepared 2026-11-21, sixth session; ~6 min): is the bf16 noise host contention,
# and does giving each rank its own physical cores remove it?  World 1, world 2 default, world 2 pinned
# (bf16_affinity_probe.py), then, only if pinning helps, the bf16 DDP group pinned (pin-rank.sh).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
{ uptime; lscpu; nproc; command -v taskset; } > $OUT/host.txt 2>&1
for cfg in "1 none" "2 none" "2 split"; do
  set -- $cfg
  step "probe world $1 pin $2"
  PIN=$2 timeout -k 10 150 torchrun --nproc-per-node=$1 results/h200x2/bf16_affinity_probe.py $OUT/probe-w$1-$2.json 2>&1 | grep -v Warning | tail -6 | tee -a $log
done
step "ddp-bf16 pinned"
timeout -s INT -k 20 200 torchrun --nproc-per-node=2 --no-python results/h200x2/pin-rank.sh python -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-bf16 --benchmark-json=$OUT/ddp-bf16-pinned.json 2>&1 | tail -2 | tee -a $log
step done
