"""Distributed training building blocks: DDP wrappers, ZeRO-1, FSDP, launch helpers.

Modules:
  launch  process-group setup for torchrun (env://) and the hang-proof `spawn` used by multi-process tests
  ddp     data-parallel wrappers with one interface (.module, forward, finish_gradient_synchronization,
          no_sync): NaiveDDP, FlatDDP, DDPIndividualParameters, DDPBucketed; SyncStats timing record
  zero    ShardedOptimizer: ZeRO-1 optimizer-state sharding ("broadcast" and "zero1" modes)
  fsdp    FSDP: sharded Linear/Embedding weights, prefetched all-gathers, reduce-scattered gradients

The all-reduce benchmark and the data-parallel training steps the suite times live in
`cs336_systems.bench.workloads` (allreduce, data_parallel).
"""

from cs336_systems.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP, SyncStats
from cs336_systems.parallel.fsdp import FSDP, default_shard_predicate
from cs336_systems.parallel.zero import ShardedOptimizer

__all__ = [
    "DDPBucketed", "DDPIndividualParameters", "FSDP", "FlatDDP", "NaiveDDP", "ShardedOptimizer", "SyncStats",
    "default_shard_predicate",
]
