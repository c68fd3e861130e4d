"""Probe (eighth session, second TMA call): can TMA pay anywhere, and can the library use it at all?

1. Feasibility: a `torch.library.triton_op` that builds a host-side `TensorDescriptor` and launches through
   `wrap_triton`, called eagerly and under torch.compile(fullgraph=True) twice with different tensors (a
   descriptor baked into the graph as a constant would read the first call's memory the second time).
2. Forward and dQ with their streamed K and V tiles loaded through descriptors (variant kernels below;
   causal, N a multiple of the tiles, contiguous (B*H*N, d) views), against the committed pointer kernels.
3. dK/dV through descriptors at the 64-query tiles the first TMA probe found competitive.
Each kernel alone at the leaderboard shape, two interleaved passes, device time, L2 flushed, harness warm-up.
    PYTHONPATH=$PWD python results/h100/probes/tma_all_probe.py OUT_DIR
"""

import importlib.util
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems import benchmarking
from cs336_systems.attention import flash_launch as launch
from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_configs import TileConfig

_spec = importlib.util.spec_from_file_location("tma_dkdv", os.path.join(os.path.dirname(__file__), "tma_dkdv_probe.py"))
tma_dkdv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tma_dkdv)

LOG2E = 1.4426950408889634


@triton.jit
def _scale_rows_kernel(x_desc, Y, n_rows, BLOCK: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0) * BLOCK
    x = x_desc.load([row, 0])
    offs = row + tl.arange(0, BLOCK)
    tl.store(Y + offs[:, None] * D + tl.arange(0, D)[None, :], x * 2, mask=offs[:, None] < n_rows)


@triton_op("probe::tma_double", mutates_args={})
def tma_double(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    desc = TensorDescriptor(x, list(x.shape), [x.shape[1], 1], [64, x.shape[1]])
    wrap_triton(_scale_rows_kernel)[(triton.cdiv(x.shape[0], 64),)](desc, y, x.shape[0], BLOCK=64, D=x.shape[1])
    return y


def feasibility() -> dict:
    out = {}
    try:
        a = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
        out["eager_ok"] = bool(torch.equal(tma_double(a), a * 2))
        compiled = torch.compile(lambda t: tma_double(t) + 1, fullgraph=True)
        out["compiled_first_ok"] = bool(torch.equal(compiled(a), a * 2 + 1))
        out["compiled_second_ok"] = bool(torch.equal(compiled(b), b * 2 + 1))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
    return out


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, offs_m, offs_n0, start, end, qk_scale,
              MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        k = k_desc.load([row0 + start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where(offs_m[:, None] >= (start_n + offs_n0)[None, :], qk * qk_scale, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row0 + start_n, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_tma_kernel(Q, k_desc, v_desc, O, L, n, qk_scale: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    row0 = (bh * n).to(tl.int32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (bh * n + offs_m[:, None]) * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e6, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = start_m // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, offs_m, tl.arange(0, BLOCK_N), 0, full_end,
                              qk_scale, False, BLOCK_N)
    acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, offs_m, tl.arange(0, BLOCK_N), full_end,
                              start_m + BLOCK_M, qk_scale, True, BLOCK_N)
    tl.store(O + (bh * n + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))
    tl.store(L + bh * n + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def fwd_tma(q, k, v, o, lse, cfg):
    bh, n, d = q.shape
    k_desc = TensorDescriptor(k, [bh * n, d], [d, 1], [cfg.block_n, d])
    v_desc = TensorDescriptor(v, [bh * n, d], [d, 1], [cfg.block_n, d])
    fwd_tma_kernel[(n // cfg.block_m, bh)](q, k_desc, v_desc, o, lse, n, qk_scale=LOG2E / math.sqrt(d), HEAD_DIM=d,
                                           **cfg.launch_kwargs())


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_desc, v_desc, row0, offs_m, offs_n0, start, end, qk_scale,
             MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        k = k_desc.load([row0 + start_n, 0])
        v = v_desc.load([row0 + start_n, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(offs_m[:, None] >= (start_n + offs_n0)[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def dq_tma_kernel(Q, k_desc, v_desc, DO, L, Dvec, DQ, O, n, sm_scale: tl.constexpr, qk_scale: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    row0 = (bh * n).to(tl.int32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tile = (bh * n + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + tile)
    do = tl.load(DO + tile)
    lse2 = tl.load(L + bh * n + offs_m) * 1.4426950408889634
    delta = tl.sum(tl.load(O + tile).to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Dvec + bh * n + offs_m, delta)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = start_m // BLOCK_N * BLOCK_N
    dq = _dq_tile(dq, q, do, lse2, delta, k_desc, v_desc, row0, offs_m, tl.arange(0, BLOCK_N), 0, full_end, qk_scale,
                  False, BLOCK_N)
    dq = _dq_tile(dq, q, do, lse2, delta, k_desc, v_desc, row0, offs_m, tl.arange(0, BLOCK_N), full_end,
                  start_m + BLOCK_M, qk_scale, True, BLOCK_N)
    tl.store(DQ + tile, (dq * sm_scale).to(DQ.dtype.element_ty))


def dq_tma(q, k, v, do, lse, delta, dq, o, cfg):
    bh, n, d = q.shape
    k_desc = TensorDescriptor(k, [bh * n, d], [d, 1], [cfg.block_n, d])
    v_desc = TensorDescriptor(v, [bh * n, d], [d, 1], [cfg.block_n, d])
    sm_scale = 1.0 / math.sqrt(d)
    dq_tma_kernel[(n // cfg.block_m, bh)](q, k_desc, v_desc, do, lse, delta, dq, o, n, sm_scale=sm_scale,
                                          qk_scale=sm_scale * LOG2E, HEAD_DIM=d, **cfg.launch_kwargs())


SWEEP = {
    "fwd": ["64x128w4s3", "64x64w4s3", "128x64w8s3", "128x128w8s2", "64x128w4s4", "128x64w4s3"],
    "dq": ["128x64w8s3", "64x64w4s3", "128x32w8s3", "128x128w8s2", "64x128w4s3", "128x64w8s4"],
    "dkdv": ["64x64w4s3", "64x64w4s4", "64x64w8s3", "128x64w8s3", "64x128w8s4", "128x128w8s2"],
}


def timed(fn):
    m = benchmarking.measure(lambda: fn, warmup=5, rounds=30, device="cuda",
                             before_each=benchmarking.L2Flush("cuda"), timing="device")
    return round(m.stats.median * 1e3, 4)


def main(out_dir):
    out = {"device": torch.cuda.get_device_name(), "feasibility": feasibility(), "ms": {}, "rel_err": {},
           "errors": {}}
    print("feasibility", out["feasibility"], flush=True)
    bh, n, d = 16, 16384, 64
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sel = flash_triton._select(q, k, True)
    o, lse = flash_triton._forward(q, k, v, True)
    delta = torch.empty_like(lse)
    res = {"o": torch.empty_like(q), "lse": torch.empty_like(lse), "dq": torch.empty_like(q),
           "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
    pointer = {
        "fwd": lambda: launch.forward(q, k, v, res["o"], res["lse"], True, sel["fwd"]),
        "dq": lambda: launch.dq(q, k, v, do, lse, delta, res["dq"], True, sel["dq"], o=o),
        "dkdv": lambda: launch.dkdv(q, k, v, do, lse, delta, res["dk"], res["dv"], True, sel["dkdv"]),
    }
    tma = {
        "fwd": lambda c: fwd_tma(q, k, v, res["o"], res["lse"], c),
        "dq": lambda c: dq_tma(q, k, v, do, lse, delta, res["dq"], o, c),
        "dkdv": lambda c: tma_dkdv.dkdv_tma(q, k, v, do, lse, delta, res["dk"], res["dv"], c),
    }
    produced = {"fwd": ("o",), "dq": ("dq",), "dkdv": ("dk", "dv")}
    pointer["dq"]()
    for kernel in ("fwd", "dq", "dkdv"):
        pointer[kernel]()
        refs = [res[p].float().clone() for p in produced[kernel]]
        variants = {f"pointer {sel[kernel].short()}": pointer[kernel]}
        for text in SWEEP[kernel]:
            cfg = TileConfig.parse(text)
            try:
                tma[kernel](cfg)
                torch.cuda.synchronize()
                out["rel_err"][f"{kernel} tma {text}"] = max(
                    float((res[p].float() - r).abs().max() / r.abs().max()) for p, r in zip(produced[kernel], refs))
                variants[f"tma {text}"] = lambda cfg=cfg, kernel=kernel: tma[kernel](cfg)
            except Exception as exc:
                out["errors"][f"{kernel} tma {text}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for _ in range(2):
            for name, fn in variants.items():
                out["ms"].setdefault(f"{kernel} {name}", []).append(timed(fn))
        for name in variants:
            print(kernel, name, out["ms"][f"{kernel} {name}"], flush=True)
        json.dump(out, open(f"{out_dir}/tma-all-probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
