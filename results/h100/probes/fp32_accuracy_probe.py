"""fp32 accuracy of flash-triton's two dot modes against float64, next to naive fp32 and sdpa-efficient.

For each shape: O, dQ, dK, dV from random fp32 inputs (randn), max |error| / max |reference| against the
same computation in float64.  Writes JSON to argv[1].  Tenth session (tf32x3 became the fp32 default).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import FlashAttentionTriton


def naive(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def run(fn, q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, causal)
    o.backward(do.to(o.dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


def flash(mode):
    def fn(q, k, v, causal):
        os.environ["CS336_FLASH_FP32_DOT"] = mode
        return FlashAttentionTriton.apply(q, k, v, causal)
    return fn


def sdpa_efficient(q, k, v, causal):
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main(path):
    impls = {"flash-tf32x3": flash("tf32x3"), "flash-ieee": flash("ieee"), "naive-fp32": naive,
             "sdpa-efficient": sdpa_efficient}
    rows = []
    for (b, h, n, d) in [(1, 4, 1000, 64), (1, 4, 1000, 128), (1, 2, 4096, 64), (1, 2, 4096, 128), (1, 1, 16384, 128)]:
        g = torch.Generator("cuda").manual_seed(n + d)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=g) for _ in range(4))
        ref = run(naive, q.double(), k.double(), v.double(), do.double(), True)
        row = {"shape": [b, h, n, d], "causal": True}
        for name, fn in impls.items():
            got = run(fn, q, k, v, do, True)
            row[name] = {t: float((a.double() - r).abs().max() / r.abs().max())
                         for t, a, r in zip(("O", "dQ", "dK", "dV"), got, ref)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "metric": "max |x - x_float64| / max |x_float64|", "rows": rows}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
