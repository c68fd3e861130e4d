"""Optimizers.

  adamw_master   `AdamWMaster`: AdamW over float32 master weights for a model computing with bf16 weights,
                 one fused update kernel a tensor (`adamw_kernel`, Triton), and its PyTorch-ops reference
  split_float    a float32 kept as its bf16 rounding plus the 16 low bits (AdamWMaster's default masters)
"""
