"""flash-triton's kernels and the Python around them.

  flash_kernels   the @triton.jit code: forward, backward preprocess, dK/dV, dQ, split-key combine
  flash_launch    grids, tensor descriptors and launches of those kernels
  flash_replay    eager calls' launches recorded once per call signature and replayed
  flash_configs   tile configurations: shape keys, the table measured on an H100, defaults, search spaces
  flash_autotune  the tuner and its cache (`python -m cs336_systems.flash_autotune`)

Imports Triton: load it lazily (cs336_systems.attention does).
"""
