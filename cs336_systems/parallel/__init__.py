"""Distributed training building blocks: collectives benchmarks, DDP wrappers, ZeRO-1, FSDP, launch helpers.

Modules:
  launch  process-group setup for torchrun (env://) and the hang-proof `spawn` used by multi-process tests
  ddp     data-parallel wrappers with one interface (.module, forward, finish_gradient_synchronization,
          no_sync): NaiveDDP, FlatDDP, DDPIndividualParameters, DDPBucketed; SyncStats timing record
  zero    ShardedOptimizer: ZeRO-1 optimizer-state sharding ("broadcast" and "zero1" modes)
  fsdp    FSDP: sharded Linear/Embedding weights, prefetched all-gathers, reduce-scattered gradients
  comm    all-reduce timing with nccl-tests-style algorithm / bus bandwidth
"""

from cs336_systems.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP, SyncStats
from cs336_systems.parallel.fsdp import FSDP, default_shard_predicate
from cs336_systems.parallel.zero import ShardedOptimizer
