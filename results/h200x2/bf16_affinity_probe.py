"""Probe (prepared in the sixth session, not yet run): why do two ranks slow each other's bf16 XL step?

The fifth session's probe (`bf16_noise_probe.py`) found the bf16 XL step host-bound and the no-communication
step slower with two processes than with one (132.1 ms vs 164.3 / 146.2 ms per rank, no communication at
all), so bf16 ratios against torch DDP measure host contention.  This probe separates two explanations:

* the host CPU runs slower with two busy processes (shared physical cores / SMT siblings, caches,
  frequency): then each rank's CPU seconds per step rise with the wall time;
* the processes are descheduled or migrated (noisy vCPU placement): then CPU seconds stay flat while wall
  time and involuntary context switches rise.

PIN=split (applied before torch is imported, so every thread the process starts inherits the mask) gives
each local rank its own physical cores (`split_cores.py`).  PIN=none leaves the default.
For none / torch-ddp / bucketed 100 MiB, bf16 autocast, XL, context 512, per-rank batch 2 (the perf cases'
workload), timed as the perf cases are (`measure_across_ranks`), rank 0 writes median, IQR, per-rank
medians and per-rank CPU seconds and involuntary context switches per round (warm-up included).

    PIN=none  torchrun --nproc-per-node=1 results/h200x2/bf16_affinity_probe.py OUT.json
    PIN=none  torchrun --nproc-per-node=2 results/h200x2/bf16_affinity_probe.py OUT.json
    PIN=split torchrun --nproc-per-node=2 results/h200x2/bf16_affinity_probe.py OUT.json
"""

import os
import sys

from split_cores import cores_for_local_rank  # noqa: E402  (beside this script; imports no torch)

PINNED = None
if os.environ.get("PIN", "none") == "split":  # before torch starts any thread
    PINNED = cores_for_local_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    os.sched_setaffinity(0, PINNED)

import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cs336_systems.parallel.timing import gather_floats, measure_across_ranks  # noqa: E402
from cs336_systems.parallel.train_workloads import DistributedTrainStep  # noqa: E402

WARMUP, ROUNDS = 3, 20


def main(out: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    res: dict = {"world": dist.get_world_size(), "pin": os.environ.get("PIN", "none"),
                 "rank0_affinity": sorted(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()}
    print(f"rank {rank}: affinity {sorted(os.sched_getaffinity(0))}", flush=True)
    for variant, bucket in (("none", None), ("torch-ddp", None), ("bucketed", 100)):
        setup = lambda: DistributedTrainStep(variant=variant, size="xl", context=512, batch_size=2,  # noqa: E731
                                             precision="bf16", device=device, bucket_size_mb=bucket)
        before = resource.getrusage(resource.RUSAGE_SELF)
        m = measure_across_ranks(setup, warmup=WARMUP, rounds=ROUNDS, device=device)
        after = resource.getrusage(resource.RUSAGE_SELF)
        n = WARMUP + ROUNDS
        cpu_ms = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / n * 1e3
        invol = (after.ru_nivcsw - before.ru_nivcsw) / n
        per_rank = gather_floats([cpu_ms, invol], device)
        t = sorted(m.times_s)
        q = statistics.quantiles(t, n=4)
        name = variant if bucket is None else f"{variant}-{bucket}MiB"
        res[name] = {
            "median_ms": round(statistics.median(t) * 1e3, 2),
            "iqr_pct": round((q[2] - q[0]) / statistics.median(t) * 100, 1),
            "min_ms": round(t[0] * 1e3, 2),
            "per_rank_median_ms": [round(x * 1e3, 2) for x in m.rank_medians_s],
            # setup (model build) is inside the rusage window: compare these across runs of the same
            # variant only, not as an absolute per-step CPU cost
            "per_rank_cpu_ms_per_round": [round(r[0], 1) for r in per_rank],
            "per_rank_involuntary_switches_per_round": [round(r[1], 1) for r in per_rank],
        }
        if rank == 0:
            print(json.dumps({name: res[name]}), flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
