#!/bin/bash
# Device run (H100) of the speed issue's tuning step; writes under $OUT.  Order = priority.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS336_FLASH_CACHE=$OUT/flash-autotune-cache.json
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
A="python -m cs336_systems.attention.flash_autotune"
S=""; for n in 1024 4096 16384 65536; do for d in 16 32 64 128; do S="$S --shape 1,$n,$d"; done; done
step tune-bf16
timeout 240 $A --dtype bf16 --shape 16,16384,64 --shape 16,16384,128 $S --json $OUT/tune-bf16.json 2>&1 | grep -v Warn | tee -a $log
step leaderboard
timeout 100 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=leaderboard --benchmark-json=$OUT/leaderboard.json 2>&1 | tail -4 | tee -a $log
step gpu-tests
timeout 110 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider -k "not committed" 2>&1 | tail -6 | tee -a $log
step tune-fp32
F=""; for n in 1024 8192; do for d in 16 32 64 128; do F="$F --shape 1,$n,$d"; done; done
timeout 80 $A --dtype fp32 $F --json $OUT/tune-fp32.json 2>&1 | grep -v Warn | tee -a $log
step host-probe
timeout 40 python results/h100/probes/host_overhead_probe.py $OUT/host-overhead.json 2>&1 | tail -13 | tee -a $log
step profile
mkdir -p /tmp/prof
for p in bf16 fp32; do timeout 50 python -m cs336_systems.profile --size xl --context 512 --mode train-step --precision $p --device cuda --json /tmp/prof/xl-train-step-$p.json --md /tmp/prof/xl-train-step-$p.md > /tmp/prof/xl-$p.log 2>&1; echo "profile $p rc=$?" | tee -a $log; done
(cd /tmp && tar czf $OUT/prof.tgz prof)
step tune-fp32-full
timeout 40 $A --dtype fp32 --no-causal --shape 8,4096,64 --shape 8,4096,128 --shape 8,4096,16 --shape 8,4096,32 --json $OUT/tune-fp32-full.json 2>&1 | grep -v Warn | tee -a $log
step done
