#!/bin/bash
# Ninth session, second H100 call: the dQ kernel's TMA path after the double-transpose fix (dQ only, all
# shapes; the compiled A/B with TMA as a configuration flag), then the TMA-reduce 5-matmul backward probe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 230 python results/h100/probes/tma_library_probe.py $OUT leaderboard,bh16-n16384-d128,bh1-n65536-d64,bh1-n16384-d64,bh1-n4096-d64,bh1-n4096-d128 dq 2>&1 | grep -v Warning | tee $OUT/tma-library-probe.log
timeout -s INT -k 20 320 python results/h100/probes/tma_reduce_dq_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/tma-reduce-dq-probe.log
