"""AdamWMaster against torch.optim.AdamW: one update, many steps, the kernel against its PyTorch reference,
bf16 compute weights in the LM against autocast over float32 weights, state dicts and bad arguments.

On the CPU the Triton kernel runs in the interpreter (the root conftest sets TRITON_INTERPRET=1 when there is
no GPU).  The interpreter rounds float32 -> bf16 toward zero where the GPU rounds to nearest even (as torch
does), so there the bf16 weights are checked to one bf16 step of the master, and exactly on a GPU.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems import model as lm
from cs336_systems.optim.adamw_master import AdamWMaster, adamw_update_reference, linear_weights

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or "
                                                                  "TRITON_INTERPRET=1"))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(shapes, seed, *, compute: bool, impl: str, hyper: dict):
    """(params ours, optimizer ours, params reference, optimizer reference): the same float32 start."""
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = AdamWMaster(ours, compute_params=ours if compute else (), impl=impl, **hyper)
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


def _assert_rounded(weights: torch.Tensor, master: torch.Tensor, *, exact: bool) -> None:
    """``weights`` (bf16) is ``master`` rounded to nearest even, or (``exact`` False: the interpreter, which
    truncates) within one bf16 step of it, on the side of zero."""
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


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=12, deadline=None)
@given(shapes=shapes_st, hyper=hyper_st, compute=st.booleans(), steps=st.integers(1, 4), seed=st.integers(0, 99))
def test_matches_torch_adamw_on_the_masters(impl, shapes, hyper, compute, steps, seed):
    ours, opt, ref, ref_opt = _pair(shapes, seed, compute=compute, impl=impl, hyper=hyper)
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
            _assert_rounded(p.detach(), opt.master(p), exact=impl == "torch" or torch.cuda.is_available())


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


def _train(weights: str, steps: int, precision: str = "bf16"):
    """Losses of ``steps`` train steps of the tiny LM: float32 weights + torch AdamW, or bf16 compute weights +
    AdamWMaster; the same seed, data and hyperparameters."""
    torch.manual_seed(0)
    model = lm.build("tiny", context_length=32, device=DEVICE)
    if weights == "master":
        opt = AdamWMaster(model.parameters(), lr=3e-3, compute_params=linear_weights(model))
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


def test_bf16_compute_weights_train_like_autocast_over_float32_weights():
    plain, plain_model, _ = _train("float32", 8)
    master, master_model, opt = _train("master", 8)
    # step 1 sees the same bf16 roundings of the same weights: equal to bf16 GEMM noise at most
    assert master[0] == pytest.approx(plain[0], rel=1e-3)
    assert master == pytest.approx(plain, rel=2e-2)  # then the two drift by bf16 rounding only
    assert master[-1] < master[0] - 0.5  # and it learns
    for (name, p), p_plain in zip(master_model.named_parameters(), plain_model.parameters()):
        assert p.dtype == (torch.bfloat16 if "norm" not in name and "embeddings" not in name else torch.float32), name
        torch.testing.assert_close(opt.master(p), p_plain.detach(), rtol=0.05, atol=2e-3)


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


def test_load_state_dict_keeps_float32_state():
    ours, opt, _, _ = _pair([(5, 3), (4,)], 0, compute=True, impl="torch", hyper={})
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(opt.master(p).detach().clone()) for p in ours]
    opt2 = AdamWMaster(twins, compute_params=twins, impl="torch")
    opt2.load_state_dict(saved)
    for p, q in zip(ours, twins):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == torch.float32, key
            assert torch.equal(opt2.state[q][key], opt.state[p][key]), key
        assert opt2.state[q]["step"] == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": -1.0}, "lr must be a finite non-negative number, got -1.0"),
    ({"eps": float("nan")}, "eps must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
    ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    ({"compute_dtype": torch.float32}, "compute_dtype must be one of"),
    ({"impl": "cuda"}, "impl must be one of .*got 'cuda'"),
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
    opt = AdamWMaster([p], compute_params=[p])
    assert opt.master(p).data_ptr() == where and torch.equal(opt.master(p), before)  # no float32 copy made
    assert p.dtype == torch.bfloat16 and p.data_ptr() != where
    assert torch.equal(p.detach(), before.to(torch.bfloat16))
