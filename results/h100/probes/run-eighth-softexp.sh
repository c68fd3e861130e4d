#!/bin/bash
# Eighth session, second H100 call: the software-exp2 probe (soft_exp_probe.py) and the GPU flash tests
# with the polynomial forced on in every kernel (CS336_FLASH_SOFT_EXP=2,2,2: accuracy against float64).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 400 python results/h100/probes/soft_exp_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/soft-exp-probe.log
CS336_FLASH_SOFT_EXP=2,2,2 timeout -s INT -k 20 150 python -m pytest tests/test_flash_triton.py -m gpu -q -p no:cacheprovider -k "float64_reference or fullgraph" 2>&1 | tail -5 | tee $OUT/gpu-tests-soft2.log
