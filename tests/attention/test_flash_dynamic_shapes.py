"""flash-triton under torch.compile at any sequence of shapes, in every dynamic-shape mode: one compiled
function called at several shapes (batch, heads, K/V heads, N, head dim, dtype, mask) must give the eager
call's results and run the kernels an eager call of that size runs; the LM compiled with it trains at
several context lengths.

On CPU the same traces run through Triton's interpreter (float32), so the choice made while tracing with
symbolic sizes (`flash_ops.flash_attn_fwd_inductor`, `plan.plan`) is exercised without a GPU."""

from __future__ import annotations

import pytest
import torch

from cs336_systems import model
from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_triton import FlashAttentionTriton

MODES = ("default", "dynamic", "static", "mark_dynamic")


def _compiled(mode: str):
    torch._dynamo.reset()
    dynamic = {"default": None, "dynamic": True, "static": False, "mark_dynamic": None}[mode]
    return torch.compile(FlashAttentionTriton.apply, fullgraph=True, dynamic=dynamic)


def _inputs(b, h, hkv, n, d, dtype, device, seed, mode):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(device, dtype) for _ in range(2))
    if mode == "mark_dynamic":
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
    return [t.requires_grad_() for t in (q, k, v)]


def _run(fn, q, k, v, causal):
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v, causal)
    o.float().square().sum().backward()
    return [t.detach().clone() for t in (o, q.grad, k.grad, v.grad)]


def _check_shapes(mode, shapes, device, tolerance):
    fn = _compiled(mode)
    for i, (b, h, hkv, n, d, dtype, causal) in enumerate(shapes):
        q, k, v = _inputs(b, h, hkv, n, d, dtype, device, i, mode)
        compiled = _run(fn, q, k, v, causal)
        eager = _run(FlashAttentionTriton.apply, q, k, v, causal)
        for name, a, e in zip(("o", "dq", "dk", "dv"), compiled, eager):
            torch.testing.assert_close(a, e, **tolerance, msg=lambda m: f"{mode} {b, h, hkv, n, d, dtype, causal} {name}: {m}")


# default and dynamic=True in the default run; static and mark_dynamic (~4 s each) are slow (`--run-slow`).
@pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="the interpreter's CPU run (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.slow] if m in ("static", "mark_dynamic") else [])
                                  for m in MODES])
def test_compiled_calls_at_changing_shapes_match_eager_in_the_interpreter(mode):
    shapes = [(2, 2, 2, 40, 16, torch.float32, True), (1, 4, 2, 72, 16, torch.float32, False),
              (2, 2, 1, 33, 32, torch.float32, True)]  # N, K/V heads, head dim and mask change between calls
    _check_shapes(mode, shapes, "cpu", dict(atol=1e-5, rtol=1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_compiled_calls_at_changing_shapes_match_eager(mode):
    """Shapes that take the Gluon kernels on Hopper (fused d 64, GQA d 128 with the Gluon dQ, the 2.7B model's
    d 80) between ones that take inductor's launches (short rows), causal and not, and a dtype change."""
    bf16, fp16 = torch.bfloat16, torch.float16
    shapes = [(1, 16, 16, 4096, 64, bf16, True), (2, 4, 4, 300, 64, bf16, False), (2, 8, 2, 1024, 128, bf16, False),
              (4, 32, 32, 512, 80, bf16, True), (1, 8, 8, 2048, 128, fp16, True), (3, 4, 1, 700, 64, bf16, True)]
    # compiled and eager calls run the same kernels, so they agree to rounding; the fused backward's dQ sums in
    # a run-dependent order (TMA reduce-adds)
    _check_shapes(mode, shapes, "cuda", dict(atol=2e-2, rtol=2e-2))


@pytest.mark.gpu
def test_gpu_compiled_lm_trains_at_several_context_lengths():
    """The LM built with flash-triton, compiled (the default automatic dynamic shapes), takes training steps at
    context 512, then 256 and 384 (the sizes become symbolic after the first change), finite losses."""
    torch.manual_seed(0)
    lm = model.build("small", vocab_size=1000, context_length=512, attention="flash-triton", device="cuda")
    lm.compile()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    for n in (512, 256, 384, 512):
        tokens = torch.randint(0, 1000, (2, n + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = lm(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.isfinite(loss), n
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        lm.eval()
        assert torch.isfinite(lm(tokens[:, :100]).float()).all()  # evaluation at yet another length
