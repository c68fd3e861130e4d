#!/bin/bash
# Eighth session, first H100 call: the atomic-dQ backward probe (atomic_dq_probe.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" > $OUT/versions.txt
timeout -s INT -k 20 540 python results/h100/probes/atomic_dq_probe.py $OUT 2>&1 | tee $OUT/atomic-dq-probe.log | grep -v Warning
