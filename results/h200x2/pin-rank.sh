#!/bin/bash
# torchrun --no-python results/h200x2/pin-rank.sh CMD...: run CMD on this local rank's own physical cores
# (split_cores.py), so the perf suite can be re-run pinned if the affinity probe shows pinning pays.
exec taskset -c "$(python3 "$(dirname "$0")/split_cores.py")" "$@"
