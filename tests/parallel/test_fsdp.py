"""FSDP (cs336_systems.parallel.fsdp) against single-process training, on gloo/CPU with 2 and 3 ranks.

Each spawned job runs many cases (a spawn costs ~3 s here).  In every case each rank trains the FSDP-wrapped
model on its slice of the global batch (mean loss) and, alongside, a single-process reference on the whole
global batch; the reference computes Linear/Embedding layers the way FSDP's compute_dtype does (weights and
floating inputs cast to compute_dtype, master weights fp32) via torch.func.functional_call + pre-hooks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cs336_systems import model as lm
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.launch import spawn
from fsdp_helpers import gathered_alive

VOCAB, D_TOY, SEQ, PER_RANK_BATCH = 37, 13, 5, 3  # 37*13 = 481: padding on 2 and 3 ranks


class Toy(nn.Module):
    """Embedding -> 6 residual Linear blocks (some with a replicated bias) -> RMSNorm (replicated) -> head."""

    def __init__(self, tie: bool = False, n_blocks: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_TOY)
        self.blocks = nn.ModuleList(nn.Linear(D_TOY, D_TOY, bias=i % 2 == 0) for i in range(n_blocks))
        self.norm = lm.RMSNorm(D_TOY)
        self.head = nn.Linear(D_TOY, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)  # a non-trivial replicated parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, d)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))  # (B, T, V)


def _make_model(kind: str) -> nn.Module:
    if kind == "toy":
        return Toy()
    if kind == "toy_tied":
        return Toy(tie=True)
    if kind == "tiny":
        return lm.build("tiny", vocab_size=VOCAB, context_length=16)
    raise ValueError(kind)


def _cast_floats(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _reference_forward(ref: nn.Module, dtype: torch.dtype | None):
    """Single-process forward whose Linear/Embedding parameters and inputs are cast to ``dtype`` for compute."""
    if dtype is None:
        return ref
    cast_names = set()
    for mname, m in ref.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            cast_names.update(f"{mname}.{pname}" for pname, _ in m.named_parameters(recurse=False))
            m.register_forward_pre_hook(lambda _m, args: _cast_floats(args, dtype))

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        params = {n: (p.to(dtype) if n in cast_names else p) for n, p in ref.named_parameters()}
        return torch.func.functional_call(ref, params, (tokens,))

    return forward


def _padded_slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    flat = full.reshape(-1)
    shard = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(shard * world - flat.numel())])
    return flat[rank * shard: (rank + 1) * shard]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-8)).item()


class _Reference:
    """Single-process training on the whole global batch, Linear/Embedding computing in ``dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None, make_opt) -> None:
        self.module = copy.deepcopy(module)
        self.forward = _reference_forward(self.module, dtype)
        self.opt = make_opt(self.module.parameters())
        self.params = dict(self.module.named_parameters())

    def backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        self.opt.zero_grad()
        loss = F.cross_entropy(self.forward(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.item()


def _run_case(rank: int, world: int, model: str, optim: str, dtype: torch.dtype | None, steps: int,
              depth: int = 2, fallback: bool = False) -> dict:
    """Train FSDP and the reference(s) side by side; return the largest deviations and FSDP's counters.

    Errors named ``*_err`` compare FSDP with the reference of the same compute dtype; for low precision the
    ``lowp_*`` entries give the same metrics between that reference and an fp32 one (PyTorch's own error).
    """
    torch.manual_seed(0)
    module = _make_model(model)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}

    def make_opt(params):
        if optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    ref = _Reference(module, dtype, make_opt)
    ref32 = _Reference(module, None, make_opt) if dtype is not None else None
    fsdp = FSDP(module, compute_dtype=dtype, prefetch_depth=depth)
    fsdp._reduce_scatter_fallback = fallback  # the all-reduce + slice path (for backends without reduce-scatter)
    sharded = set(fsdp.sharded_parameter_names)
    opt = make_opt(fsdp.parameters())
    gen = torch.Generator().manual_seed(1234)
    out = dict(loss_err=0.0, grad_err=0.0, lowp_loss_err=0.0, lowp_grad_err=0.0,
               alive_after_forward=0, alive_after_backward=0)
    for step in range(steps):
        tokens = torch.randint(VOCAB, (world * PER_RANK_BATCH, SEQ), generator=gen)
        targets = torch.randint(VOCAB, (world * PER_RANK_BATCH, SEQ), generator=gen)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)  # every rank its own slice
        ref_loss = ref.backward(tokens, targets)
        if ref32 is not None:
            out["lowp_loss_err"] = max(out["lowp_loss_err"], abs(ref32.backward(tokens, targets) - ref_loss))
            out["lowp_grad_err"] = max(out["lowp_grad_err"], *(
                _rel_err(p.grad, ref32.params[n].grad) for n, p in ref.params.items()))

        if step == steps - 1:
            fsdp.reset_counters()
        opt.zero_grad()
        logits = fsdp(tokens[mine])
        out["alive_after_forward"] = max(out["alive_after_forward"], gathered_alive(fsdp))
        assert logits.dtype == (dtype or torch.float32)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets[mine].flatten())
        loss.backward()
        fsdp.finish_gradient_synchronization()
        del logits
        out["alive_after_backward"] = max(out["alive_after_backward"], gathered_alive(fsdp))

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        out["loss_err"] = max(out["loss_err"], abs(global_loss.item() / world - ref_loss))
        for name, p in fsdp.module.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == torch.float32, name
            expected = ref.params[name].grad
            if name in sharded:
                assert p.dim() == 1 and p.numel() == -(-expected.numel() // world), name
                expected = _padded_slice(expected, rank, world)
            else:
                gathered = [torch.empty_like(p.grad) for _ in range(world)]
                dist.all_gather(gathered, p.grad)
                assert all(torch.equal(g, p.grad) for g in gathered), f"replicated grad {name} differs across ranks"
            out["grad_err"] = max(out["grad_err"], _rel_err(p.grad, expected))
        for r in (ref, ref32, opt):
            if r is not None:
                (r.opt if isinstance(r, _Reference) else r).step()

    out.update(num_gathers=fsdp.num_gathers, num_reduce_scatters=fsdp.num_reduce_scatters,
               num_all_reduces=fsdp.num_all_reduces, max_live_gathered=fsdp.max_live_gathered)
    full = fsdp.gather_full_params()
    assert set(full) == set(ref.params), (sorted(full), sorted(ref.params))
    assert all(full[n].shape == p.shape and full[n].dtype == torch.float32 for n, p in ref.params.items())
    out["param_err"] = max((full[n] - p.detach()).abs().max().item() for n, p in ref.params.items())
    # Relative error of the total update (robust to the few Adam sign flips low precision causes), and the
    # smallest reference update: every parameter must have moved for the comparison to mean anything.
    ref_update = {n: p.detach() - initial[n] for n, p in ref.params.items()}
    out["update_err"] = max(_update_err(full[n] - initial[n], u) for n, u in ref_update.items())
    out["min_update"] = min(u.abs().max().item() for u in ref_update.values())
    if ref32 is not None:
        out["lowp_update_err"] = max(_update_err(u, ref32.params[n].detach() - initial[n])
                                     for n, u in ref_update.items())

    # Evaluation without autograd: same outputs as the reference, nothing left materialised.
    tokens = torch.randint(VOCAB, (2, SEQ), generator=gen)
    with torch.no_grad():
        out["eval_err"] = _rel_err(fsdp(tokens).float(), ref.forward(tokens).float())
    out["alive_after_eval"] = gathered_alive(fsdp)
    out["live_after_eval"] = fsdp.live_gathered
    return out


def _update_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def _error_cases(rank: int, world: int) -> dict[str, str]:
    errors = {}
    for key, build in {
        "dtype_int": lambda: FSDP(Toy(), compute_dtype=torch.int32),
        "dtype_str": lambda: FSDP(Toy(), compute_dtype="bf16"),
        "no_weight": lambda: FSDP(Toy(), shard=lambda m: isinstance(m, (nn.Linear, nn.ModuleList))),
        "bf16_master": lambda: FSDP(lm.build("tiny", vocab_size=VOCAB, dtype=torch.bfloat16)),
        "tied_to_replicated": lambda: FSDP(_tied_to_norm()),
        "not_module": lambda: FSDP(lambda x: x),
        "depth": lambda: FSDP(Toy(), prefetch_depth=-1),
    }.items():
        try:
            build()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
        else:
            errors[key] = "no error"
    return errors


def _tied_to_norm() -> nn.Module:
    toy = Toy()
    toy.other = nn.Module()
    toy.other.scale = toy.blocks[0].weight  # shared with a non-sharded owner under another name
    return toy


def _accumulation_case(rank: int, world: int) -> dict:
    """An MLP on float inputs, two micro-batches per rank without zero_grad / finish in between.

    The accumulated, finished gradients must equal the single-process gradient of the global mean loss; the
    first Linear's input needs no gradient, so its backward must not gather its weight again.
    """
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7, bias=False), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(mlp)
    fsdp = FSDP(mlp)
    x = torch.randn(world * 4, 5, generator=torch.Generator().manual_seed(7))
    F.mse_loss(ref(x), torch.zeros(world * 4, 3)).backward()
    for micro in x[rank * 4: (rank + 1) * 4].split(2):
        (F.mse_loss(fsdp(micro), torch.zeros(2, 3)) / 2).backward()  # the next forward settles this backward
    fsdp.finish_gradient_synchronization()
    return dict(grad_err=_grad_error(fsdp, ref, rank, world), num_gathers=fsdp.num_gathers,
                num_reduce_scatters=fsdp.num_reduce_scatters)


def _grad_error(fsdp: FSDP, ref: nn.Module, rank: int, world: int) -> float:
    """Largest relative error of the finished gradients against the unsharded model's (its slice of them)."""
    sharded = set(fsdp.sharded_parameter_names)
    err = 0.0
    for name, p in fsdp.module.named_parameters():
        expected = dict(ref.named_parameters())[name].grad
        if name in sharded:
            expected = _padded_slice(expected, rank, world)
        err = max(err, _rel_err(p.grad, expected))
    return err


def _two_backwards_case(rank: int, world: int) -> dict:
    """Two backward passes before one finish: (forward, forward, backward, backward) and one graph
    backpropagated twice (retain_graph).  Replicated gradients (the biases) must be averaged once, like the
    sharded ones; the accumulated result equals single-process training's accumulated gradients."""
    out = {}
    x = torch.randn(world * 4, 5, generator=torch.Generator().manual_seed(7))
    mine = x[rank * 4: (rank + 1) * 4]
    for pattern in ("fwd-fwd-bwd-bwd", "retain-graph"):
        torch.manual_seed(1)
        mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        ref = copy.deepcopy(mlp)
        fsdp = FSDP(mlp)
        if pattern == "fwd-fwd-bwd-bwd":
            for half in x.split(2 * world):
                F.mse_loss(ref(half), torch.zeros(len(half), 3)).backward()
            losses = [F.mse_loss(fsdp(micro), torch.zeros(2, 3)) for micro in mine.split(2)]
            for loss in losses:
                loss.backward()
        else:
            for _ in range(2):
                F.mse_loss(ref(x), torch.zeros(len(x), 3)).backward()
            loss = F.mse_loss(fsdp(mine), torch.zeros(4, 3))
            loss.backward(retain_graph=True)
            loss.backward()
        fsdp.finish_gradient_synchronization()
        out[pattern] = _grad_error(fsdp, ref, rank, world)
    # The whole wrapper under checkpoint(): its forward is recomputed inside the backward, which must not
    # drop the gathers that backward has prefetched (a recompute adds its own forward's gathers, no more).
    gathers = {}
    for whole in (False, True):
        torch.manual_seed(1)
        mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
        ref = copy.deepcopy(mlp)
        fsdp = FSDP(mlp)
        F.mse_loss(ref(x), torch.zeros(len(x), 3)).backward()
        for step in range(2):  # the second step runs with a plan, so the backward prefetches
            fsdp.zero_grad()
            fsdp.reset_counters()
            run = (lambda t: checkpoint(fsdp, t, use_reentrant=False)) if whole else fsdp
            F.mse_loss(run(mine), torch.zeros(4, 3)).backward()
            fsdp.finish_gradient_synchronization()
        gathers[whole] = fsdp.num_gathers
        out[f"checkpoint-whole={whole}"] = _grad_error(fsdp, ref, rank, world)
    out["gathers"] = gathers
    return out


class _AuxOutput(nn.Module):
    """An auxiliary output the loss may ignore: its layer's prefetched weight is left for end-of-backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.a, self.head = nn.Embedding(11, 7), nn.Linear(7, 7, bias=False), nn.Linear(7, 11, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        aux = self.a(x)  # first in forward, so last in backward's plan: ``a`` stays gathered for it
        return self.head(x + torch.tanh(self.a(x))), aux


def _recovery_case(rank: int, world: int) -> dict:
    """A backward that raises (a gradient check failing), then normal steps: outputs keep matching the
    unsharded model, and no gather is left over after each later backward."""
    torch.manual_seed(0)
    model = _AuxOutput()
    ref = copy.deepcopy(model)
    fsdp = FSDP(model)
    opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    out = dict(raised=False, fwd_err=0.0, live_after_backward=0)
    failing = [False]

    def fail_at_the_end_of_backward(module, inputs, output):  # the embedding's output: backward's last step
        if failing[0]:
            output.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("non-finite gradient")))

    model.emb.register_forward_hook(fail_at_the_end_of_backward)
    for step in range(4):
        tokens, targets = (torch.randint(11, (world * 2, 5), generator=gen) for _ in range(2))
        mine = slice(rank * 2, rank * 2 + 2)
        if step == 1:
            failing[0] = True
            logits, _ = fsdp(tokens[mine])
            failing[0] = False
            try:
                F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()
            except RuntimeError:
                out["raised"] = True
            del logits
            fsdp.finish_gradient_synchronization()
        ref_opt.zero_grad()
        ref_logits, _ = ref(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        opt.zero_grad()
        logits, _ = fsdp(tokens[mine])
        out["fwd_err"] = max(out["fwd_err"], (logits - ref_logits[mine]).abs().max().item())
        F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()
        fsdp.finish_gradient_synchronization()
        out["live_after_backward"] = max(out["live_after_backward"], fsdp.live_gathered)
        opt.step()
        ref_opt.step()
    return out


def _job(rank: int, world: int, cases: list[dict], with_errors: bool) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FSDP must emit no warnings
        results = [_run_case(rank, world, **case) for case in cases]
        accumulation = _accumulation_case(rank, world)
        two_backwards = _two_backwards_case(rank, world)
        recovery = _recovery_case(rank, world)
    return {"cases": results, "accumulation": accumulation, "two_backwards": two_backwards, "recovery": recovery,
            "errors": _error_cases(rank, world) if with_errors else None}


FP32_TOL = dict(loss=1e-5, grad=1e-5, update=1e-4, param=1e-5, eval=1e-5)
CASES_2 = [
    dict(model="toy", optim="adamw", dtype=None, steps=3),
    dict(model="toy", optim="sgd", dtype=None, steps=3, depth=0, fallback=True),
    dict(model="toy_tied", optim="adamw", dtype=None, steps=3),
    dict(model="toy", optim="adamw", dtype=torch.bfloat16, steps=3),
    dict(model="toy", optim="sgd", dtype=torch.float16, steps=3),
    dict(model="tiny", optim="adamw", dtype=None, steps=2),
    dict(model="tiny", optim="adamw", dtype=torch.bfloat16, steps=2),
]
CASES_3 = [
    dict(model="toy", optim="adamw", dtype=None, steps=3),
    dict(model="toy_tied", optim="sgd", dtype=torch.bfloat16, steps=3),
    dict(model="tiny", optim="sgd", dtype=None, steps=2),
]


def _expected_comms(model: str) -> tuple[int, int]:
    """Per step: (sharded forward calls, those whose backward needs the weight).

    Embeddings never need their weight in backward; every Linear here gets an input that requires grad.
    """
    if model == "tiny":  # embedding + 2 x (qkv, out, w13, w2) + head
        return 10, 9
    return 8, 7  # embedding + 6 blocks + head (tied or not)


def _check_accuracy(case: dict, got: dict, where: str) -> None:
    if case["dtype"] is None:
        for key, tol in FP32_TOL.items():
            assert got[f"{key}_err"] <= tol, f"{key}: {where}"
        return
    # Low precision: FSDP may deviate from the same-precision reference by at most twice what PyTorch's own
    # low-precision computation deviates from fp32 (+ one ulp at 1), the accuracy bound FSDP is held to.
    eps = torch.finfo(case["dtype"]).eps
    for key in ("loss", "grad", "update"):
        assert got[f"{key}_err"] <= 2 * got[f"lowp_{key}_err"] + eps, f"{key}: {where}"
    assert got["eval_err"] <= 4 * eps, f"eval: {where}"


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (3, CASES_3)], ids=["2ranks", "3ranks"])
def test_fsdp_matches_single_process(world, cases):
    result = spawn(_job, world, cases, world == 2, timeout_s=120)
    for rank, per_rank in enumerate(result):
        for case, got in zip(cases, per_rank["cases"]):
            where = f"rank {rank} {case}: {got}"
            _check_accuracy(case, got, where)
            assert got["min_update"] > 1e-3, where  # training moved every parameter
            # Freed after use: no full weight survives a forward (autograd keeps none) or a backward.
            assert got["alive_after_forward"] == 0 and got["alive_after_backward"] == 0, where
            assert got["alive_after_eval"] == 0 and got["live_after_eval"] == 0, where
            # Prefetch: at most `depth` layers ahead of the running one, and it really happens.
            assert got["max_live_gathered"] == case.get("depth", 2) + 1, where
            fwd, bwd = _expected_comms(case["model"])
            assert got["num_gathers"] == fwd + bwd, where
            assert got["num_reduce_scatters"] == fwd, where
            assert got["num_all_reduces"] == 1, where  # the replicated gradients: one flat fp32 all-reduce
    for per_rank in result:
        acc = per_rank["accumulation"]
        assert acc["grad_err"] <= FP32_TOL["grad"], acc
        # 2 micro-batches x (3 forward gathers + 2 backward: the first layer's input needs no grad)
        assert acc["num_gathers"] == 2 * (3 + 2) and acc["num_reduce_scatters"] == 2 * 3, acc
        two = per_rank["two_backwards"]
        assert two["fwd-fwd-bwd-bwd"] <= FP32_TOL["grad"] and two["retain-graph"] <= FP32_TOL["grad"], two
        assert two["checkpoint-whole=False"] <= FP32_TOL["grad"] and two["checkpoint-whole=True"] <= FP32_TOL["grad"]
        assert two["gathers"][True] == two["gathers"][False] + 3, two  # + the recomputed forward's 3 layers
        recovery = per_rank["recovery"]
        assert recovery["raised"] and recovery["live_after_backward"] == 0, recovery
        assert recovery["fwd_err"] <= 1e-5, recovery
    if world == 2:
        errors = result[0]["errors"]
        assert errors["dtype_int"].startswith("ValueError") and "torch.int32" in errors["dtype_int"]
        assert errors["dtype_str"].startswith("ValueError") and "'bf16'" in errors["dtype_str"]
        assert errors["no_weight"].startswith("ValueError") and "'blocks'" in errors["no_weight"]
        assert errors["bf16_master"].startswith("ValueError") and "float32" in errors["bf16_master"]
        assert errors["tied_to_replicated"].startswith("ValueError") and "other.scale" in errors["tied_to_replicated"]
        assert errors["not_module"].startswith("TypeError")
        assert errors["depth"].startswith("ValueError") and "prefetch_depth" in errors["depth"]


def test_fsdp_requires_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        FSDP(Toy())
