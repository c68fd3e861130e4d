"""Probe (fifth session): is the noisy bf16 XL step the host, or the 2-rank setting?

Run under torchrun with 1 and then 2 processes on one machine: the `none` variant (each rank trains alone,
no communication) and torch DDP, bf16 autocast, XL, context 512, per-rank batch 2, timed as the perf cases
are (`measure_across_ranks`: barrier before each round, host-synchronized rounds, slowest rank), 20 rounds.
Rank 0 prints median, IQR and each rank's own median.
    torchrun --nproc-per-node=N results/h200x2/bf16_noise_probe.py OUT.json
"""

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from cs336_systems.parallel.timing import measure_across_ranks
from cs336_systems.parallel.train_workloads import DistributedTrainStep


def main(out):
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    res = {"world": dist.get_world_size()}
    for variant in ("none", "torch-ddp"):
        setup = lambda: DistributedTrainStep(variant=variant, size="xl", context=512, batch_size=2, precision="bf16",
                                             device=device)
        m = measure_across_ranks(setup, warmup=3, rounds=20, device=device)
        t = sorted(m.times_s)
        q = statistics.quantiles(t, n=4)
        res[variant] = {"median_ms": round(statistics.median(t) * 1e3, 2), "iqr_pct": round((q[2] - q[0]) / statistics.median(t) * 100, 1),
                        "min_ms": round(t[0] * 1e3, 2), "per_rank_median_ms": [round(x * 1e3, 2) for x in m.rank_medians_s]}
        if rank == 0:
            print(json.dumps({variant: res[variant]}), flush=True)
    if rank == 0:
        json.dump(res, open(out, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
