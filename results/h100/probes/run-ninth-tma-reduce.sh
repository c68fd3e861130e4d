#!/bin/bash
# Ninth session: FA2's 5-matmul backward with dQ accumulated by TMA bulk reductions (tma_reduce_dq_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 500 python results/h100/probes/tma_reduce_dq_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/tma-reduce-dq-probe.log
