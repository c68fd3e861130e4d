"""The data-parallel variants on NCCL with one GPU per rank (marked multi_gpu: skipped without 2 GPUs).

The gloo tests (test_ddp, test_zero, test_fsdp, test_train_workloads) check the algorithms on the CPU;
this runs the same variants through NCCL, CUDA streams and autograd's device threads, where the
overlapped wrappers' hooks, the async collectives and the CUDA timing paths really run.  Rank 0
replays the two steps in one process on its GPU (AdamW on the mean of both ranks' losses, which is the
update of averaged gradients) and compares; every rank must hold identical parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.model import build
from cs336_systems.parallel import DDPBucketed, DDPIndividualParameters, ShardedOptimizer
from cs336_systems.parallel.launch import spawn
from cs336_systems.bench.workloads.data_parallel import VARIANTS, DistributedTrainStep

CONTEXT, BATCH, VOCAB, STEPS, LR, SEED = 64, 2, 512, 2, 1e-4, 0

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu(2)]


def _full_params(step: DistributedTrainStep) -> torch.Tensor:
    if step.variant == "fsdp":
        params = step.wrapper.gather_full_params()
    else:
        module = getattr(step.model, "module", step.model)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                  for n, p in module.named_parameters()}
    return torch.cat([params[n].flatten() for n in sorted(params)])


def _reference(device: torch.device, batches) -> torch.Tensor:
    torch.manual_seed(SEED)
    with device:
        model = build("tiny", context_length=CONTEXT, vocab_size=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in batches]).mean()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().float().flatten() for _, p in sorted(model.named_parameters())])


def _job(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", rank)
    out = {}
    for variant in VARIANTS:
        if variant == "none":
            continue
        step = DistributedTrainStep(variant=variant, size="tiny", context=CONTEXT, batch_size=BATCH,
                                    precision="fp32", device=device, vocab_size=VOCAB, lr=LR, seed=SEED)
        for _ in range(STEPS):
            step()
        flat = _full_params(step)
        copies = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(copies, flat)
        tokens = [torch.empty_like(step.tokens) for _ in range(world_size)]
        targets = [torch.empty_like(step.targets) for _ in range(world_size)]
        dist.all_gather(tokens, step.tokens)
        dist.all_gather(targets, step.targets)
        rank_diff = max((c - copies[0]).abs().max().item() for c in copies)
        ref_diff = (flat - _reference(device, list(zip(tokens, targets)))).abs().max().item()
        out[variant] = {"rank_diff": rank_diff, "ref_diff": ref_diff, "sync_s": step.sync_s}
        del step
        torch.cuda.synchronize(device)
    return out


def _unsynchronized_job(rank: int, world_size: int) -> dict:
    """The hook-based paths without record_timing (no device syncs in finish to hide a missing stream
    dependency) and with many small buckets (launch-order waits, zero1's polling)."""
    device = torch.device("cuda", rank)
    generator = torch.Generator(device).manual_seed(SEED + 1 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT), device=device, generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, CONTEXT), device=device, generator=generator)
    all_tokens = [torch.empty_like(tokens) for _ in range(world_size)]
    all_targets = [torch.empty_like(targets) for _ in range(world_size)]
    dist.all_gather(all_tokens, tokens)
    dist.all_gather(all_targets, targets)
    reference = _reference(device, list(zip(all_tokens, all_targets)))
    out = {}
    for name in ("bucketed-0.05", "individual", "zero1-0.05"):
        torch.manual_seed(SEED)
        with device:
            model = build("tiny", context_length=CONTEXT, vocab_size=VOCAB)
        if name == "zero1-0.05":
            wrapped = model
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mode="zero1", bucket_size_mb=0.05,
                                   overlap=True, lr=LR, fused=True)
        else:
            wrapped = DDPBucketed(model, 0.05) if name == "bucketed-0.05" else DDPIndividualParameters(model)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(wrapped(tokens).flatten(0, 1), targets.flatten()).backward()
            if wrapped is not model:
                wrapped.finish_gradient_synchronization()
            opt.step()
        flat = torch.cat([p.detach().float().flatten() for _, p in sorted(model.named_parameters())])
        out[name] = (flat - reference).abs().max().item()
    return out


@pytest.fixture(scope="module")
def unsynchronized() -> list[dict]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return spawn(_unsynchronized_job, 2, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("name", ["bucketed-0.05", "individual", "zero1-0.05"])
def test_hooked_paths_without_timing_syncs_match_single_process(unsynchronized, name):
    for rank_result in unsynchronized:
        assert rank_result[name] < LR / 20, f"{name}: differs from single-process AdamW by {rank_result[name]}"


@pytest.fixture(scope="module")
def results() -> list[dict]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return spawn(_job, 2, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "none"])
def test_variant_on_nccl_matches_single_process_and_ranks_agree(results, variant):
    for rank_result in results:
        out = rank_result[variant]
        assert out["rank_diff"] == 0.0, f"{variant}: ranks hold different parameters"
        assert out["ref_diff"] < LR / 20, f"{variant}: differs from single-process AdamW by {out['ref_diff']}"
    if variant in ("naive", "flat", "individual", "bucketed", "zero-broadcast"):
        assert results[0][variant]["sync_s"] is not None and results[0][variant]["sync_s"] >= 0


def _aliased_job(rank: int, world_size: int) -> list[list[float]]:
    """DDPIndividualParameters on NCCL with gradients that alias (see tests/parallel/test_ddp.py's _Aliased): there the
    collective runs on NCCL's stream while backward's later kernels read the same memory."""
    torch.cuda.set_device(rank)
    n = 1 << 20
    w, a, b = (torch.nn.Parameter(torch.full((n,), v, device="cuda")) for v in (1.0, 0.0, 0.0))
    module = torch.nn.ParameterList([w, a, b])
    wrapper = DDPIndividualParameters(module)
    out = []
    for step in range(3):
        x = torch.ones(1, n, device="cuda")
        scale = torch.full((1, n), float(rank + 1 + step), device="cuda")
        ((x * w) + a.unsqueeze(0) + b.unsqueeze(0)).mul(scale).sum().backward()
        wrapper.finish_gradient_synchronization()
        out.append([t.grad.unique().tolist() for t in (w, a, b)])
        module.zero_grad()
    return out


def test_individual_parameters_with_aliased_gradients_on_nccl():
    for result in spawn(_aliased_job, 2, backend="nccl", timeout_s=120.0):
        for step, grads in enumerate(result):
            mean = (1 + step + 2 + step) / 2
            assert grads == [[mean]] * 3, (step, grads)
