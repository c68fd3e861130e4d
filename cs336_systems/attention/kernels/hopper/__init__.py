"""FlashAttention kernels for Hopper (sm_90) in Gluon, Triton's experimental tile-level language (written
against Triton 3.6; importing them needs `triton.experimental.gluon`).

Every kernel module has the same small interface: `HEAD_DIMS` (the head dims it takes, bfloat16 and
float16, tensors whose strides TMA descriptors accept: `plan.tma_layout_ok`) and `launch(...)` (descriptors,
grid and launch through ``wrap``: `portable.launch.direct`, inductor's `wrap_triton`, or a
`replay.Recorder`).  What they share lives in `common`.

  common      TMA descriptors and tile widths, shared-memory rings, wgmma layouts and sliced products, the
              forward's online-softmax pieces
  forward     the forward: two warpgroups, the next tile's scores under the current P V product
  forward_ws  the warp-specialized forward (a producer warp, two consumer warpgroups) at d 64-128
  dq          dQ (and delta), one warpgroup per 64 query rows
  dkdv        dK and dV, one warpgroup per 64 keys
  backward    the fused backward at d 64-128: dQ, dK and dV from one pass, dQ by TMA reductions

Where each runs (sizes, head dims, devices) is `cs336_systems.attention.plan`'s `RULES`; its
`KERNEL_HEAD_DIMS` must equal these modules' `HEAD_DIMS` (a test checks).
"""
