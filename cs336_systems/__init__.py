"""cs336_systems: LLM-systems building blocks and the benchmark harness that measures them.

Layers (lower layers never import higher ones; docs/architecture.md):

  library      what users import
    model          Transformer LM and the SIZES registry (`build(size, **overrides)`)
    checkpointing  activation-checkpointing policies (none, every-k, sqrt)
    amp            precision modes (fp32, bf16 / fp16 autocast)
    attention      attention implementations behind one signature, chosen by name; FlashAttention-2 in
                   plain PyTorch and in Triton (attention.kernels)
    parallel       DDP wrappers, ZeRO-1 ShardedOptimizer, FSDP, launch helpers
    nvtx           named ranges for Nsight Systems and torch.profiler
    cli_args       argument validators shared by the command-line tools
  bench        the measurement core: harness, benchmarks.json matrix, FLOPs, machine facts, workloads
  tools        profile, kernel summaries, memory snapshots, accounting, autocast probes
  reporting    saved runs -> tables, plots, the README block, comparisons, gates, baselines

Command-line entry points (`python -m cs336_systems.<name>`, or the `cs336-<name>` console scripts):
report, gates, baseline, profile, memory, accounting, flash_autotune.
"""

__version__ = "0.1.0"
