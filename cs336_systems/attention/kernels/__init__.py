"""flash-triton's kernels and the Python that launches them.

  portable/   Triton kernels that run on any CUDA GPU and under Triton's interpreter, with their launchers,
              tile configurations and autotuner
  hopper/     Gluon kernels for sm_90 (H100, H200): asynchronous warpgroup MMAs, TMA, warp specialization
  replay      an eager call's launches recorded once per call signature and replayed

Which of them runs for a call is decided by `cs336_systems.attention.plan`, nowhere here.  Imports Triton:
load it lazily (cs336_systems.attention does).
"""
