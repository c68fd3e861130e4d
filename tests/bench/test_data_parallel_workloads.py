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
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.model import build
from cs336_systems.parallel.launch import spawn
from cs336_systems.bench.workloads import data_parallel as dp
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


# --- memory bookkeeping stays out of the timed step ------------------------------------------------------
#
# The bookkeeping (walking parameters, gradients and optimizer state: DTensor.to_local() on each under
# torch-fsdp2) only runs on CUDA.  Here the step is told it is on CUDA, with torch.cuda's memory counters
# faked, and the bookkeeping helpers are counted: the timed step must never call them, one recorded step
# after the measured rounds must.

BOOKKEEPING_VARIANTS = ("naive", "torch-fsdp2")
FAKE_PEAK, FAKE_ALLOCATED = 3 * 2**30, 2**30


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _bookkeeping_calls(cpu: torch.device, variant: str) -> dict:
    """-> bookkeeping calls made by timed steps and by one recorded step; train_case's count per case."""
    real = {name: getattr(torch.cuda, name) for name in
            ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated", "synchronize")}
    real_local, real_state = dp._local, dp.DistributedTrainStep._optimizer_state_bytes
    real_step_cls = dp.DistributedTrainStep
    local, state = _Counted(real_local), _Counted(real_state)
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    torch.cuda.max_memory_allocated = lambda device=None: FAKE_PEAK
    torch.cuda.memory_allocated = lambda device=None: FAKE_ALLOCATED
    torch.cuda.synchronize = lambda device=None: None
    dp._local = local
    dp.DistributedTrainStep._optimizer_state_bytes = lambda self: state(self)

    class OnFakeCuda(real_step_cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.cuda = True  # take the CUDA bookkeeping paths, with the counters above

    out: dict = {}
    try:
        step = OnFakeCuda(variant=variant, size="tiny", context=CONTEXT, batch_size=BATCH, precision="fp32",
                          device=cpu, vocab_size=VOCAB, lr=LR, seed=SEED)
        for _ in range(3):
            step()
        out["timed"] = (local.calls, state.calls)
        record = getattr(step, "record_memory", None)
        out["memory"] = record() if record is not None else None
        out["recorded"] = (local.calls - out["timed"][0], state.calls - out["timed"][1])
        out["param_bytes"] = sum(dp._local(p).numel() * 4 for p in step.model.parameters())
        del step
        before = state.calls
        dp.DistributedTrainStep = OnFakeCuda
        result = train_case(cpu, dict(TRAIN_CASE, variant=variant))
        out["train_case_calls"] = state.calls - before
        out["train_case_memory"] = result.get("extra_info", {}).get("memory_gib")
    finally:
        for name, fn in real.items():
            setattr(torch.cuda, name, fn)
        dp._local = real_local
        real_step_cls._optimizer_state_bytes = real_state
        dp.DistributedTrainStep = real_step_cls
    return out


# --- an OOM on one rank ends the case on every rank, recorded as OOM ------------------------------------

OOM_TEXT = "CUDA out of memory. Tried to allocate 4.00 GiB"


def _failures(cpu: torch.device, rank: int) -> dict:
    """train_case with an OOM injected on one rank: while building the model (rank 1; rank 0 goes on into
    NaiveDDP's construction collectives), and in measured round 2 of torch DDP (rank 0; rank 1 waits in
    DDP's all-reduce, and its DDP module holds the process group)."""
    out: dict = {}
    real_build, real_step_cls = dp.build, dp.DistributedTrainStep

    def build_oom_on_rank1(*args, **kwargs):
        if rank == 1:
            raise torch.OutOfMemoryError(OOM_TEXT)
        return real_build(*args, **kwargs)

    class OomInRound(real_step_cls):
        calls = 0

        def __call__(self):
            OomInRound.calls += 1
            if rank == 0 and OomInRound.calls == TRAIN_CASE["warmup"] + 2:
                raise torch.OutOfMemoryError(OOM_TEXT)
            super().__call__()

    try:
        dp.build = build_oom_on_rank1
        start = time.perf_counter()
        out["setup"] = train_case(cpu, dict(TRAIN_CASE, variant="naive"))
        out["setup_s"] = time.perf_counter() - start
        dp.build = real_build
        dp.DistributedTrainStep = OomInRound
        start = time.perf_counter()
        out["round"] = train_case(cpu, dict(TRAIN_CASE, variant="torch-ddp"))
        out["round_s"] = time.perf_counter() - start
    finally:
        dp.build, dp.DistributedTrainStep = real_build, real_step_cls
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
    out["bookkeeping"] = {v: _bookkeeping_calls(cpu, v) for v in BOOKKEEPING_VARIANTS}
    out["failures"] = _failures(cpu, rank)
    out["after_failures"] = train_case(cpu, dict(TRAIN_CASE, variant="flat"))
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


@pytest.mark.parametrize("variant", BOOKKEEPING_VARIANTS)
def test_timed_step_does_no_memory_bookkeeping(results, variant):
    for r in results:
        out = r["bookkeeping"][variant]
        assert out["timed"] == (0, 0), f"{variant}: the timed step walked tensors (to_local, optimizer state)"
        memory = out["memory"]
        assert memory is not None, "DistributedTrainStep.record_memory() is missing"
        assert out["recorded"][0] > 0 and out["recorded"][1] == 1  # one recorded step does the bookkeeping
        assert memory["parameters"] == out["param_bytes"] > 0  # this rank's (for torch-fsdp2: its shards)
        assert memory["peak_before_step"] == memory["peak_step"] == FAKE_PEAK
        assert memory["allocated_after_step"] == FAKE_ALLOCATED
        assert memory["activations_other"] == FAKE_PEAK - memory["parameters"] - memory["gradients"] - memory[
            "optimizer_state"]
        # train_case: the bookkeeping ran once for the case (after the rounds), not once per round
        assert out["train_case_calls"] == 1, out["train_case_calls"]
        assert out["train_case_memory"]["peak_step"] == FAKE_PEAK / 2**30


def test_oom_on_one_rank_ends_the_case_on_every_rank_as_oom(results):
    for r in results:
        failures = r["failures"]
        assert failures["setup"] == {"status": "oom", "error": failures["setup"]["error"]}
        assert failures["setup"]["error"].startswith(f"rank 1 ran out of memory in setup: {OOM_TEXT}")
        assert failures["round"]["status"] == "oom"
        assert failures["round"]["error"].startswith(f"rank 0 ran out of memory in round 2: {OOM_TEXT}")
        assert failures["setup_s"] < 10 and failures["round_s"] < 10, failures  # not the collective timeout
        # and the process group works for the next case
        assert r["after_failures"]["status"] == "ok" and len(r["after_failures"]["times_s"]) == TRAIN_CASE["rounds"]
    assert results[0]["failures"]["setup"] == results[1]["failures"]["setup"]
