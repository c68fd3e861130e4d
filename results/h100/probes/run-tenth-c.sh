#!/bin/bash
# Tenth session, call C (H100): GPU tests with the committed fp32 (tf32x3) table, and the fp32 accuracy probe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step accuracy
timeout -k 10 120 python results/h100/probes/fp32_accuracy_probe.py $OUT/fp32-accuracy.json 2>&1 | grep -v Warn | tail -8 | tee -a $log
step gpu-tests
timeout -k 10 420 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider -x > $OUT/gpu-tests.log 2>&1
tail -15 $OUT/gpu-tests.log | tee -a $log
step done
