"""cs336_systems.bench.workloads.data_parallel: every variant of DistributedTrainStep, and train_case, on the
"tiny" model with gloo/CPU and 2 ranks, against a single-process AdamW reference.

One spawned job (a spawn costs ~3 s here) builds every variant, runs two steps, and returns the full
parameters (rank 0's, plus the largest difference between the ranks' copies), the per-step ``sync_s``
and each rank's batch.  The parent replays the same two steps in one process from the same seed: for
the data-parallel variants, AdamW on the mean of the two ranks' losses (DDP averages the gradients, so
its update is that of the mean loss); for "none", AdamW on the rank's own batch only.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.model import build
from cs336_systems.parallel.launch import spawn
from cs336_systems.bench.workloads.data_parallel import VARIANTS, DistributedTrainStep, train_case

WORLD, CONTEXT, BATCH, VOCAB, STEPS, LR, SEED = 2, 32, 2, 512, 2, 1e-4, 0
WITH_SYNC = {"naive", "flat", "individual", "bucketed", "zero-broadcast"}
WITHOUT_SYNC = {"none", "torch-ddp", "zero1", "torch-zero", "torch-fsdp2"}
TRAIN_CASE = {"size": "tiny", "context": CONTEXT, "batch_size": BATCH, "precision": "fp32", "warmup": 1,
              "rounds": 3}


def _full_params(step: DistributedTrainStep) -> dict[str, torch.Tensor]:
    """{name in the original model: full float32 copy}; collective for the sharded variants."""
    if step.variant == "fsdp":
        return step.wrapper.gather_full_params()
    module = getattr(step.model, "module", step.model)  # our DDPs and torch DDP keep the model as .module
    out = {}
    for name, p in module.named_parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):  # torch-fsdp2: a DTensor shard
            p = p.full_tensor()
        out[name] = p.float().clone()
    return out


def _job(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    out: dict = {"variants": {}}
    for variant in VARIANTS:
        step = DistributedTrainStep(variant=variant, size="tiny", context=CONTEXT, batch_size=BATCH,
                                    precision="fp32", device=cpu, vocab_size=VOCAB, lr=LR, seed=SEED)
        sync = []
        for _ in range(STEPS):
            step()
            sync.append(step.sync_s)
        params = _full_params(step)
        flat = torch.cat([params[n].flatten() for n in sorted(params)])
        copies = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(copies, flat)
        out["variants"][variant] = {
            "params": params if rank == 0 else None,
            "rank_max_diff": max((c - copies[0]).abs().max().item() for c in copies),
            "sync_s": sync,
            "batch": (step.tokens.clone(), step.targets.clone()),
        }
        del step
    out["train_case"] = {v: train_case(cpu, dict(TRAIN_CASE, variant=v)) for v in ("naive", "none")}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_job, WORLD, timeout_s=120)


def _reference_model() -> torch.nn.Module:
    torch.manual_seed(SEED)  # as DistributedTrainStep does before building
    return build("tiny", context_length=CONTEXT, vocab_size=VOCAB)


def _loss(model, params: dict[str, torch.Tensor], batches) -> float:
    with torch.no_grad():
        losses = [F.cross_entropy(torch.func.functional_call(model, params, (x,)).flatten(0, 1), y.flatten())
                  for x, y in batches]
    return float(torch.stack(losses).mean())


def _train_reference(batches) -> dict[str, torch.Tensor]:
    """Two AdamW steps on the mean of the batches' mean cross-entropies, in one process."""
    model = _reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in batches]).mean()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _batches(results, variant):
    return [r["variants"][variant]["batch"] for r in results]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_every_rank_gets_its_own_batch(results):
    for variant in VARIANTS:
        (x0, y0), (x1, y1) = _batches(results, variant)
        assert x0.shape == (BATCH, CONTEXT) and not torch.equal(x0, x1) and not torch.equal(y0, y1)
        assert int(x0.max()) < VOCAB


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "none"])
def test_data_parallel_variants_match_single_process_adamw_on_the_mean_loss(results, variant):
    out = results[0]["variants"][variant]
    assert out["rank_max_diff"] == 0.0  # every rank holds the same full parameters
    batches = _batches(results, variant)
    expected = _train_reference(batches)
    initial = dict(_reference_model().named_parameters())
    # Each AdamW step moves a weight by up to ~lr; agreement well below that is the same update.
    assert _max_diff(out["params"], expected) < LR / 20
    assert _max_diff(out["params"], initial) > LR / 2  # and the parameters did move
    model = _reference_model()
    assert _loss(model, out["params"], batches) < _loss(model, initial, batches)


def test_none_trains_each_rank_alone_on_its_own_batch(results):
    out = results[0]["variants"]["none"]
    assert out["rank_max_diff"] > LR / 2  # the ranks' models diverged: no communication
    batches = _batches(results, "none")
    own = _train_reference(batches[:1])  # rank 0's batch only
    assert _max_diff(out["params"], own) < LR / 20
    assert _max_diff(out["params"], _train_reference(batches)) > LR / 2  # not the averaged update
    model = _reference_model()
    initial = dict(model.named_parameters())
    assert _loss(model, out["params"], batches[:1]) < _loss(model, initial, batches[:1])


@pytest.mark.parametrize("variant", sorted(WITH_SYNC | WITHOUT_SYNC))
def test_sync_time_is_recorded_only_by_our_synchronizing_wrappers(results, variant):
    for r in results:
        sync = r["variants"][variant]["sync_s"]
        assert len(sync) == STEPS
        if variant in WITH_SYNC:
            assert all(isinstance(s, float) and s > 0 for s in sync), sync
        else:
            assert sync == [None] * STEPS


def test_train_case_returns_rounds_and_the_sync_share(results):
    naive = results[0]["train_case"]["naive"]
    assert naive["status"] == "ok" and len(naive["times_s"]) == TRAIN_CASE["rounds"]
    assert all(t > 0 for t in naive["times_s"]) and naive["peak_memory_bytes"] is None
    info = naive["extra_info"]
    assert len(info["rank_median_ms"]) == WORLD
    assert info["sync_ms"] > 0
    # Per round, the slowest rank's sync is within the slowest rank's step, so the medians keep that order.
    assert info["sync_share"] == pytest.approx(info["sync_ms"] / 1e3 / statistics.median(naive["times_s"]))
    assert 0 < info["sync_share"] <= 1
    assert "memory_gib" not in info and "num_buckets" not in info  # CPU; naive has no buckets
    none = results[0]["train_case"]["none"]
    assert none["status"] == "ok" and len(none["times_s"]) == TRAIN_CASE["rounds"]
    assert "sync_ms" not in none["extra_info"] and "sync_share" not in none["extra_info"]
    assert results[1]["train_case"] == results[0]["train_case"]  # slowest-rank numbers, same on every rank


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="unknown variant 'ddp-magic'; valid: none, torch-ddp, naive"):
        DistributedTrainStep(variant="ddp-magic", size="tiny", context=CONTEXT, batch_size=BATCH,
                             precision="fp32", device="cpu")


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"bucketed", "zero-broadcast"}))
def test_bucket_size_only_for_bucketed_variants(variant):
    with pytest.raises(ValueError, match=f"bucket_size_mb=1.5 applies only to .*not variant '{variant}'"):
        DistributedTrainStep(variant=variant, size="tiny", context=CONTEXT, batch_size=BATCH, precision="fp32",
                             device="cpu", bucket_size_mb=1.5)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="DistributedTrainStep needs an initialized torch.distributed"):
        DistributedTrainStep(variant="naive", size="tiny", context=CONTEXT, batch_size=BATCH, precision="fp32",
                             device="cpu")


@pytest.mark.parametrize("variant", ["zero1", "fsdp", "torch-fsdp2", "zero-broadcast", "torch-zero"])
def test_fp16_is_refused_where_the_inf_check_would_be_per_rank(variant):
    with pytest.raises(ValueError, match=rf"precision='fp16' .* not supported with variant '{variant}'"):
        DistributedTrainStep(variant=variant, size="tiny", context=CONTEXT, batch_size=BATCH, precision="fp16",
                             device="cpu")
