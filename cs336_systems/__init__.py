"""cs336_systems: LLM-systems building blocks and the benchmark harness that measures them.

Public modules:
  model         Transformer LM and the SIZES registry (`build(size, **overrides)`)
  attention     attention implementations behind one signature, chosen by name
  benchmarking  the one timing harness (warm-up, synchronization, statistics, OOM capture)
  flops         FLOP counts and MFU, with their sources
  amp           precision modes (fp32, bf16 / fp16 autocast)
  workloads     forward / forward-backward / train-step callables built from a model
  attention_workloads  attention benchmark steps with an accuracy check before timing
  matrix        benchmarks.json loading and validation
  gates         in-run ratio gates declared in benchmarks.json
  machine       device facts (GPU name, versions, peak throughput lookup)
  report        saved pytest-benchmark JSON -> Markdown tables (CLI for plots, --compare, --readme too)
  plots         PNG plots of saved runs (matplotlib, the `plot` extra)
  run_compare   two saved runs side by side with deltas
  readme_results  the README's generated Results block
  baseline      committed per-GPU baselines for pytest-benchmark's saved-run comparison
  profiling     NVTX ranges, torch.profiler kernel summaries per phase
  profile       CLI: one LM case profiled, with the handout's answers
  memory        CUDA memory snapshots of the measured steps, parsed into text
  checkpointing activation-checkpointing policies (none, every-k, sqrt)
  parallel      DDP wrappers, ZeRO-1 ShardedOptimizer, FSDP, collectives benchmarks, launch helpers
  accounting    analytic memory / communication models (XXL model, FSDP x TP batch, DDP bucket model); CLI
"""

__version__ = "0.1.0"
