#!/bin/bash
# Ninth session, first H100 call: the library's TMA path against its pointer loads (tma_library_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 530 python results/h100/probes/tma_library_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/tma-library-probe.log
