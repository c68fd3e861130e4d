"""Tools that look inside a step or answer questions analytically.

  profile         CLI: one LM case profiled (torch.profiler or NVTX), kernel summaries per phase
  kernel_summary  per-phase kernel/category summaries of a torch.profiler trace
  memory          CUDA memory snapshots of the measured steps, parsed into text
  accounting      analytic memory / communication models (pure Python)
  amp_probe       what autocast does to each tensor of a toy network; fp16 accumulation
  float8_loss     CLI: loss curves of one LM trained with bf16 and float8 Linear layers, and their verdict

Uses the library and the bench layer; never imported by them.
"""
