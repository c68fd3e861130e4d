#!/bin/bash
# Eighth session: 128-key dQ tiles in the pointer kernel, and the compiled forward+backward A/B (dq_tiles_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 540 python results/h100/probes/dq_tiles_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/dq-tiles-probe.log
