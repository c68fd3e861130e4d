"""The portable FlashAttention-2 kernels (`@triton.jit`: any CUDA GPU Triton supports, and the interpreter).

  kernels    the kernels: forward, split-key forward and its combine, dQ (which also stores delta), dK/dV
  launch     grids, tensor descriptors, key and group splits, and the launches of those kernels
  configs    tile configurations: shape keys, the table measured on an H100, defaults, search spaces
  autotune   the tuner and its cache (`cs336-flash-autotune`), and `select`: a call's configurations
  varlen     packed sequences (cu_seqlens): forward, dQ and dK/dV programs around the same tile loops
"""
