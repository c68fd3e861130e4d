#!/bin/bash
# Eighth session: the TMA-descriptor dK/dV variant (tma_dkdv_probe.py), then the leaderboard group again
# with the committed code (a third sample of Must 1's <= 5.3 ms line; same code as run-2026-11-21-seventh-final).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout -s INT -k 20 240 python results/h100/probes/tma_dkdv_probe.py $OUT 2>&1 | grep -v Warning | tee $OUT/tma-dkdv-probe.log
timeout -s INT -k 20 200 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=leaderboard --benchmark-json=$OUT/leaderboard.json 2>&1 | tail -3
