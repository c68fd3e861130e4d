#!/bin/bash
# Eighth session: Nsight Compute on the three flash kernels at the leaderboard shape (ncu_flash_kernels.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
which ncu > $OUT/ncu-version.txt 2>&1; ncu --version >> $OUT/ncu-version.txt 2>&1
timeout -s INT 400 ncu --kernel-name regex:flash_ --launch-skip 3 --launch-count 3 --set full -o $OUT/flash \
  python results/h100/probes/ncu_flash_kernels.py > $OUT/ncu-run.log 2>&1
tail -5 $OUT/ncu-run.log
ncu --import $OUT/flash.ncu-rep --page details > $OUT/ncu-details.txt 2>&1
ncu --import $OUT/flash.ncu-rep --page raw --csv > $OUT/ncu-raw.csv 2>&1
ls -la $OUT
