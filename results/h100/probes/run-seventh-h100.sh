#!/bin/bash
# Seventh session's H100 run (one call, < 10 min): GPU tests of the harness's new CUDA-graph timing, the flash
# kernels (properties, fullgraph compile, a forward+backward replayed from a CUDA graph) and the committed
# tile configs; then issue 7's sweep in CUDA-graph replay time (host removed for every implementation) and,
# in the same run, the device-time sweep for contrast (host latency inside the interval at small N).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
group() { name=$1; g=$2; t=$3; step $g; timeout -s INT -k 20 $t python -m pytest perf/ -q -p no:cacheprovider --perf-profile=gpu --perf-group=$g --benchmark-json=$OUT/$name.json 2>&1 | tail -3 | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
step gpu-tests
timeout -k 10 240 python -m pytest tests/test_benchmarking.py tests/test_flash_triton.py tests/test_flash_autotune.py -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "rc=$?" | tee -a $log
tail -3 $OUT/gpu-tests.log | tee -a $log
group flash-bf16-graph flash-bf16-graph,flash-bf16-graph-small-d 200
group flash-bf16-device flash-bf16-device 130
step done
