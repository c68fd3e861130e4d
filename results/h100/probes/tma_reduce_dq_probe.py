"""Probe (ninth session): FA2's 5-matmul backward with dQ accumulated through TMA bulk reductions.

The eighth session's atomic-dQ backward (dS^T K added into a float32 dQ buffer inside the dK/dV kernel, one
P recomputation per score instead of two) lost because Triton emitted one scalar `red.global.add.f32` per
element: 1.07e9 adds at the leaderboard shape cost ~1.9 ms.  A tensor descriptor's `atomic_add` lowers to
`cp.reduce.async.bulk.tensor` on Hopper: the (BLOCK_M, d) float32 tile goes to shared memory and the TMA
unit adds it into global memory (L2) as one bulk operation, which is how FlashAttention-3 accumulates dQ.

Count (leaderboard, B*H 16, N 16384, d 64, causal): dK/dV now 2.39 ms for 4 matmuls per score; a fifth adds
~0.6 ms at the same rate; the dQ kernel (1.14-1.33 ms) and its 3 matmuls go away; the reductions move
B*H*Nq*d*4 bytes * (Nk/BLOCK_N)/2 = 4.3 GB (BLOCK_N 64) or 2.1 GB (BLOCK_N 128) through L2.  Prediction:
a win if the bulk reductions cost < ~0.6 ms, i.e. > ~4-7 TB/s of L2 reduction bandwidth: unknown, so measured.

Variants of one probe kernel (causal, N a multiple of both tiles, contiguous (BH, N, d)), same run:
  REDUCE=0  dK/dV only (the library's 4-matmul kernel, re-implemented here with descriptor loads of Q/dO);
  REDUCE=1  plus dQ += dS^T K through the dQ descriptor's atomic_add (bulk reduction);
  REDUCE=2  plus the same through per-element tl.atomic_add (the eighth session's variant).
Each against the library's backward (dQ kernel + dK/dV kernel) at the committed tiles; gradients compared.
    PYTHONPATH=$PWD python results/h100/probes/tma_reduce_dq_probe.py OUT_DIR
"""

import json
import math
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems import benchmarking
from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention import flash_triton

LOG2E = 1.4426950408889634


@triton.jit
def _tile(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ACC, L, Dvec, row0, offs_n, offs_m0, offs_d, start, end,
          qk_scale, MASK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, REDUCE: tl.constexpr):
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        q = q_desc.load([row0 + start_m, 0])  # (BLOCK_M, d)
        do = do_desc.load([row0 + start_m, 0])
        lse = tl.load(L + row0 + offs_m) * 1.4426950408889634
        delta = tl.load(Dvec + row0 + offs_m)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASK:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q)
        if REDUCE == 1:
            dq_desc.atomic_add([row0 + start_m, 0], tl.dot(tl.trans(dsT), k))
        elif REDUCE == 2:
            tl.atomic_add(DQ_ACC + (row0 + offs_m[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :],
                          tl.dot(tl.trans(dsT), k), sem="relaxed")
    return dk, dv


@triton.jit
def dkdv_dq_kernel(K, V, L, Dvec, DK, DV, DQ_ACC, q_desc, do_desc, dq_desc, n, sm_scale: tl.constexpr,
                   qk_scale: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   REDUCE: tl.constexpr):
    """Grid (N / BLOCK_N, BH); causal; K, V tile resident; query tiles from the diagonal band to the end."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    row0 = bh * n
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tile = (row0 + offs_n[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + tile)
    v = tl.load(V + tile)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo = start_n // BLOCK_M * BLOCK_M
    band_end = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    offs_m0 = tl.arange(0, BLOCK_M)
    dk, dv = _tile(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ACC, L, Dvec, row0, offs_n, offs_m0, offs_d, lo,
                   band_end, qk_scale, True, BLOCK_M, HEAD_DIM, REDUCE)
    dk, dv = _tile(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ACC, L, Dvec, row0, offs_n, offs_m0, offs_d,
                   band_end, n, qk_scale, False, BLOCK_M, HEAD_DIM, REDUCE)
    tl.store(DK + tile, (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + tile, dv.to(DV.dtype.element_ty))


def run_variant(q, k, v, do, lse, delta, dk, dv, dq_acc, block_m, block_n, warps, stages, reduce):
    bh, n, d = q.shape
    rows = bh * n
    q_desc = TensorDescriptor(q.view(rows, d), [rows, d], [d, 1], [block_m, d])
    do_desc = TensorDescriptor(do.view(rows, d), [rows, d], [d, 1], [block_m, d])
    dq_desc = TensorDescriptor(dq_acc.view(rows, d), [rows, d], [d, 1], [block_m, d])
    sm_scale = 1.0 / math.sqrt(d)
    dkdv_dq_kernel[(n // block_n, bh)](k, v, lse, delta, dk, dv, dq_acc, q_desc, do_desc, dq_desc, n,
                                       sm_scale=sm_scale, qk_scale=sm_scale * LOG2E, HEAD_DIM=d, BLOCK_M=block_m,
                                       BLOCK_N=block_n, REDUCE=reduce, num_warps=warps, num_stages=stages)


SHAPES = {"leaderboard": (16, 16384, 64), "bh16-n16384-d128": (16, 16384, 128), "bh1-n65536-d64": (1, 65536, 64)}
TILES = {64: [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3)],
         128: [(64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 1)]}


def timed(fn, rounds=20):
    m = benchmarking.measure(lambda: fn, warmup=3, rounds=rounds, device="cuda",
                             before_each=benchmarking.L2Flush("cuda"), timing="device")
    return round(m.stats.median * 1e3, 4)


def main(out_dir):
    out = {"device": torch.cuda.get_device_name(), "shapes": {}}
    path = f"{out_dir}/tma-reduce-dq-probe.json"
    for name, (bh, n, d) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        sel = flash_triton._select(q, k, True)
        o, lse = flash_triton._forward(q, k, v, True)
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def library():
            launch.dq(q, k, v, do, lse, delta, dq, True, sel["dq"], o=o)
            launch.dkdv(q, k, v, do, lse, delta, dk, dv, True, sel["dkdv"])

        library()
        ref = [t.float().clone() for t in (dq, dk, dv)]
        dq_acc = torch.zeros(bh, n, d, device="cuda", dtype=torch.float32)
        row = {"library_configs": {kk: c.short() for kk, c in sel.items()},
               "library_bwd_ms": timed(library),
               "zero_acc_ms": timed(lambda: dq_acc.zero_()),
               "convert_ms": timed(lambda: dq.copy_(dq_acc * (1.0 / math.sqrt(d)))),
               "variants": {}, "errors": {}}
        print(name, row, flush=True)
        for tiles in TILES[d]:
            for reduce in (0, 1, 2):
                label = f"{tiles[0]}x{tiles[1]}w{tiles[2]}s{tiles[3]} reduce{reduce}"
                try:
                    dq_acc.zero_()
                    run_variant(q, k, v, do, lse, delta, dk, dv, dq_acc, *tiles, reduce)
                    torch.cuda.synchronize()
                    err = {"dk": float((dk.float() - ref[1]).abs().max() / ref[1].abs().max()),
                           "dv": float((dv.float() - ref[2]).abs().max() / ref[2].abs().max())}
                    if reduce:
                        got = dq_acc * (1.0 / math.sqrt(d))
                        err["dq"] = float((got - ref[0]).abs().max() / ref[0].abs().max())
                    ms = timed(lambda tiles=tiles, reduce=reduce: run_variant(
                        q, k, v, do, lse, delta, dk, dv, dq_acc, *tiles, reduce))
                    row["variants"][label] = {"ms": ms, "rel_err": err}
                except Exception as exc:
                    row["errors"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(name, label, row["variants"].get(label, row["errors"].get(label)), flush=True)
                out["shapes"][name] = row
                json.dump(out, open(path, "w"), indent=1)
        del q, k, v, do, o, lse, delta, dq, dk, dv, dq_acc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
