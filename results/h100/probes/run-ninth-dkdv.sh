#!/bin/bash
# Ninth session, third H100 call: the full-tile / TMA dK/dV variants (dkdv_even_tma_probe.py), then the GPU
# tests of the flash kernels with this session's changes (TMA configs, EVEN dK/dV).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 250 python results/h100/probes/dkdv_even_tma_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/dkdv-even-tma-probe.log
timeout -s INT -k 20 320 python -m pytest tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu-tests.log
