"""AdamWMaster against torch.optim.AdamW: one update, many steps, the kernel against its PyTorch reference,
bf16 compute weights in the LM against autocast over float32 weights, state dicts and bad arguments.

Both master formats: "split" (the bf16 weight plus 16 low bits, the default) and "float32".
On the CPU the Triton kernel runs in the interpreter (the root conftest sets TRITON_INTERPRET=1 when there is
no GPU).  With float32 masters the interpreter rounds float32 -> bf16 toward zero where the GPU rounds to
nearest even (as torch does), so there the bf16 weights are checked to one bf16 step of the master, and
exactly on a GPU; split masters round with integer arithmetic, the same everywhere, and are checked exactly.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import max_examples

from cs336_systems import model as lm
from cs336_systems.optim import split_float
from cs336_systems.optim.adamw_master import MASTER_FORMATS, AdamWMaster, adamw_update_reference, linear_weights

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or "
                                                                  "TRITON_INTERPRET=1"))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(shapes, seed, *, compute: bool, impl: str, hyper: dict, fmt: str = "split"):
    """(params ours, optimizer ours, params reference, optimizer reference): the same float32 start."""
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = AdamWMaster(ours, compute_params=ours if compute else (), impl=impl, master_format=fmt, **hyper)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **hyper)
    return ours, opt, ref, ref_opt


def _steps(ours, opt, ref, ref_opt, steps, seed):
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p, r in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g).to(DEVICE).to(p.dtype)
            p.grad = grad
            r.grad = grad.float()  # the bf16 gradient, upcast: what autocast's cast-back gives
        opt.step()
        ref_opt.step()


def _assert_rounded(weights: torch.Tensor, master: torch.Tensor, *, exact: bool, fmt: str = "float32") -> None:
    """``weights`` (bf16) is ``master`` rounded: split masters, to nearest with ties away from zero
    (`split_float`); float32 masters, to nearest even, or (``exact`` False: the interpreter, which truncates)
    within one bf16 step of it, on the side of zero."""
    if fmt == "split":
        assert torch.equal(weights.view(torch.int16), split_float.split(master)[0].view(torch.int16))
        return
    if exact:
        assert torch.equal(weights, master.to(torch.bfloat16))
        return
    truncated = (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(weights, truncated)


shapes_st = st.lists(st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3)
hyper_st = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 3e-2]), "weight_decay": st.sampled_from([0.0, 0.1]),
    "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.95)]), "eps": st.sampled_from([1e-8, 1e-6]),
})


@pytest.mark.parametrize("fmt", MASTER_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=max_examples(12), deadline=None)  # ~0.1 s an example (the Triton kernel interpreted)
@given(shapes=shapes_st, hyper=hyper_st, compute=st.booleans(), steps=st.integers(1, 4), seed=st.integers(0, 99))
def test_matches_torch_adamw_on_the_masters(impl, fmt, shapes, hyper, compute, steps, seed):
    ours, opt, ref, ref_opt = _pair(shapes, seed, compute=compute, impl=impl, hyper=hyper, fmt=fmt)
    if compute:
        assert all(p.dtype == torch.bfloat16 for p in ours)
    _steps(ours, opt, ref, ref_opt, steps, seed)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(opt.master(p), r.detach(), rtol=2e-6, atol=2e-7)
        state, ref_state = opt.state[p], ref_opt.state[r]
        torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=2e-6, atol=2e-7)
        assert state["step"] == steps
        if compute:  # the model's weights are the masters rounded to bf16
            _assert_rounded(p.detach(), opt.master(p), exact=impl == "torch" or torch.cuda.is_available(), fmt=fmt)
            assert ("master_lo" in state) == (fmt == "split") and ("master" in state) == (fmt == "float32")


@pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("numel", [1, 2047, 2048, 2049, 5000])
@pytest.mark.parametrize("compute", [False, True])
def test_kernel_matches_its_reference_across_block_edges(numel, compute):
    from cs336_systems.optim import adamw_kernel

    g = torch.Generator().manual_seed(numel)
    master, m, v = (torch.randn(numel, generator=g).to(DEVICE) for _ in range(3))
    v = v.abs()
    grad = torch.randn(numel, generator=g).to(DEVICE).bfloat16()
    out = torch.full((numel,), 7.0, dtype=torch.bfloat16, device=DEVICE) if compute else None
    args = dict(decay=0.999, beta1=0.9, beta2=0.95, step_size=1e-2, sqrt_bias2=0.3, eps=1e-8)
    want = [t.clone() for t in (master, m, v)]
    want_out = out.clone() if compute else None
    adamw_update_reference(*want[:1], grad, *want[1:], want_out, **args)
    adamw_kernel.adamw_update(master, grad, m, v, out, **args)
    for got, ref in zip((master, m, v), want):
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-8)
    if compute:  # every element written, none past the end
        _assert_rounded(out, master, exact=torch.cuda.is_available())


@pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("numel", [1, 2047, 2049, 5000])
def test_split_kernel_matches_its_reference(numel):
    from cs336_systems.optim import adamw_kernel

    g = torch.Generator().manual_seed(numel)
    hi, lo = split_float.split(torch.randn(numel, generator=g))
    m, v = torch.randn(numel, generator=g), torch.randn(numel, generator=g).abs()
    grad = torch.randn(numel, generator=g).bfloat16()
    hi, lo, m, v, grad = (t.to(DEVICE) for t in (hi, lo, m, v, grad))
    args = dict(decay=0.999, beta1=0.9, beta2=0.95, step_size=1e-2, sqrt_bias2=0.3, eps=1e-8)
    want = [t.clone() for t in (hi, lo, m, v)]
    adamw_update_reference(None, grad, want[2], want[3], want[0], lo=want[1], **args)
    adamw_kernel.adamw_update(None, grad, m, v, hi, lo=lo, **args)
    torch.testing.assert_close(split_float.join(hi, lo), split_float.join(want[0], want[1]), rtol=2e-6, atol=1e-8)
    torch.testing.assert_close(m, want[2], rtol=2e-6, atol=1e-8)
    torch.testing.assert_close(v, want[3], rtol=2e-6, atol=1e-8)
    _assert_rounded(hi, split_float.join(hi, lo), exact=True, fmt="split")


@pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3000))
def test_split_kernel_keeps_every_master_bit_through_a_zero_update(patterns):
    # lr 0, no decay: the update is p * 1 - 0, so the kernel's join and split must give back every bit,
    # ties (low bits 0x8000) and signs included.  Normal and zero floats only: a GPU may flush subnormals.
    from cs336_systems.optim import adamw_kernel

    b = torch.tensor(patterns + [0x3F808000, 0xBF808000, 0x80000000, 0x7F7FFFFF], dtype=torch.int64)
    exponent = (b >> 23) & 0xFF
    b = b[((exponent > 0) & (exponent < 0xFF)) | ((b & 0x7FFFFFFF) == 0)]
    x = torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)
    hi, lo = (t.to(DEVICE) for t in split_float.split(x))
    m, v = torch.zeros(x.numel(), device=DEVICE), torch.zeros(x.numel(), device=DEVICE)
    grad = torch.zeros(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    adamw_kernel.adamw_update(None, grad, m, v, hi, lo=lo, decay=1.0, beta1=0.9, beta2=0.999, step_size=0.0,
                              sqrt_bias2=1.0, eps=1e-8)
    assert torch.equal(split_float.join(hi, lo).cpu().view(torch.int32), x.view(torch.int32))
    assert torch.equal(hi.cpu().view(torch.int16), split_float.split(x)[0].view(torch.int16))


@pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_split_kernel_turns_a_nan_update_into_a_nan_weight():
    # An inf gradient makes m = v = inf and the update inf / inf = NaN.  A GPU's NaN is 0x7FFFFFFF, whose bit
    # rounding would carry into -0.0: the weight must come out NaN (the quiet NaN), as with float32 masters.
    from cs336_systems.optim import adamw_kernel

    hi, lo = (t.to(DEVICE) for t in split_float.split(torch.ones(3)))
    m, v = torch.zeros(3, device=DEVICE), torch.zeros(3, device=DEVICE)
    grad = torch.tensor([float("inf"), 1.0, float("nan")], dtype=torch.bfloat16, device=DEVICE)
    adamw_kernel.adamw_update(None, grad, m, v, hi, lo=lo, decay=1.0, beta1=0.9, beta2=0.999, step_size=1e-3,
                              sqrt_bias2=1.0, eps=1e-8)
    assert torch.isnan(hi[[0, 2]]).all() and torch.isfinite(hi[1]) and (lo[[0, 2]] == 0).all()
    # the master 0x7FFFFFFF itself (hi 0x8000, lo -1) through a zero update: still a NaN weight
    hi = torch.tensor([-0x8000], dtype=torch.int16).view(torch.bfloat16).to(DEVICE)
    lo = torch.tensor([-1], dtype=torch.int16, device=DEVICE)
    assert torch.isnan(split_float.join(hi, lo)).all() and hi.item() == 0.0
    adamw_kernel.adamw_update(None, torch.zeros(1, dtype=torch.bfloat16, device=DEVICE), torch.zeros(1, device=DEVICE),
                              torch.zeros(1, device=DEVICE), hi, lo=lo, decay=1.0, beta1=0.9, beta2=0.999,
                              step_size=0.0, sqrt_bias2=1.0, eps=1e-8)
    assert torch.isnan(hi).all()


def _train(weights: str, steps: int, precision: str = "bf16", fmt: str = "split"):
    """Losses of ``steps`` train steps of the tiny LM: float32 weights + torch AdamW, or bf16 compute weights +
    AdamWMaster; the same seed, data and hyperparameters."""
    torch.manual_seed(0)
    model = lm.build("tiny", context_length=32, device=DEVICE)
    if weights == "master":
        opt = AdamWMaster(model.parameters(), lr=3e-3, compute_params=linear_weights(model), master_format=fmt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 10_000, (4, 32), generator=g).to(DEVICE)
    targets = torch.randint(0, 10_000, (4, 32), generator=g).to(DEVICE)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model, opt


@pytest.mark.parametrize("fmt", MASTER_FORMATS)
def test_bf16_compute_weights_train_like_autocast_over_float32_weights(fmt):
    plain, plain_model, _ = _train("float32", 8)
    master, master_model, opt = _train("master", 8, fmt=fmt)
    # step 1 sees the same bf16 roundings of the same weights (but ties): equal to bf16 GEMM noise at most
    assert master[0] == pytest.approx(plain[0], rel=1e-3)
    assert master == pytest.approx(plain, rel=2e-2)  # then the two drift by bf16 rounding only
    assert master[-1] < master[0] - 0.5  # and it learns
    for (name, p), p_plain in zip(master_model.named_parameters(), plain_model.parameters()):
        assert p.dtype == (torch.bfloat16 if "norm" not in name and "embeddings" not in name else torch.float32), name
        ours, theirs = opt.master(p), p_plain.detach()
        if fmt == "float32":  # the same bf16 weights at step 1: every element stays close
            torch.testing.assert_close(ours, theirs, rtol=0.05, atol=2e-3)
            continue
        # Split masters round ties away from zero, so a few step-1 weights differ by one bf16 step.  Adam
        # moves an element by about lr a step whatever its gradient's size, so an element whose near-zero
        # gradient that nudge flips in sign drifts by up to ~2 lr a step: a few such elements (under 0.1%),
        # within 2 lr x 8 steps; every other element agrees as closely as with float32 masters.
        close = torch.isclose(ours, theirs, rtol=0.05, atol=2e-3)
        assert close.float().mean().item() >= 0.999, name
        assert (ours - theirs).abs().max().item() <= 2 * 3e-3 * 8, name


def test_without_compute_params_it_is_torch_adamw_in_float32():
    # no bf16 anywhere (fp32 steps): the same losses as torch's AdamW to float32 rounding
    plain, _, _ = _train("float32", 5, precision="fp32")
    torch.manual_seed(0)
    model = lm.build("tiny", context_length=32, device=DEVICE)
    opt = AdamWMaster(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 10_000, (4, 32), generator=g).to(DEVICE)
    targets = torch.randint(0, 10_000, (4, 32), generator=g).to(DEVICE)
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses == pytest.approx(plain, rel=1e-5)


def test_bf16_parameters_need_compute_params():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="params not in compute_params must be float32"):
        AdamWMaster([p])


@pytest.mark.parametrize("fmt", MASTER_FORMATS)
def test_load_state_dict_keeps_the_state_as_saved(fmt):
    ours, opt, _, _ = _pair([(5, 3), (4,)], 0, compute=True, impl="torch", hyper={}, fmt=fmt)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(torch.zeros(p.shape, device=p.device)) for p in ours]
    opt2 = AdamWMaster(twins, compute_params=twins, impl="torch", master_format=fmt)
    opt2.load_state_dict(saved)
    low = "master_lo" if fmt == "split" else "master"
    for p, q in zip(ours, twins):
        q.data.copy_(p.data)  # the bf16 weights travel with the model's state dict
        for key, dtype in ((low, torch.int16 if fmt == "split" else torch.float32),
                           ("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)):
            assert opt2.state[q][key].dtype == dtype, key
            assert torch.equal(opt2.state[q][key], opt.state[p][key]), key
        assert opt2.state[q]["step"] == 1
        assert torch.equal(opt2.master(q), opt.master(p))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": -1.0}, "lr must be a finite non-negative number, got -1.0"),
    ({"eps": float("nan")}, "eps must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
    ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    ({"compute_dtype": torch.float32}, "compute_dtype must be one of"),
    ({"impl": "cuda"}, "impl must be one of .*got 'cuda'"),
    ({"master_format": "fp32"}, r"master_format must be one of \('split', 'float32'\), got 'fp32'"),
    ({"master_format": "split", "compute_dtype": torch.float16},
     "master_format 'split' needs compute_dtype torch.bfloat16, got torch.float16"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamWMaster([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_compute_params_must_be_float32_params_of_the_optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not in params"):
        AdamWMaster([a], compute_params=[b])
    c = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be float32 when the optimizer is built.*float64"):
        AdamWMaster([c], compute_params=[c])


def test_triton_impl_without_cuda_or_interpreter_is_refused(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.nn.Parameter(torch.zeros(2))
    opt = AdamWMaster([p], impl="triton")
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1"):
        opt.step()


def test_linear_weights_are_the_gemm_operands_of_the_lm():
    with torch.device("meta"):
        model = lm.build("tiny")
    names = {id(p): n for n, p in model.named_parameters()}
    got = sorted(names[id(p)] for p in linear_weights(model))
    gemm = ("qkv_proj.weight", "output_proj.weight", "w13.weight", "w2.weight", "lm_head.weight")
    assert got == sorted(n for n in names.values() if n.endswith(gemm))
    assert len(got) == 2 * 4 + 1



def test_the_master_is_the_parameters_own_float32_storage():
    p = torch.nn.Parameter(torch.randn(4, 3))
    before, where = p.detach().clone(), p.data_ptr()
    opt = AdamWMaster([p], compute_params=[p], master_format="float32")
    assert opt.master(p).data_ptr() == where and torch.equal(opt.master(p), before)  # no float32 copy made
    assert p.dtype == torch.bfloat16 and p.data_ptr() != where
    assert torch.equal(p.detach(), before.to(torch.bfloat16))


def test_split_master_keeps_only_the_low_bits_and_gives_back_the_exact_float32():
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    opt = AdamWMaster([p], compute_params=[p])  # bf16: split by default
    assert opt.master_format == "split" and set(opt.state[p]) == {"master_lo"}
    assert p.dtype == torch.bfloat16 and opt.state[p]["master_lo"].dtype == torch.int16
    assert torch.equal(opt.master(p).view(torch.int32), before.view(torch.int32))
    assert torch.equal(p.detach().view(torch.int16), split_float.split(before)[0].view(torch.int16))
    assert AdamWMaster([torch.nn.Parameter(torch.randn(2))], compute_params=(),
                       compute_dtype=torch.float16).master_format == "float32"


_SM90_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cs336_systems.optim import adamw_kernel

sig = {"p_ptr": "*fp32", "g_ptr": "*bf16", "m_ptr": "*fp32", "v_ptr": "*fp32", "w_ptr": "*bf16", "lo_ptr": "*i16",
       "n": "i32", **{name: "fp32" for name in ("decay", "beta2", "one_minus_beta1", "one_minus_beta2", "step_size",
                                                 "sqrt_bias2", "eps")},
       "HAS_COMPUTE_COPY": "constexpr", "SPLIT": "constexpr", "BLOCK": "constexpr"}
for split in (True, False):
    consts = {"HAS_COMPUTE_COPY": True, "SPLIT": split, "BLOCK": adamw_kernel.BLOCK}
    triton.compile(ASTSource(fn=adamw_kernel._adamw_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernel_compiles_for_sm90_in_both_master_formats():
    # The interpreter runs numpy, not the GPU's code generation: compile the kernel ahead of time for Hopper
    # (no GPU needed), so the split path's bit casts and integer arithmetic are known to lower.
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(("group", "match"), [
    ({"lr": -1.0}, r"param group 0: lr must be a finite non-negative number, got -1.0"),
    ({"weight_decay": float("nan")}, r"param group 0: weight_decay must be a finite non-negative number, got nan"),
    ({"betas": (2, 2)}, r"param group 0: betas must be two numbers in \[0, 1\), got \(2, 2\)"),
    ({"eps": "1e-8"}, r"param group 0: eps must be"),
])
def test_per_group_hyperparameters_are_checked_at_construction(group, match):
    """A group's own lr, betas, eps or weight_decay are checked as the defaults are (betas (2, 2) used to
    fail only at step() with a math domain error)."""
    with pytest.raises(ValueError, match=match):
        AdamWMaster([{"params": [torch.nn.Parameter(torch.zeros(2))], **group}])


def test_add_param_group_checks_hyperparameters_and_dtype():
    opt = AdamWMaster([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="param group 1: lr must be a finite non-negative number, got -1.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1.0})
    with pytest.raises(ValueError, match="param group 1: a group added after construction must hold float32 "
                                         "parameters.*torch.float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]})
    assert len(opt.param_groups) == 1  # a refused group is not kept
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.5})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("fmt", MASTER_FORMATS)
def test_a_torch_adamw_state_dict_is_refused_where_it_would_drop_the_masters(fmt):
    """torch.optim.AdamW's state has no masters: loading it into compute parameters would train the bf16
    weights without their float32 masters, so it is refused, naming the parameter and the missing key."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    plain = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    plain.step()
    q = torch.nn.Parameter(torch.randn(4, 3))
    opt = AdamWMaster([q], compute_params=[q], impl="torch", master_format=fmt)
    key = "master_lo" if fmt == "split" else "master"
    with pytest.raises(ValueError, match=rf"param group 0, parameter 0 \(shape \(4, 3\)\): the saved state has no "
                                         rf"'{key}'.*torch.optim.AdamW"):
        opt.load_state_dict(plain.state_dict())
    assert key in opt.state[q]  # nothing was loaded


def test_a_torch_adamw_state_dict_loads_where_no_master_is_needed():
    """Without compute parameters (every parameter its own master) torch's AdamW state is the same state:
    it loads, its tensor step becoming a number, and the next step matches torch's."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    plain = torch.optim.AdamW([p], lr=0.1)
    for _ in range(2):
        p.grad = torch.randn(5)
        plain.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = AdamWMaster([q], lr=0.1, impl="torch")
    opt.load_state_dict(plain.state_dict())
    assert opt.state[q]["step"] == 2 and isinstance(opt.state[q]["step"], int)
    grad = torch.randn(5)
    p.grad, q.grad = grad.clone(), grad.clone()
    plain.step()
    opt.step()
    torch.testing.assert_close(q, p)


def test_state_of_a_model_of_other_shapes_is_refused_at_load():
    a = torch.nn.Parameter(torch.randn(4, 3))
    opt = AdamWMaster([a], compute_params=[a], impl="torch")
    a.grad = torch.ones_like(a)
    opt.step()
    b = torch.nn.Parameter(torch.randn(8, 3))
    other = AdamWMaster([b], compute_params=[b], impl="torch")
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \(shape \(8, 3\)\): the saved 'master_lo' has "
                                         r"shape \(4, 3\); the state of a model of other sizes"):
        other.load_state_dict(opt.state_dict())


def test_saved_group_hyperparameters_are_checked_at_load():
    a = torch.nn.Parameter(torch.randn(3))
    opt = AdamWMaster([a], impl="torch")
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="saved param group 0: lr must be a finite non-negative number, got -1.0"):
        opt.load_state_dict(saved)


def test_fp16_compute_parameters_train_with_the_projects_grad_scaler():
    """compute_dtype float16 with `amp.grad_scaler("fp16")`: GradScaler refuses to unscale fp16 gradients in
    place, so AdamWMaster takes the scale and the inf check from it and unscales in float32: a scaled step
    equals the unscaled one, and a step with an inf gradient is skipped while the scale drops."""
    from cs336_systems import amp

    torch.manual_seed(0)
    w0 = torch.randn(6, 4)
    # small, as gradients are: scaled by GradScaler's 65536 they stay finite in fp16 (exact in fp16 either way)
    target = (torch.randn(6, 4) * 1e-3).half().float()
    plain_w = torch.nn.Parameter(w0.clone())
    plain = AdamWMaster([plain_w], compute_params=[plain_w], compute_dtype=torch.float16, impl="torch", lr=0.1)
    (plain_w.float() * target).sum().backward()
    plain.step()
    w = torch.nn.Parameter(w0.clone())
    opt = AdamWMaster([w], compute_params=[w], compute_dtype=torch.float16, impl="torch", lr=0.1)
    scaler = amp.grad_scaler("fp16", "cpu")
    scaler.scale((w.float() * target).sum()).backward()
    assert w.grad.dtype == torch.float16 and float(scaler.get_scale()) > 1
    scale = float(scaler.get_scale())
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(opt.master(w), plain.master(plain_w))
    assert opt.state[w]["step"] == 1
    before = opt.master(w).clone()
    opt.zero_grad()
    scaler.scale((w.float() * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(opt.master(w), before) and opt.state[w]["step"] == 1  # skipped
    assert float(scaler.get_scale()) < scale
