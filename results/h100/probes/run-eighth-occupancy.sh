#!/bin/bash
# Eighth session: register caps for one more resident program per SM (occupancy_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 500 python results/h100/probes/occupancy_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/occupancy-probe.log
