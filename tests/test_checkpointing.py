"""Activation checkpointing (cs336_systems.checkpointing, ModelConfig.checkpoint), alone and under FSDP / ZeRO.

References: gradients and training runs without checkpointing (the same computation, so equal to 1e-6 and in
practice bitwise); saved-for-backward bytes predicted from one block's saved bytes and the boundary tensors the
checkpoints keep; segment layouts from an independent formula (every-k) and from Chen et al.'s cost model
(sqrt).  The distributed checks (gloo/CPU, 2 ranks) all run in one spawned job.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cs336_systems import model as lm
from cs336_systems.checkpointing import CheckpointPolicy, run_blocks
from cs336_systems.parallel.ddp import DDPIndividualParameters
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.launch import spawn
from cs336_systems.parallel.zero import ShardedOptimizer
from fsdp_helpers import gathered_alive

VOCAB, SEQ, BATCH = 53, 16, 2


def _model(policy: str, n_layers: int = 4, seed: int = 0) -> lm.TransformerLM:
    torch.manual_seed(seed)
    return lm.build("tiny", n_layers=n_layers, vocab_size=VOCAB, context_length=SEQ, checkpoint=policy)


def _tokens(seed: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (batch, SEQ), generator=gen), torch.randint(VOCAB, (batch, SEQ), generator=gen)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("spec, kind, k", [
    ("none", "none", None), ("sqrt", "sqrt", None), ("nested", "nested", None), ("every-1", "every", 1),
    ("every-3", "every", 3),
    ("every-12", "every", 12), ("every-100", "every", 100),
])
def test_parse_valid(spec: str, kind: str, k: int | None) -> None:
    policy = CheckpointPolicy.parse(spec)
    assert (policy.kind, policy.k) == (kind, k)
    assert str(policy) == spec
    assert CheckpointPolicy.parse(policy) is policy


@pytest.mark.parametrize("spec", [
    "", "None", "SQRT", " sqrt", "sqrt ", "every", "every-", "every-0", "every--1", "every-+2", "every-01",
    "every-1.5", "every-k", "every_2", "every2", "all", "full",
])
def test_parse_rejects_bad_strings(spec: str) -> None:
    with pytest.raises(ValueError, match="checkpoint must be one of") as info:
        CheckpointPolicy.parse(spec)
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize("spec", [2, None, 1.5, b"sqrt", ["sqrt"]])
def test_parse_rejects_non_strings(spec) -> None:
    with pytest.raises(TypeError, match="checkpoint must be a string"):
        CheckpointPolicy.parse(spec)


@pytest.mark.parametrize("kind, k, pattern", [
    ("bogus", None, "kind must be"), ("every", 0, "positive integer k, got k=0"),
    ("every", None, "positive integer k, got k=None"), ("every", True, "k=True"), ("every", 2.0, "k=2.0"),
    ("sqrt", 2, "takes no k, got k=2"), ("none", 1, "takes no k"),
])
def test_policy_constructor_validates(kind, k, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        CheckpointPolicy(kind, k)


def test_segments_rejects_bad_block_counts() -> None:
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="n_blocks must be"):
            CheckpointPolicy.parse("sqrt").segments(bad)
    assert CheckpointPolicy.parse("sqrt").segments(0) == ()
    assert CheckpointPolicy.parse("every-2").segments(0) == ()


# ---------------------------------------------------------------------------------------------- layouts
def _segment_ids(segments: tuple[range, ...], n: int) -> list[int]:
    """Block i -> index of its segment; also checks the segments partition range(n) into consecutive runs."""
    flat = [i for seg in segments for i in seg]
    assert flat == list(range(n)), segments
    assert all(seg.step == 1 and len(seg) > 0 for seg in segments), segments
    return [next(j for j, seg in enumerate(segments) if i in seg) for i in range(n)]


@pytest.mark.parametrize("n", range(1, 13))
def test_layout_none_and_every(n: int) -> None:
    assert CheckpointPolicy.parse("none").segments(n) == ()
    for k in range(1, 5):
        segments = CheckpointPolicy.parse(f"every-{k}").segments(n)
        assert _segment_ids(segments, n) == [i // k for i in range(n)], (n, k)


@pytest.mark.parametrize("n", range(1, 13))
def test_layout_sqrt_minimises_chen_cost(n: int) -> None:
    segments = CheckpointPolicy.parse("sqrt").segments(n)
    _segment_ids(segments, n)
    lengths = [len(seg) for seg in segments]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True), lengths
    # kept boundaries + one recomputed segment, in blocks: the minimum over all segment lengths m
    best = min(-(-n // m) + m for m in range(1, n + 1))
    assert len(segments) + max(lengths) == best == math.ceil(2 * math.sqrt(n) - 1e-9), (n, lengths)


@pytest.mark.parametrize("n, lengths", [
    (1, [1]), (2, [2]), (3, [2, 1]), (4, [2, 2]), (5, [3, 2]), (7, [3, 2, 2]), (9, [3, 3, 3]), (10, [4, 3, 3]),
    (12, [4, 4, 4]), (16, [4, 4, 4, 4]), (17, [5, 4, 4, 4]), (48, [7, 7, 7, 7, 7, 7, 6]),
])
def test_layout_sqrt_examples(n: int, lengths: list[int]) -> None:
    assert [len(seg) for seg in CheckpointPolicy.parse("sqrt").segments(n)] == lengths


# ---------------------------------------------------------------------------------------------- the model
def test_config_field_and_build() -> None:
    model = lm.build("tiny", checkpoint="sqrt")
    assert model.config.checkpoint == "sqrt" and model.checkpoint_policy == CheckpointPolicy("sqrt")
    assert lm.config("tiny").checkpoint == "none"
    cfg = lm.config("tiny", checkpoint=CheckpointPolicy("every", 2))
    assert cfg.checkpoint == "every-2"  # stored as its spec string
    plain, ckpt = _model("none"), _model("every-1")
    assert lm.count_parameters(plain) == lm.count_parameters(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ckpt.state_dict().values()))
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    with torch.device("meta"):
        assert lm.count_parameters(lm.build("xl", checkpoint="sqrt")) == lm.count_parameters(lm.build("xl"))


@pytest.mark.parametrize("bad, exc", [("every-0", ValueError), ("full", ValueError), (3, TypeError)])
def test_config_rejects_bad_policy(bad, exc) -> None:
    with pytest.raises(exc, match=r"checkpoint must be") as info:
        lm.build("tiny", checkpoint=bad)
    assert repr(bad) in str(info.value)


POLICIES = ("every-1", "every-2", "sqrt", "every-7")


def _grads(policy: str, autocast: bool, n_layers: int = 5) -> tuple[torch.Tensor, dict, int]:
    """(loss, {name: grad}, number of block forward calls) of one forward/backward."""
    model = _model(policy, n_layers)
    calls = [0]
    for block in model.layers:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tokens, targets = _tokens(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _loss(model(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls[0]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gradients_match_no_checkpointing(autocast: bool) -> None:
    n_layers = 5  # every-2 leaves a shorter last segment, sqrt gives [3, 2], every-7 one segment
    ref_loss, ref_grads, ref_calls = _grads("none", autocast, n_layers)
    assert ref_calls == n_layers
    assert all(g is not None and g.abs().max() > 0 for g in ref_grads.values())
    for policy in POLICIES + ("nested",):
        loss, grads, calls = _grads(policy, autocast, n_layers)
        # each block recomputed exactly once in backward.  nested: once alone, and once in its outer
        # segment's recomputation, except the segment's last block (the non-reentrant checkpoint stops
        # recomputing once every tensor the outer level saved, the inner checkpoints' inputs, is back)
        n_outer = len(CheckpointPolicy.parse("sqrt").segments(n_layers))
        expected = 3 * n_layers - n_outer if policy == "nested" else 2 * n_layers
        assert calls == expected, (policy, calls)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
        for name, g in grads.items():
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=f"{policy}: {name}")


def test_no_recomputation_without_grad() -> None:
    plain, ckpt = _model("none"), _model("sqrt")
    calls = [0]
    for block in ckpt.layers:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tokens, _ = _tokens(2)
    with torch.no_grad():
        assert torch.equal(ckpt(tokens), plain(tokens))
    assert calls[0] == 4


def test_run_blocks_with_inputs_not_requiring_grad() -> None:
    """A stack fed a leaf without grad (a frozen embedding): parameter gradients still match."""
    blocks = _model("none").layers
    x = torch.randn(BATCH, SEQ, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ)
    grads = {}
    for policy in ("none", "every-2", "sqrt"):
        blocks.zero_grad(set_to_none=True)
        run_blocks(blocks, x, positions, policy=policy).square().mean().backward()
        grads[policy] = [p.grad.clone() for p in blocks.parameters()]
    for policy in ("every-2", "sqrt"):
        for g, ref in zip(grads[policy], grads["none"]):
            torch.testing.assert_close(g, ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- memory
def _saved_bytes(fn) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs (outermost saved-tensor hooks)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


class _LiveStorages(TorchDispatchMode):
    """Records every storage an op creates while active; `live_bytes` sums those still allocated."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        super().__init__()
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}  # parameters, inputs (views of them)
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.exclude:
                    self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def _activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of forward-created tensors that survive the forward, the logits excluded: what the graph keeps."""
    tracker = _LiveStorages([*model.parameters(), *model.buffers(), tokens])
    with tracker:
        logits = model(tokens)
    if isinstance(model, FSDP):  # let gloo's worker drop its transient reference to the last gathered weight
        gathered_alive(model)
    return tracker.live_bytes() - logits.untyped_storage().nbytes()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_saved_bytes_drop_as_predicted(autocast: bool) -> None:
    """saved(policy) = outside + segments * boundary;  saved(none) = outside + N * one block's saved bytes.

    A checkpoint saves its inputs for backward (the residual stream (B, T, d) fp32 and the positions (T,)
    int64) and nothing else; a block run alone gives what each block saves without checkpointing.
    """
    n_layers = 6
    tokens, _ = _tokens(4)
    saved = {}
    for policy in ("none", "every-1", "every-2", "every-4", "sqrt", "nested", "every-6"):
        model = _model(policy, n_layers)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            saved[policy] = _saved_bytes(lambda: model(tokens))
    block = _model("none", 1).layers[0]
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        per_block = _saved_bytes(lambda: block(x, torch.arange(SEQ)))
    boundary = BATCH * SEQ * 64 * 4 + SEQ * 8
    outside = saved["every-6"] - boundary  # one segment: only the stack's input is kept
    # nested keeps what sqrt keeps after the forward (its outer boundaries); it differs in backward
    for policy, n_segments in {"every-1": 6, "every-2": 3, "every-4": 2, "sqrt": 2, "nested": 2}.items():
        assert saved[policy] == outside + n_segments * boundary, (policy, saved)
    assert saved["none"] == outside + n_layers * per_block, (saved, per_block)
    assert saved["every-1"] < saved["none"] / 5  # a block keeps >> one boundary tensor


def test_activation_bytes_after_forward() -> None:
    """Same ordering measured independently of saved-tensor hooks: surviving storages after the forward."""
    tokens, _ = _tokens(4)
    live = {policy: _activation_bytes(_model(policy, 6), tokens)
            for policy in ("none", "every-1", "every-2", "sqrt", "every-6")}
    boundary = BATCH * SEQ * 64 * 4
    assert live["every-1"] - live["every-2"] == 3 * boundary, live
    assert live["every-2"] - live["sqrt"] == boundary and live["sqrt"] - live["every-6"] == boundary, live
    assert live["none"] > 5 * live["every-1"], live


# ---------------------------------------------------------------------------------------------- distributed
DIST_POLICIES = ("none", "every-1", "every-3", "sqrt")  # on 4 blocks: 4, 2 ([0,1,2], [3]) and 2 segments
STEPS, DEPTH = 2, 2


def _train(rank: int, world: int, setup: str, policy: str) -> dict:
    """Two AdamW steps of the 4-block tiny LM, each rank on its own batch; final full parameters + counters."""
    model = _model(policy)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    dtype = torch.bfloat16 if setup == "fsdp-bf16" else None
    out: dict = {"losses": []}
    if setup.startswith("fsdp"):
        wrapped = FSDP(model, compute_dtype=dtype, prefetch_depth=DEPTH)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    elif setup == "broadcast":  # the handout's design: DDP averages the gradients, owners broadcast
        wrapped = DDPIndividualParameters(model)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mode="broadcast", lr=1e-2, weight_decay=0.1)
    else:
        wrapped = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mode="zero1", lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        tokens, targets = _tokens(100 * step + rank)
        if setup.startswith("fsdp"):
            wrapped.reset_counters()
        opt.zero_grad()
        loss = _loss(wrapped(tokens), targets)
        loss.backward()
        if hasattr(wrapped, "finish_gradient_synchronization"):
            wrapped.finish_gradient_synchronization()
        opt.step()
        out["losses"].append(loss.item())
    if setup.startswith("fsdp"):
        out.update(num_gathers=wrapped.num_gathers, num_reduce_scatters=wrapped.num_reduce_scatters,
                   num_all_reduces=wrapped.num_all_reduces, max_live_gathered=wrapped.max_live_gathered,
                   alive=gathered_alive(wrapped), live_gathered=wrapped.live_gathered)
        params = wrapped.gather_full_params()
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        replicas = [torch.empty_like(torch.cat([p.reshape(-1) for p in params.values()])) for _ in range(world)]
        dist.all_gather(replicas, torch.cat([p.reshape(-1) for p in params.values()]))
        out["replica_diff"] = max((r - replicas[0]).abs().max().item() for r in replicas)
    out["params"] = params
    out["min_update"] = min((params[n] - p).abs().max().item() for n, p in initial.items())
    return out


def _distributed_job(rank: int, world: int) -> dict:
    results = {}
    for setup in ("fsdp", "fsdp-bf16", "zero1", "broadcast"):
        for policy in (DIST_POLICIES if setup == "fsdp" else ("none", "sqrt")):
            results[setup, policy] = _train(rank, world, setup, policy)
    # Activations kept by FSDP's graph after a forward: the same as the unwrapped model's with the same policy
    # (so sharded layers' inputs are dropped inside checkpointed segments as well).
    tokens, _ = _tokens(7)
    for policy in ("none", "every-1", "sqrt"):
        plain = _activation_bytes(_model(policy), tokens)
        sharded = _activation_bytes(FSDP(_model(policy)), tokens)
        results["activation_bytes", policy] = (plain, sharded)
    return results


@pytest.fixture(scope="module")
def distributed() -> dict:
    return spawn(_distributed_job, 2, timeout_s=120.0)[0]


@pytest.mark.parametrize("setup, policy", [
    *[("fsdp", p) for p in DIST_POLICIES[1:]], ("fsdp-bf16", "sqrt"), ("zero1", "sqrt"), ("broadcast", "sqrt"),
])
def test_distributed_training_matches_no_checkpointing(distributed: dict, setup: str, policy: str) -> None:
    ref, got = distributed[setup, "none"], distributed[setup, policy]
    assert ref["min_update"] > 1e-4  # every parameter moved, so equal parameters mean equal updates
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
    assert got["params"].keys() == ref["params"].keys()
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][name], rtol=0, atol=1e-6, msg=f"{setup}/{policy}: {name}")
    if "replica_diff" in got:
        assert got["replica_diff"] == 0.0


@pytest.mark.parametrize("setup, policy", [*[("fsdp", p) for p in DIST_POLICIES[1:]], ("fsdp-bf16", "sqrt")])
def test_fsdp_counters_with_recomputation(distributed: dict, setup: str, policy: str) -> None:
    """Recomputed forwards gather again (at most once per recomputed sharded call); reductions are unchanged."""
    ref, got = distributed[setup, "none"], distributed[setup, policy]
    recomputed_calls = 4 * 4  # qkv, output, w13, w2 in each of the 4 checkpointed blocks
    assert ref["num_gathers"] < got["num_gathers"] <= ref["num_gathers"] + recomputed_calls, (ref, got)
    assert got["num_reduce_scatters"] == ref["num_reduce_scatters"] == 4 * 4 + 2  # + embedding, LM head
    assert got["num_all_reduces"] == ref["num_all_reduces"]
    assert got["max_live_gathered"] <= DEPTH + 2  # the prefetch window + one on-demand gather of a recompute
    assert got["alive"] == 0 and got["live_gathered"] == 0


@pytest.mark.parametrize("policy", ["none", "every-1", "sqrt"])
def test_fsdp_keeps_the_same_activations_as_the_plain_model(distributed: dict, policy: str) -> None:
    plain, sharded = distributed["activation_bytes", policy]
    assert sharded == plain
    if policy != "none":
        assert plain < distributed["activation_bytes", "none"][0] / 5


class _PeakLive(TorchDispatchMode):
    """Peak, over the ops run while active, of the bytes in storages those ops created and that are alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def _peak_backward_bytes(policy: str, n_layers: int) -> int:
    """Peak bytes of tensors created during the backward (recomputed activations, gradients) and alive."""
    # The bare block stack (no embedding or LM head) on a batch large enough that activations, not the
    # parameters' gradients (~5 MB here), decide the peak.
    blocks = _model("none", n_layers).layers
    x = torch.randn(32, SEQ, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    loss = run_blocks(blocks, x, torch.arange(SEQ), policy=policy).square().mean()
    tracker = _PeakLive()
    with tracker:
        loss.backward()
    return tracker.peak


def test_nested_holds_less_in_backward_than_sqrt() -> None:
    """sqrt recomputes a whole segment (its blocks' internals alive together); nested one block at a time."""
    n_layers = 9  # sqrt: 3 segments of 3 blocks
    peaks = {policy: _peak_backward_bytes(policy, n_layers) for policy in ("every-1", "sqrt", "nested")}
    assert 0 < peaks["nested"] < peaks["sqrt"], peaks
    assert peaks["every-1"] < peaks["sqrt"], peaks
