"""Multi-process benchmarks (cases from benchmarks.json): collectives and data-parallel training.

allreduce      backend x message size x world size: slowest rank's time per all-reduce, algbw, busbw
data_parallel  LM size x context x per-rank batch x precision x variant (x bucket size) x world size:
               step time (slowest rank), communication time / its share of the step, memory breakdown

Run with plain pytest (ranks spawned per case) or under torchrun; see perf/conftest.py.
"""

import pytest

from cs336_systems.bench.workloads import allreduce as comm
from cs336_systems.bench.workloads import data_parallel as train_workloads


@pytest.mark.suite("allreduce")
def test_allreduce(case, dist_bench):
    dist_bench(comm.allreduce_case, case=case)


@pytest.mark.suite("data_parallel")
def test_data_parallel(case, dist_bench):
    dist_bench(train_workloads.train_case, case=case)
