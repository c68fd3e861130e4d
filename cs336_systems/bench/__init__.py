"""The measurement core: what every benchmark case goes through.

  harness       `measure()`: uncounted warm-up, synchronized clocks (host, CUDA-event device or CUDA-graph
                timings), statistics, peak memory of the measured rounds, OOM recorded as a result
  matrix        benchmarks.json: suites -> profiles -> grids, validated, expanded into cases and gates
  flops         FLOP counts and MFU (LM and attention formulas, with their sources)
  machine       device facts (GPU, driver, CUDA, cuDNN, torch, triton) and datasheet peaks
  rank_timing   the slowest rank per round, for the collective cases
  workloads/    one module per suite: lm, attention, data_parallel, allreduce

Depends on the library (model, attention, parallel, amp), never on reporting or tools.
"""
