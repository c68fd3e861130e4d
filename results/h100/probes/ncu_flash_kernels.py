"""Probe (eighth session): launch the three flash kernels at the leaderboard shape (B*H = 16, N = 16384,
d = 64, bf16, causal, committed tiles) twice each, for Nsight Compute to profile the second launch of each:
    ncu --kernel-name regex:flash_ --launch-skip 3 --launch-count 3 --set full -o OUT/flash \
        python results/h100/probes/ncu_flash_kernels.py
(what limits each kernel: issue slots, tensor pipe, MUFU, stalls; results/h100/probes/run-eighth-ncu.sh).
"""

import torch

from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention import flash_triton

torch.manual_seed(0)
bh, n, d = 16, 16384, 64
q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
sel = flash_triton._select(q, k, True)
o, lse = torch.empty_like(q), torch.empty(bh, n, device="cuda", dtype=torch.float32)
delta = torch.empty_like(lse)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
for _ in range(2):
    launch.forward(q, k, v, o, lse, True, sel["fwd"])
    launch.dq(q, k, v, do, lse, delta, dq, True, sel["dq"], o=o)
    launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, sel["dkdv"])
torch.cuda.synchronize()
print({name: cfg.short() for name, cfg in sel.items()})
