#!/bin/bash
# Seventh session's third 2xH200 run (< 5 min): DDPIndividualParameters copies gradients that alias other
# memory (review finding); NCCL tests incl. the aliased case, then the fp32 DDP group (is the XL model still
# on the in-place path?).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log=$OUT/run.log
step() { echo "== $* $(date +%T)" | tee -a $log; }
step nccl-tests
timeout -k 10 150 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider > $OUT/nccl-tests.log 2>&1; echo "rc=$?" | tee -a $log
tail -3 $OUT/nccl-tests.log | tee -a $log
step ddp-fp32
timeout -s INT -k 20 150 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-fp32 --benchmark-json=$OUT/ddp-fp32.json 2>&1 | tail -3 | tee -a $log
step done
