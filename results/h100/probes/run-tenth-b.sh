#!/bin/bash
# Tenth session, call B (H100): second tf32x3 tuning round (wider 32-query search space) from an empty cache,
# then the fp32 graph-timed sweep against sdpa-efficient using that cache (flash_autotune.select reads it first).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS336_FLASH_CACHE=$OUT/tune-cache.json
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
mkdir -p /tmp/tune
for spec in 1,16384,64:90 1,4096,64:40 1,1024,64:40 1,16384,128:90 1,4096,128:40 1,1024,128:40 \
            1,16384,32:60 1,1024,32:30 1,16384,16:60 1,1024,16:30; do
  shape=${spec%:*}; limit=${spec#*:}
  step tune fp32 $shape
  timeout -s INT -k 10 $limit python -m cs336_systems.attention.flash_autotune --dtype fp32 --shape $shape --json /tmp/tune/${shape//,/-}.json 2>&1 | grep -v Warning | tail -3 | tee -a $log
done
python -c "
import glob, json
out = [r for f in sorted(glob.glob('/tmp/tune/*.json')) for r in json.load(open(f))['results']]
json.dump({'results': out}, open('$OUT/tune-fp32.json', 'w'), indent=1)"
step fp32-graph
timeout -s INT -k 20 200 python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=flash-fp32-graph --benchmark-json=$OUT/fp32-graph.json 2>&1 | tail -3 | tee -a $log
step done
