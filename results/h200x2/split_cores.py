"""Disjoint physical cores per local rank (for the bf16 affinity probe and `pin-rank.sh`); imports no torch.

The allowed logical CPUs are grouped by (package, core id) so SMT siblings stay together, the cores are
dealt out in contiguous chunks of len(cores) // local_world_size, and a rank gets every logical CPU of its
cores.  `python split_cores.py` prints LOCAL_RANK's list comma-separated (for `taskset -c`).
"""

import os


def physical_cores(cpus: set[int]) -> list[list[int]]:
    """Logical CPUs grouped by physical core, in (package, core id) order."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = int(f.read())
            with open(f"{base}/core_id") as f:
                core = int(f.read())
        except OSError:  # no topology exposed: every logical CPU is its own core
            package, core = 0, cpu
        cores.setdefault((package, core), []).append(cpu)
    return [cores[key] for key in sorted(cores)]


def cores_for_local_rank(rank: int, world: int) -> list[int]:
    cores = physical_cores(os.sched_getaffinity(0))
    per_rank = len(cores) // world
    if per_rank == 0:
        raise RuntimeError(f"{len(cores)} physical cores for {world} local ranks")
    return sorted(cpu for core in cores[rank * per_rank:(rank + 1) * per_rank] for cpu in core)


if __name__ == "__main__":
    print(",".join(map(str, cores_for_local_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])))))
