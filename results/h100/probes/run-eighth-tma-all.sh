#!/bin/bash
# Eighth session: TMA feasibility under torch.compile and TMA variants of all three kernels (tma_all_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 420 python results/h100/probes/tma_all_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/tma-all-probe.log
