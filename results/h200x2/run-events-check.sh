#!/bin/bash
# 2xH200, last seconds of 2026-11-21's budget: NCCL tests (the event-based sync timing on GPU), then
# torch DDP vs DDPBucketed(100 MiB) bf16 in one session with the event timing.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout -k 5 35 python -m pytest tests/test_parallel_nccl.py -q -p no:cacheprovider -x > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?" >> $OUT/run.log
timeout -s INT -k 5 40 torchrun --nproc-per-node=2 -m pytest perf/test_distributed.py -q -p no:cacheprovider --perf-profile=gpu --perf-group=ddp-bf16 -k "torch-ddp or 100MiB" --benchmark-json=$OUT/ddp-bf16-events.json > $OUT/bf16.log 2>&1; echo "bf16 rc=$?" >> $OUT/run.log
