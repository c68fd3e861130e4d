"""PyTorch's fused attention, `torch.nn.functional.scaled_dot_product_attention`.

PyTorch picks the backend (cuDNN, FlashAttention-2, memory-efficient, math) per call; its `is_causal`
uses the top-left alignment this package's signature specifies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
