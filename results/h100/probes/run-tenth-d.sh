#!/bin/bash
# Tenth session, call D (H100): third tf32x3 tuning round (32x32 / 16-query dK/dV and dQ variants) from an empty
# cache, the fp32 graph sweep with it, then the same sweep with IEEE dots (CS336_FLASH_FP32_DOT=ieee): a same-run A/B.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS336_FLASH_CACHE=$OUT/tune-cache.json
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
mkdir -p /tmp/tune
for spec in 1,16384,128:90 1,4096,128:40 1,1024,128:40 1,16384,64:60 1,4096,64:40 1,1024,64:40; do
  shape=${spec%:*}; limit=${spec#*:}
  step tune fp32 $shape
  timeout -s INT -k 10 $limit python -m cs336_systems.attention.flash_autotune --dtype fp32 --shape $shape --json /tmp/tune/${shape//,/-}.json 2>&1 | grep -v Warning | tail -3 | tee -a $log
done
python -c "
import glob, json
out = [r for f in sorted(glob.glob('/tmp/tune/*.json')) for r in json.load(open(f))['results']]
json.dump({'results': out}, open('$OUT/tune-fp32.json', 'w'), indent=1)"
step fp32-graph tf32x3
timeout -s INT -k 20 120 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-fp32-graph --benchmark-json=$OUT/fp32-graph.json 2>&1 | tail -1 | tee -a $log
step fp32-graph ieee
CS336_FLASH_FP32_DOT=ieee timeout -s INT -k 20 200 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-fp32-graph --benchmark-json=$OUT/fp32-graph-ieee.json 2>&1 | tail -1 | tee -a $log
step done
