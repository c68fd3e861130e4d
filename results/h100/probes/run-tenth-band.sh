#!/bin/bash
# Tenth session: TMA band mode probe (each kernel alone, then the compiled forward+backward A/B/C).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -k 10 500 python results/h100/probes/tma_band_probe.py $OUT 2>&1 | grep -v Warn > $OUT/run.log
tail -c 6000 $OUT/run.log
