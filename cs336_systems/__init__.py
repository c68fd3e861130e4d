"""cs336_systems: LLM-systems building blocks and the benchmark harness that measures them.

Public modules:
  model         Transformer LM and the SIZES registry (`build(size, **overrides)`)
  attention     attention implementations behind one signature, chosen by name
  benchmarking  the one timing harness (warm-up, synchronization, statistics, OOM capture)
  flops         FLOP counts and MFU, with their sources
  amp           precision modes (fp32, bf16 / fp16 autocast)
  workloads     forward / forward-backward / train-step callables built from a model
  matrix        benchmarks.json loading and validation
  machine       device facts (GPU name, versions, peak throughput lookup)
  report        saved pytest-benchmark JSON -> Markdown tables
"""

__version__ = "0.1.0"
