"""DDP wrappers on gloo/CPU: equal to single-process full-batch training, and to torch DDP.

Two spawned jobs (world size 2 and 3) run every scenario and send back parameters, gradients and
all-reduce counts as numpy arrays; the tests below assert on them in the parent against references
computed here in one process.  Ranks build their models from different seeds, so only the wrappers'
broadcast can make them start equal; each rank trains on its slice of the global batch and the loss
is a mean, so averaged gradients equal full-batch gradients.

The toy model holds every awkward case: a frozen layer, a frozen bias, an embedding tied to the LM
head, a branch that is never used, and a branch used by data-dependent subsets of the ranks (some
ranks at step 0, none at step 1, all at step 2).
"""

from __future__ import annotations

import functools
import math
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems import model as lm_model
from cs336_systems.parallel import ddp
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.launch import spawn

V, D, H = 32, 16, 24  # vocab, width, hidden
B, T = 6, 5  # global batch (divisible by 2 and 3 ranks), sequence length
STEPS = 3
INIT_SEED = 1000  # rank r builds its model from INIT_SEED + r; rank 0's initialisation wins
# branch usage per global row and step: ranks 0.. use it at step 0, nobody at step 1, everybody at 2
MASKS = [[True, True, True, False, False, False], [False] * B, [True] * B]

# trainable tensors in registration order (the tied lm_head.weight is embed.weight, counted once)
TRAINABLE = ["unused.weight", "unused.bias", "embed.weight", "fc1.weight", "fc2.weight", "fc2.bias",
             "branch.weight", "branch.bias"]
FROZEN = ["fc1.bias", "frozen.weight", "frozen.bias"]
TRAINABLE_NUMEL = D * D + D + V * D + H * D + D * H + D + D * D + D  # 1840

# Reverse registration order, bytes: branch.b 64, branch.w 1024, fc2.b 64, fc2.w 1536, fc1.w 1536 (4224)
# | embed 2048, unused.b 64, unused.w 1024 (3136): a 4800-byte cap gives exactly two buckets.
TWO_BUCKET_MB = 4800 / 2**20
WRAPPERS = {
    "naive": lambda m: ddp.NaiveDDP(m),
    "flat": lambda m: ddp.FlatDDP(m),
    "individual": lambda m: ddp.DDPIndividualParameters(m),
    "bucketed_none": lambda m: ddp.DDPBucketed(m, None),
    "bucketed_1mb": lambda m: ddp.DDPBucketed(m, 1.0),
    "bucketed_two": lambda m: ddp.DDPBucketed(m, TWO_BUCKET_MB),
    "bucketed_tiny": lambda m: ddp.DDPBucketed(m, 1e-6),  # ~1 byte: one bucket per tensor
}
EXPECTED_BUCKETS = {
    "bucketed_none": [TRAINABLE[::-1]],
    "bucketed_1mb": [TRAINABLE[::-1]],
    "bucketed_two": [["branch.bias", "branch.weight", "fc2.bias", "fc2.weight", "fc1.weight"],
                     ["embed.weight", "unused.bias", "unused.weight"]],
    "bucketed_tiny": [[n] for n in TRAINABLE[::-1]],
    "individual": [[n] for n in TRAINABLE[::-1]],
}
OPTIMIZERS = ("sgd", "adamw")


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(D, D)  # registered first, so its bucket comes last
        self.embed = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)
        self.fc1.bias.requires_grad_(False)
        self.frozen = nn.Linear(H, H).requires_grad_(False)
        self.fc2 = nn.Linear(H, D)
        self.branch = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.rand(D) + 0.5)

    def forward(self, tokens: torch.Tensor, use_branch: torch.Tensor) -> torch.Tensor:
        """tokens (b, T) int64, use_branch (b,) bool -> logits (b, T, V)."""
        x = self.embed(tokens) * self.scale
        x = x + self.fc2(torch.tanh(self.frozen(F.relu(self.fc1(x)))))
        if bool(use_branch.any()):  # data-dependent: some ranks skip the branch entirely
            x = torch.where(use_branch[:, None, None], x + self.branch(x), x)
        return self.lm_head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(17 + step)
    tokens = torch.randint(V, (B, T), generator=g)
    targets = torch.randint(V, (B, T), generator=g)
    return tokens, targets, torch.tensor(MASKS[step % len(MASKS)])


def _rows(rank: int, world_size: int, n: int = B) -> slice:
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def _loss(net: nn.Module, step: int, rank: int, world_size: int) -> torch.Tensor:
    tokens, targets, mask = _batch(step)
    rows = _rows(rank, world_size)
    logits = net(tokens[rows], mask[rows])
    return F.cross_entropy(logits.reshape(-1, V).float(), targets[rows].reshape(-1))


def _numpy_state(module: nn.Module) -> dict:
    params = {n: p.detach().clone().numpy() for n, p in module.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.detach().clone().numpy()
             for n, p in module.named_parameters()}
    dtypes = {n: str(p.grad.dtype) for n, p in module.named_parameters() if p.grad is not None}
    return {"params": params, "grads": grads, "grad_dtypes": dtypes}


def _train(module: nn.Module, step_fn, opt_name: str, set_to_none: bool, rank: int, world_size: int,
           sync=None, autocast: bool = False, steps: int = STEPS) -> None:
    """``steps`` optimizer steps on ``step_fn = module or its wrapper``; no zero_grad after the last."""
    opt = _optimizer(opt_name, module.parameters())
    for step in range(steps):
        if step:
            opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(step_fn, step, rank, world_size)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()


# ---------------------------------------------------------------------------------------------------
# the spawned jobs
# ---------------------------------------------------------------------------------------------------

def _counting_all_reduce(log: list):
    """Log the numel of every dist.all_reduce call (the wrappers look the function up at call time)."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        log.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def _build(rank: int) -> Toy:
    torch.manual_seed(INIT_SEED + rank)
    return Toy()


def _train_counted(kind: str, rank: int, world_size: int, opt_name: str, set_to_none: bool, log: list):
    """Train a wrapped Toy; also record, per step, all-reduces issued before finish and in total."""
    net = _build(rank)
    wrapper = WRAPPERS[kind](net)
    opt = _optimizer(opt_name, net.parameters())
    per_step = []
    for step in range(STEPS):
        if step:
            opt.zero_grad(set_to_none=set_to_none)
        start = len(log)
        _loss(wrapper, step, rank, world_size).backward()
        before = len(log) - start
        wrapper.finish_gradient_synchronization()
        stats = wrapper.last_sync
        per_step.append({"before": before, "total": len(log) - start, "numel": sum(log[start:]),
                         "stats": (stats.collectives_before_finish, stats.collectives_in_finish,
                                   stats.bytes_all_reduced, stats.finish_time_s)})
        opt.step()
    out = _numpy_state(net)
    out["per_step"] = per_step
    out["buckets"] = getattr(wrapper, "bucket_param_names", None)
    out["scale"] = net.scale.clone().numpy()
    return out


def _no_sync_run(kind: str, rank: int, world_size: int, log: list) -> dict:
    """Two micro-steps: step 0's batch inside no_sync, step 1's outside; count all-reduces of each."""
    wrapper = WRAPPERS[kind](_build(rank))
    start = len(log)
    with wrapper.no_sync():
        _loss(wrapper, 0, rank, world_size).backward()
        wrapper.finish_gradient_synchronization()
    inside = len(log) - start
    _loss(wrapper, 1, rank, world_size).backward()
    wrapper.finish_gradient_synchronization()
    out = _numpy_state(wrapper.module)
    out["calls"] = (inside, len(log) - start - inside)
    return out


def _torch_ddp_run(rank: int, world_size: int, opt_name: str, set_to_none: bool, autocast: bool) -> dict:
    net = _build(rank)
    wrapped = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    _train(net, wrapped, opt_name, set_to_none, rank, world_size, autocast=autocast)
    return _numpy_state(net)


MISUSES = ("second_backward", "forward", "no_sync_forward", "no_sync_backward", "no_sync_eval")


def _misuse_messages(rank: int, world_size: int) -> dict[tuple[str, str], str | None]:
    """After a synchronized backward and before finish: a second backward, a forward, and a forward or a
    backward inside no_sync() (whose gradients finish would overwrite) must raise, not hang or lose data.
    -> (wrapper, misuse) -> the error message, None if nothing was raised."""
    messages: dict[tuple[str, str], str | None] = {}
    for kind in ("individual", "bucketed"):
        for attempt in MISUSES:
            net = _build(rank)
            wrapper = ddp.DDPIndividualParameters(net) if kind == "individual" else ddp.DDPBucketed(net, 1e-4)
            _loss(wrapper, 2, rank, world_size).backward()
            messages[kind, attempt] = None
            try:
                if attempt == "second_backward":
                    _loss(wrapper.module, 2, rank, world_size).backward()
                elif attempt == "forward":
                    wrapper(*_batch(2)[::2])
                elif attempt == "no_sync_forward":
                    with wrapper.no_sync():
                        wrapper(*_batch(2)[::2])
                elif attempt == "no_sync_eval":  # makes no gradients: allowed
                    with wrapper.no_sync(), torch.no_grad():
                        wrapper(*_batch(2)[::2])
                else:
                    with wrapper.no_sync():
                        _loss(wrapper.module, 2, rank, world_size).backward()
            except RuntimeError as exc:
                messages[kind, attempt] = str(exc)
            # complete the step on every rank so the collectives stay matched
            wrapper.finish_gradient_synchronization()
    return messages


# --- every rank must hold the same model --------------------------------------------------------------

class _Shaped(nn.Module):
    """Two parameters of the given shapes and dtype, and an optional third one."""

    def __init__(self, first=(4, 6), dtype=torch.float32, extra: bool = False) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.zeros(first, dtype=dtype))
        self.second = nn.Parameter(torch.zeros(3, dtype=dtype))
        if extra:
            self.third = nn.Parameter(torch.zeros(2))
        self.lin = nn.Linear(3, 3)  # FSDP shards its weight


# Rank 1's model differs from rank 0's: one more parameter; the same numel in another shape (which used to
# train silently on reshaped data); another dtype (which used to die inside gloo).
MODEL_MISMATCHES = {
    "count": dict(extra=True),
    "shape": dict(first=(6, 4)),
    "dtype": dict(dtype=torch.float64),
}
MISMATCH_WRAPPERS = {
    "naive": ddp.NaiveDDP, "flat": ddp.FlatDDP, "individual": ddp.DDPIndividualParameters,
    "bucketed": lambda m: ddp.DDPBucketed(m, 1.0), "fsdp": FSDP,
}


def _mismatched_models(rank: int, world_size: int) -> dict:
    """-> (wrapper, mismatch) -> (error message or None, seconds the construction took on this rank)."""
    out = {}
    for kind, make in MISMATCH_WRAPPERS.items():
        for mismatch, kwargs in MODEL_MISMATCHES.items():
            module = _Shaped(**(kwargs if rank == 1 else {}))
            start = time.perf_counter()
            try:
                make(module)
                message = None
            except ValueError as exc:
                message = str(exc)
            out[kind, mismatch] = (message, time.perf_counter() - start)
    return out


# --- a skipped finish_gradient_synchronization() is detected ---------------------------------------------

def _skipped_finish(rank: int, world_size: int) -> dict:
    """forward, backward, optimizer.step() without finish, forward again: -> wrapper -> messages of the
    forwards that must raise (plain, under no_grad, inside no_sync()) and of those allowed (under no_grad
    inside no_sync(), which makes no gradients; after finish), None where nothing was raised."""
    out = {}
    for kind in ("naive", "flat", "individual", "bucketed_two"):
        net = _build(rank)
        wrapper = WRAPPERS[kind](net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        _loss(wrapper, 2, rank, world_size).backward()
        opt.step()  # finish_gradient_synchronization() forgotten
        messages = {}
        for attempt in ("no_sync_eval", "forward", "eval", "no_sync_forward", "after_finish"):
            messages[attempt] = None
            if attempt == "after_finish":
                wrapper.finish_gradient_synchronization()  # on every rank: the collectives stay matched
            try:
                if attempt == "eval":
                    with torch.no_grad():
                        wrapper(*_batch(2)[::2])
                elif attempt == "no_sync_eval":
                    with wrapper.no_sync(), torch.no_grad():
                        wrapper(*_batch(2)[::2])
                elif attempt == "no_sync_forward":
                    with wrapper.no_sync():
                        wrapper(*_batch(2)[::2])
                else:
                    wrapper(*_batch(2)[::2])
            except RuntimeError as exc:
                messages[attempt] = str(exc)
        out[kind] = messages
    return out


def _tiny_lm_batch(step: int) -> torch.Tensor:
    return torch.randint(128, (4, 17), generator=torch.Generator().manual_seed(99 + step))


def _tiny_lm_train(rank: int, world_size: int, wrap: bool) -> dict:
    torch.manual_seed(INIT_SEED + rank)
    net = lm_model.build("tiny", vocab_size=128, context_length=16)
    wrapper = ddp.DDPBucketed(net, 0.05) if wrap else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, eps=1e-6)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        seqs = _tiny_lm_batch(step)[_rows(rank, world_size, 4)]
        logits = wrapper(seqs[:, :-1])
        F.cross_entropy(logits.reshape(-1, 128), seqs[:, 1:].reshape(-1)).backward()
        if wrap:
            wrapper.finish_gradient_synchronization()
        opt.step()
    out = {n: p.detach().clone().numpy() for n, p in net.named_parameters()}
    if wrap:
        out["__num_buckets"] = wrapper.num_buckets
    return out


def _job(rank: int, world_size: int, full: bool) -> dict:
    log: list[int] = []
    _counting_all_reduce(log)
    results: dict = {"train": {}, "no_sync": {}}
    combos = ([(o, z) for o in OPTIMIZERS for z in (True, False)] if full else [("adamw", True)])
    for kind in WRAPPERS:
        for opt_name, set_to_none in combos:
            results["train"][kind, opt_name, set_to_none] = _train_counted(
                kind, rank, world_size, opt_name, set_to_none, log)
        results["no_sync"][kind] = _no_sync_run(kind, rank, world_size, log)
    if full:
        results["torch_ddp"] = {c: _torch_ddp_run(rank, world_size, *c, autocast=False) for c in combos}
        results["bf16"] = {"torch_ddp": _torch_ddp_run(rank, world_size, "adamw", True, autocast=True)}
        for kind in WRAPPERS:
            net = _build(rank)
            wrapper = WRAPPERS[kind](net)
            _train(net, wrapper, "adamw", True, rank, world_size,
                   sync=wrapper.finish_gradient_synchronization, autocast=True)
            results["bf16"][kind] = _numpy_state(net)
        results["misuse"] = _misuse_messages(rank, world_size)
        results["mismatch"] = _mismatched_models(rank, world_size)
        results["skipped_finish"] = _skipped_finish(rank, world_size)
        results["tiny_lm"] = _tiny_lm_train(rank, world_size, wrap=True)
    return results


@pytest.fixture(scope="module")
def jobs() -> dict[int, list[dict]]:
    return {2: spawn(_job, 2, True, timeout_s=120.0), 3: spawn(_job, 3, False, timeout_s=120.0)}


# ---------------------------------------------------------------------------------------------------
# single-process references
# ---------------------------------------------------------------------------------------------------

@functools.cache
def _reference(opt_name: str, set_to_none: bool) -> dict:
    net = _build(0)
    _train(net, net, opt_name, set_to_none, 0, 1)
    return _numpy_state(net)


@functools.cache
def _reference_initial() -> dict:
    return _numpy_state(_build(0))


def _assert_state_close(got: dict, want: dict, atol: float = 3e-5, rtol: float = 1e-4) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        np.testing.assert_allclose(got["params"][name], value, atol=atol, rtol=rtol, err_msg=name)
    for name, grad in want["grads"].items():
        assert (got["grads"][name] is None) == (grad is None), f"{name}: grad None-ness differs"


def _all_cases(jobs):
    for world_size, per_rank in jobs.items():
        for rank, result in enumerate(per_rank):
            for (kind, opt_name, set_to_none), state in result["train"].items():
                yield world_size, rank, kind, opt_name, set_to_none, state


# ---------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------

def test_every_wrapper_trains_like_single_process(jobs):
    """All wrappers x {SGD, AdamW} x zero_grad(set_to_none True/False), 2 and 3 ranks, every rank."""
    checked = 0
    for world_size, rank, kind, opt_name, set_to_none, state in _all_cases(jobs):
        try:
            _assert_state_close(state, _reference(opt_name, set_to_none))
        except AssertionError as exc:
            raise AssertionError(f"ws={world_size} rank={rank} {kind} {opt_name} "
                                 f"set_to_none={set_to_none}: {exc}") from None
        checked += 1
    assert checked == len(WRAPPERS) * (2 * 4 + 3 * 1)


def test_reference_is_sensitive_to_the_rank_initialisations(jobs):
    """Guards against a vacuous comparison: rank 1's own init differs, and training moved the params."""
    rank1_init = _numpy_state(_build(1))["params"]["fc2.weight"]
    assert not np.allclose(rank1_init, _reference_initial()["params"]["fc2.weight"])
    trained = _reference("adamw", True)["params"]["fc2.weight"]
    assert not np.allclose(trained, _reference_initial()["params"]["fc2.weight"], atol=1e-3)
    # and buffers were broadcast from rank 0 as well
    scale0 = _build(0).scale.numpy()
    for per_rank in jobs.values():
        for result in per_rank:
            np.testing.assert_array_equal(result["train"]["flat", "adamw", True]["scale"], scale0)


def test_frozen_unused_and_partially_used_parameters(jobs):
    initial = _reference_initial()["params"]
    for world_size, rank, kind, opt_name, set_to_none, state in _all_cases(jobs):
        for name in FROZEN:  # never communicated, never changed: still rank 0's initial values
            np.testing.assert_array_equal(state["params"][name], initial[name], err_msg=name)
            assert state["grads"][name] is None
        for name in ("unused.weight", "unused.bias"):  # no gradient anywhere: optimizers skip it
            assert state["grads"][name] is None, (kind, name)
            np.testing.assert_array_equal(state["params"][name], initial[name], err_msg=name)
    # step 1 leaves the branch without gradient on every rank; with set_to_none=True AdamW then skips
    # it (no weight decay), with False it steps on a zero gradient: the references differ, so the
    # comparison above really checked the None-vs-zero semantics
    assert not np.allclose(_reference("adamw", True)["params"]["branch.weight"],
                           _reference("adamw", False)["params"]["branch.weight"], atol=1e-5)


def test_ranks_end_identical(jobs):
    for world_size, per_rank in jobs.items():
        for key, state in per_rank[0]["train"].items():
            for other in per_rank[1:]:
                for name, value in state["params"].items():
                    np.testing.assert_array_equal(other["train"][key]["params"][name], value,
                                                  err_msg=f"ws={world_size} {key} {name}")


def test_bucket_assignment(jobs):
    for kind, expected in EXPECTED_BUCKETS.items():
        assert jobs[2][0]["train"][kind, "sgd", True]["buckets"] == expected, kind
    assert len(EXPECTED_BUCKETS["bucketed_two"]) == 2
    assert len(EXPECTED_BUCKETS["bucketed_tiny"]) == len(TRAINABLE)


def _expected_calls_per_step(kind: str, grads_anywhere: int) -> int:
    if kind == "naive":
        return 1 + grads_anywhere  # flags + one per tensor that has a gradient on some rank
    if kind == "flat":
        return 1
    if kind == "individual":
        return len(EXPECTED_BUCKETS[kind]) + 1  # every tensor in place, then one flags all-reduce in finish
    return len(EXPECTED_BUCKETS[kind])


def test_communication_counts_and_overlap(jobs):
    """Naive/flat communicate only inside finish; hooked ones overlap once their buckets are ready;
    frozen tensors and the tied duplicate are never sent; last_sync agrees with the observed calls."""
    for world_size, rank, kind, opt_name, set_to_none, state in _all_cases(jobs):
        for step, rec in enumerate(state["per_step"]):
            # step 1: the branch has no gradient anywhere (and with set_to_none=False it still has one)
            anywhere = 6 if step != 1 or not set_to_none else 4
            assert rec["total"] == _expected_calls_per_step(kind, anywhere), (kind, step, rec)
            before, in_finish, nbytes, seconds = rec["stats"]
            assert (before, before + in_finish) == (rec["before"], rec["total"]), (kind, step, rec)
            assert nbytes == 4 * rec["numel"] and seconds >= 0.0
            if kind == "naive":
                assert rec["numel"] <= TRAINABLE_NUMEL + len(TRAINABLE)
            else:  # all trainable gradients once plus at most one flag per tensor
                assert TRAINABLE_NUMEL <= rec["numel"] <= TRAINABLE_NUMEL + len(TRAINABLE)
            if kind in ("naive", "flat", "bucketed_none", "bucketed_1mb"):
                assert rec["before"] == 0, (kind, step, rec)
            elif step == 2:  # everyone uses the branch: all buckets before the unused one launch early
                in_finish = {"individual": 3, "bucketed_tiny": 2}.get(kind, 1)  # individual: + the flags
                assert rec["before"] == rec["total"] - in_finish, (kind, step, rec)


def test_no_sync_accumulates_and_communicates_once(jobs):
    net = _build(0)
    for step in (0, 1):  # single process: accumulate the two full-batch micro-steps
        _loss(net, step, 0, 1).backward()
    want = _numpy_state(net)
    checked = 0
    for world_size, per_rank in jobs.items():
        for result in per_rank:
            for kind, state in result["no_sync"].items():
                inside, outside = state["calls"]
                assert inside == 0, (kind, inside)
                # the communicated micro-step: grads exist for 6 tensors (branch from micro-step 0)
                assert outside == _expected_calls_per_step(kind, 6), (kind, outside)
                for name, grad in want["grads"].items():
                    if grad is None:
                        assert state["grads"][name] is None, (kind, name)
                    else:
                        np.testing.assert_allclose(state["grads"][name], grad, atol=1e-6, rtol=1e-5,
                                                   err_msg=f"ws={world_size} {kind} {name}")
                checked += 1
    assert checked == len(WRAPPERS) * 5


def test_matches_torch_ddp(jobs):
    for rank_result in jobs[2]:
        for combo, theirs in rank_result["torch_ddp"].items():
            _assert_state_close(theirs, _reference(*combo))  # torch DDP itself agrees with the reference
            for kind in WRAPPERS:
                _assert_state_close(rank_result["train"][(kind, *combo)], theirs)


def test_bf16_autocast_matches_torch_ddp(jobs):
    for rank_result in jobs[2]:
        theirs = rank_result["bf16"]["torch_ddp"]
        for kind in WRAPPERS:
            ours = rank_result["bf16"][kind]
            _assert_state_close(ours, theirs, atol=1e-4, rtol=1e-3)
            assert set(ours["grad_dtypes"].values()) == {"torch.float32"}
            assert all(v.dtype == np.float32 for v in ours["params"].values())
        # autocast really changed the numerics (bf16 matmuls), so the comparison is not fp32 vs fp32
        fp32 = rank_result["train"]["flat", "adamw", True]["params"]["fc2.weight"]
        assert not np.allclose(theirs["params"]["fc2.weight"], fp32, atol=1e-6, rtol=0)


def test_misuse_raises_instead_of_hanging(jobs):
    for rank_result in jobs[2]:
        for kind in ("individual", "bucketed"):
            message = {attempt: rank_result["misuse"][kind, attempt] for attempt in MISUSES}
            assert message["second_backward"] is not None and "second gradient" in message["second_backward"]
            assert "no_sync" in message["second_backward"]
            for attempt in ("forward", "no_sync_forward", "no_sync_backward"):
                assert message[attempt] is not None, (kind, attempt, "nothing raised")
                assert "finish_gradient_synchronization()" in message[attempt], (kind, attempt)
            assert "inside no_sync()" in message["no_sync_backward"]
            assert message["no_sync_eval"] is None, message["no_sync_eval"]


@pytest.mark.parametrize("mismatch", MODEL_MISMATCHES)
@pytest.mark.parametrize("kind", MISMATCH_WRAPPERS)
def test_different_models_on_the_ranks_raise_on_every_rank_naming_them(jobs, kind, mismatch):
    messages = [r["mismatch"][kind, mismatch] for r in jobs[2]]
    for rank, (message, seconds) in enumerate(messages):
        assert message is not None, f"rank {rank}: {kind} accepted a model that differs on rank 1 ({mismatch})"
        assert "ranks hold different models: rank(s) 1 differ from rank 0" in message, message
        assert seconds < 5, seconds  # at construction, not at a collective's timeout
        if mismatch == "count":
            assert "rank 1 has 5 parameters and buffers, rank 0 has 4" in message, message
        elif mismatch == "shape":
            assert "rank 0 has 'first (4, 6) float32 trainable', rank 1 has 'first (6, 4) float32 trainable'" in message
        else:
            assert "'first (4, 6) float32 trainable', rank 1 has 'first (4, 6) float64 trainable'" in message
    assert messages[0][0] == messages[1][0]  # the same verdict everywhere


@pytest.mark.parametrize("kind", ["naive", "flat", "individual", "bucketed_two"])
def test_a_skipped_finish_raises_at_the_next_forward(jobs, kind):
    for rank_result in jobs[2]:
        messages = rank_result["skipped_finish"][kind]
        assert messages["no_sync_eval"] is None, messages["no_sync_eval"]  # makes no gradients: allowed
        for attempt in ("forward", "eval", "no_sync_forward"):
            assert messages[attempt] is not None, (kind, attempt, "nothing raised")
            assert "finish_gradient_synchronization()" in messages[attempt], messages[attempt]
            assert "a forward pass while a synchronized backward pass's gradients have not been finished" in \
                messages[attempt]
        assert messages["after_finish"] is None, messages["after_finish"]


def test_tiny_lm_bucketed_matches_single_process(jobs):
    want = _tiny_lm_train(0, 1, wrap=False)
    for rank_result in jobs[2]:
        got = dict(rank_result["tiny_lm"])
        assert got.pop("__num_buckets") > 2
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, atol=2e-5, rtol=1e-4, err_msg=name)


# ---------------------------------------------------------------------------------------------------
# argument errors (parent process: no process group)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, -1.5, math.nan])
def test_bucket_size_must_be_positive(size):
    with pytest.raises(ValueError, match=rf"bucket_size_mb must be positive.*got {size!r}"):
        ddp.DDPBucketed(Toy(), size)


def test_bucket_size_must_be_a_number():
    with pytest.raises(TypeError, match=r"bucket_size_mb must be a number or None, got '1'"):
        ddp.DDPBucketed(Toy(), "1")


@pytest.mark.parametrize("cls", [ddp.NaiveDDP, ddp.FlatDDP, ddp.DDPIndividualParameters])
def test_module_must_be_a_module(cls):
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got list"):
        cls([])


@pytest.mark.parametrize("make", [ddp.NaiveDDP, ddp.FlatDDP, ddp.DDPIndividualParameters,
                                  lambda m: ddp.DDPBucketed(m, 25)])
def test_requires_process_group(make):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"DDP\w* needs an initialized torch.distributed process group"):
        make(Toy())


# ---------------------------------------------------------------------------------------------------
# copy-out: O(1) kernels per finish, bitwise the old per-parameter average, gradient storage contract
# ---------------------------------------------------------------------------------------------------

N_SMALL = 40  # Linear(4, 4) layers: 80 tensors of 64 and 16 bytes
# Reverse registration order: layers 39..20, partial, layers 19..0, dead (80 bytes per layer).  A 1000-byte
# cap gives 4 buckets: [39..28], [27..20 + partial + 19..17], [16..5], [4..0 + dead]: two complete ones,
# one holding a tensor used on rank 0 only, one holding a tensor no rank uses.
MANY_CAP_MB = 1000 / 2**20
MANY_WRAPPERS = {**{name: WRAPPERS[name] for name in ("naive", "flat", "individual")},
                 "bucketed": lambda m: ddp.DDPBucketed(m, MANY_CAP_MB)}


class ManySmall(nn.Module):
    """Many small tensors; ``partial`` is used only when asked (rank 0 here), ``dead`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = nn.Linear(4, 4)
        self.first = nn.ModuleList(nn.Linear(4, 4) for _ in range(N_SMALL // 2))
        self.partial = nn.Linear(4, 4)
        self.second = nn.ModuleList(nn.Linear(4, 4) for _ in range(N_SMALL // 2))

    def forward(self, x: torch.Tensor, use_partial: bool) -> torch.Tensor:
        """x (b, 4) -> (b, 4)."""
        for layer in self.first:
            x = torch.tanh(layer(x))
        if use_partial:
            x = x + self.partial(x)
        for layer in self.second:
            x = torch.tanh(layer(x))
        return x


def _many_backward(net: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    net(x, use_partial=rank == 0).square().mean().backward()


class _OpLog(TorchDispatchMode):
    """Names of the non-view aten ops dispatched while active (one entry per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _old_average(params: list[nn.Parameter], world_size: int) -> list[torch.Tensor | None]:
    """The former copy-out's result from the local grads: sum over ranks, then torch.div per tensor."""
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params])])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    total = functools.reduce(torch.add, gathered)  # = gloo's sum bitwise for 2 ranks (a + b = b + a)
    out, offset = [], 0
    for i, p in enumerate(params):
        piece = total[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        out.append(torch.div(piece, world_size) if total[-len(params) + i] > 0 else None)
    return out


def _mismatches(step: int, net: nn.Module, want: list[torch.Tensor | None]) -> list[tuple[int, str]]:
    """(step, name) of every gradient that is not exactly ``want`` (None-ness, dtype, shape, values)."""
    def differs(g: torch.Tensor | None, w: torch.Tensor | None) -> bool:
        if g is None or w is None:
            return (g is None) != (w is None)
        return g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w)

    return [(step, n) for (n, p), w in zip(net.named_parameters(), want) if differs(p.grad, w)]


def _copy_out_job(rank: int, world_size: int) -> dict:
    """Per wrapper: ops in finish, grads vs the old formula (step 0, and a no_sync-accumulated step 1
    into the views left by step 0 after zero_grad(set_to_none=False)), the grad None/view contract."""
    results = {}
    for kind, make in MANY_WRAPPERS.items():
        torch.manual_seed(INIT_SEED + rank)
        net = ManySmall()
        wrapper = make(net)
        torch.manual_seed(INIT_SEED)
        ref = ManySmall()  # rank 0's initialisation = the broadcast parameters
        out: dict = {"ops": [], "mismatch": [], "num_buckets": getattr(wrapper, "num_buckets", 1)}
        # step 0: plain backward
        _many_backward(wrapper, rank, 0)
        none_before = [n for n, p in net.named_parameters() if p.grad is None]
        with _OpLog() as log:
            wrapper.finish_gradient_synchronization()
        out["ops"].append((log.ops, wrapper.last_sync.collectives_in_finish))
        out["before"] = wrapper.last_sync.collectives_before_finish
        out["none_before"] = none_before
        _many_backward(ref, rank, 0)
        out["mismatch"] += _mismatches(0, net, _old_average(list(ref.parameters()), world_size))
        out["storage_bytes"] = {n: p.grad.untyped_storage().nbytes() for n, p in net.named_parameters()
                                if p.grad is not None}
        out["storage_ptr"] = {n: p.grad.untyped_storage().data_ptr() for n, p in net.named_parameters()
                              if p.grad is not None}
        # step 1: zero in place, one micro-step under no_sync, one synchronized
        for module in (net, ref):
            module.zero_grad(set_to_none=False)
        with wrapper.no_sync():
            _many_backward(wrapper, rank, 1)
            wrapper.finish_gradient_synchronization()
        _many_backward(wrapper, rank, 2)
        with _OpLog() as log:
            wrapper.finish_gradient_synchronization()
        out["ops"].append((log.ops, wrapper.last_sync.collectives_in_finish))
        for micro in (1, 2):
            _many_backward(ref, rank, micro)
        out["mismatch"] += _mismatches(1, net, _old_average(list(ref.parameters()), world_size))
        out["bucket_names"] = getattr(wrapper, "bucket_param_names", None)
        out["layout"] = _layout_check(make, rank)
        results[kind] = out
    return results


class _Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4).t())  # (4, 5) with strides (1, 4): not contiguous
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def _layout_check(make, rank: int) -> tuple[bool, list[str]]:
    """A non-contiguous parameter keeps grads in its own layout across steps (set_to_none=False, so the
    next backward accumulates into the averaged grad): (strides always equal, warnings raised)."""
    torch.manual_seed(rank)
    net = _Transposed()
    wrapper = make(net)
    same = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            net.zero_grad(set_to_none=False)
            wrapper(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
            wrapper.finish_gradient_synchronization()
            same = same and net.w.grad.stride() == net.w.stride()
    return same, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def copy_out() -> list[dict]:
    return spawn(_copy_out_job, 2, timeout_s=60.0)


def test_copy_out_equals_the_per_tensor_average_bitwise(copy_out):
    """fp32 grads after finish == sum over ranks / world size per tensor (the former copy-out), for
    complete buckets, a bucket with a tensor unused on rank 1, and one with a tensor no rank uses; also
    after zero_grad(set_to_none=False) + a no_sync micro-step accumulating into the previous grads."""
    for rank, result in enumerate(copy_out):
        for kind, out in result.items():
            assert out["mismatch"] == [], (rank, kind, out["mismatch"][:5])
            assert "dead.weight" not in out["storage_bytes"], kind  # no gradient anywhere: stays None
            assert "partial.weight" in out["storage_bytes"], kind  # rank 0's gradient (halved) on both
            assert out["layout"] == (True, []), (rank, kind, out["layout"])


def test_copy_out_launches_o1_kernels_per_finish(copy_out):
    """84 tensors: finish's non-view ops do not grow with the number of tensors (the former copy-out ran
    one division per tensor).  What remains: 2 per bucket launched inside finish (flags, cat), 2 per
    tensor without a local gradient (zeros, flag fill; at most 4 here: dead, partial), and 4 per finish
    (flags cat and compare, in-place and out-of-place multi-tensor division)."""
    n_tensors = 2 * (N_SMALL + 2)
    for rank, result in enumerate(copy_out):
        for kind, out in result.items():
            assert out["num_buckets"] == {"naive": 1, "flat": 1, "individual": n_tensors, "bucketed": 4}[kind]
            for ops, launched_in_finish in out["ops"]:
                divisions = [op for op in ops if "div" in op]
                assert divisions and set(divisions) <= {"_foreach_div_", "_foreach_div"}, (kind, divisions)
                assert len(divisions) == len(set(divisions)), (kind, divisions)  # one call each at most
                if kind != "naive":  # naive's all-reduces are per tensor by design (c10d ops, not counted)
                    bound = 2 * launched_in_finish + 2 * 4 + 4
                    assert len(ops) <= bound, (rank, kind, launched_in_finish, ops)
                if kind in ("flat", "bucketed"):
                    assert len(ops) < n_tensors / 4, (rank, kind, ops)


def test_gradients_are_released_at_launch_and_become_bucket_views(copy_out):
    """The documented storage contract: launched buckets' p.grad is None until finish; afterwards a
    bucket whose tensors all had a gradient somewhere shares one storage, a bucket holding a tensor no
    rank used gets fresh tensors (its buffer is not kept alive)."""
    for rank, result in enumerate(copy_out):
        out = result["bucketed"]
        buckets = out["bucket_names"]
        launched = [n for bucket in buckets[:out["before"]] for n in bucket]
        assert out["before"] == (3 if rank == 0 else 1)  # rank 1 lacks `partial`: bucket 1 waits for finish
        unused_here = {"dead.weight", "dead.bias"} | ({"partial.weight", "partial.bias"} if rank else set())
        assert set(out["none_before"]) == set(launched) | unused_here, rank
        for bucket in buckets:
            ptrs = {out["storage_ptr"][n] for n in bucket if n in out["storage_ptr"]}
            if "dead.weight" in bucket:
                assert len(ptrs) == len(bucket) - 2  # fresh tensors, sized exactly
                assert all(out["storage_bytes"][n] <= 64 for n in bucket if n in out["storage_bytes"])
            else:
                assert len(ptrs) == 1, bucket


@pytest.mark.parametrize("divisor", [1, 2])
def test_average_into_grads_divides_only_by_what_the_collective_left(divisor):
    """After an AVG all-reduce (NCCL) the divisor is 1: the buffers become the gradients unchanged (in place,
    sharing the buffer) or, for a bucket where some tensor had no gradient, copied without scaling; after a
    SUM (gloo) they are divided by the world size. The averaged flags stay > 0 where some rank had a grad."""
    from cs336_systems.parallel.ddp import _average_into_grads, _Layout

    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    full, partial = _Layout([a, b]), _Layout([c, nn.Parameter(torch.zeros(1))])
    # "all-reduced" buffers: grads then flags; in `partial` the second tensor had no grad on any rank.
    full_buf = torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 0.5, 0.5])
    partial_buf = torch.tensor([1.0, 3.0, 5.0, 7.0, 0.0, 0.5, 0.0])
    packed = [(full, full_buf, full.views(full_buf), True), (partial, partial_buf, partial.views(partial_buf), False)]
    _average_into_grads(packed, divisor)
    torch.testing.assert_close(a.grad, torch.tensor([2.0, 4.0, 6.0]) / divisor)
    torch.testing.assert_close(b.grad, torch.tensor([8.0, 10.0]) / divisor)
    assert a.grad.data_ptr() == full_buf.data_ptr()  # in place: the buffer is the gradient
    torch.testing.assert_close(c.grad, torch.tensor([1.0, 3.0, 5.0, 7.0]) / divisor)
    assert c.grad.untyped_storage().data_ptr() != partial_buf.untyped_storage().data_ptr()  # a copy: buffer freed
    assert partial.params[1].grad is None


def _in_place_job(rank: int, world_size: int) -> dict:
    """DDPIndividualParameters: the tensor autograd accumulated is the one all-reduced and kept as p.grad
    (no copy), and backward dispatches no copy-in ops (cat, fills) for it."""
    net = _build(rank)
    wrapper = ddp.DDPIndividualParameters(net)
    seen: dict[str, int] = {}
    for name, p in net.named_parameters():
        if p.requires_grad:  # registered after the wrapper's hook: sees p.grad as it was launched
            p.register_post_accumulate_grad_hook(lambda t, name=name: seen.__setitem__(name, t.grad.data_ptr()))
    with _OpLog() as log:
        _loss(wrapper, 2, rank, world_size).backward()
    wrapper.finish_gradient_synchronization()
    kept = {name: p.grad.data_ptr() == seen[name] for name, p in net.named_parameters() if name in seen}
    return {"kept": kept, "copy_ops": [op for op in log.ops if "cat" in op or "fill" in op or "copy" in op]}


def test_individual_parameters_reduce_gradients_in_place():
    for result in spawn(_in_place_job, 2, timeout_s=60.0):
        assert result["kept"] and all(result["kept"].values()), result["kept"]
        assert result["copy_ops"] == [], result["copy_ops"]


class _Aliased(nn.Module):
    """Gradients that autograd hands to the parameters as views of shared memory: a and b both receive
    views of one upstream gradient (no broadcasting, so no reduction copies it), and w's branch reads that
    same gradient later in backward."""

    N = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(self.N))
        self.a = nn.Parameter(torch.zeros(self.N))
        self.b = nn.Parameter(torch.zeros(self.N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w) + self.a.unsqueeze(0) + self.b.unsqueeze(0)


def _aliased_job(rank: int, world_size: int) -> list[tuple[list[float], list[float], list[float]]]:
    net = _Aliased()
    wrapper = ddp.DDPIndividualParameters(net)
    out = []
    for step in range(3):
        scale = torch.full((1, _Aliased.N), float(rank + 1 + step))
        (wrapper(torch.ones(1, _Aliased.N)) * scale).sum().backward()
        wrapper.finish_gradient_synchronization()
        out.append((net.w.grad.unique().tolist(), net.a.grad.unique().tolist(), net.b.grad.unique().tolist()))
        net.zero_grad()
    return out


def test_individual_parameters_copy_gradients_that_alias_other_memory():
    """Reducing such a gradient in place would reduce one memory twice (a, b) and hand w's branch a
    half-reduced upstream gradient; the wrapper copies them, so every gradient is the plain average."""
    for result in spawn(_aliased_job, 2, timeout_s=60.0):
        for step, (w, a, b) in enumerate(result):
            mean = (1 + step + 2 + step) / 2  # d/dparam of sum(scale * out) = scale, averaged over ranks
            assert w == [mean] and a == [mean] and b == [mean], (step, w, a, b)
