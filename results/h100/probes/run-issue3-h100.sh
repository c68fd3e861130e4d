#!/bin/bash
# Issue 3's remaining GPU groups (2026-11-21, fourth session): the handout sweep's flash-triton contrast and
# the fp32 flash sweeps. SIGINT on timeout so pytest-benchmark still writes what it measured.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { g=$1; t=$2; step $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$g.json 2>&1 | tail -3 | tee -a $log; }
group attention-flash 250
group flash-fp32-short 150
group flash-fp32-long 150
step done
