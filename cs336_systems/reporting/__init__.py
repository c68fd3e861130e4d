"""Saved pytest-benchmark runs -> Markdown tables, plots, the README block, comparisons, gates, baselines.

  run_files     reading a saved run (clear errors for files that are not one)
  tables        the shared helpers: entries of several runs, ordering, formatting, Markdown tables
  lm            end-to-end, warm-up, peak-memory and checkpointing tables
  attention     the attention sweep, the flash sweep and the leaderboard tables
  distributed   all-reduce bandwidth, data-parallel step and memory tables, the DDP bucket model
  render        the report CLI (`python -m cs336_systems.report`)
  plots         PNG plots (matplotlib, the `plot` extra)
  readme_block  the README's generated Results block
  compare       two saved runs side by side
  gates         the in-run ratio gates of benchmarks.json (`python -m cs336_systems.gates`)
  baseline      committed per-GPU baselines (`python -m cs336_systems.baseline`)
  significance  the statistical gate's decision on two runs' per-round samples (`--perf-gate`)
  calibration   the gate's false alarms and power on a runner: A/A and A/B sessions
                (`python -m cs336_systems.reporting.calibration`)
  history       headline cases across the saved runs in commit order

The top layer: it reads the bench layer's JSON and may use tools.accounting's analytic models; nothing
below imports it.
"""
