"""Fully sharded data parallelism (FSDP / ZeRO-3) for Linear- and Embedding-like layers.

Every rank owns a flat, zero-padded 1/world slice of each *sharded* weight (by default the ``weight`` of every
``nn.Linear`` and ``nn.Embedding``); all other parameters (norm gains, biases, ...) are *replicated* and their
gradients are averaged with an all-reduce, as in DDP (one flat all-reduce per dtype in
``finish_gradient_synchronization``).

Per sharded weight W with ``n = W.numel()``, ``padded = ceil(n / world) * world`` and ``s = padded / world``::

    master shard     fp32 (s,)          rank r holds flat(W)[r*s : (r+1)*s]  (zeros past n)
    forward          all-gather (padded,) in compute_dtype -> view (:n) as W's shape -> layer -> free
    backward         all-gather again (the forward copy is not kept) -> layer backward gives dW (W's shape)
    dW               upcast to fp32, pad, reduce-scatter (sum) -> (s,) -> / world -> shard.grad

The shard replaces the weight under its original name (``fsdp.module.lm_head.weight`` is the 1-D shard), so
``fsdp.parameters()`` / ``named_parameters()`` are the local shards plus the replicated parameters and any torch
optimizer can be built on them.  The padding stays zero under SGD / Adam / AdamW (its gradient is always 0).

``FSDP(module)`` modifies ``module`` in place (weights replaced by shards, forwards wrapped); the selected
modules are expected to be leaves (Linear / Embedding-like: a ``weight`` and perhaps a bias).

Every rank must use the same sharded layers and replicated parameters in a step (true of the LM and of any
model without data-dependent branches): collectives are issued as gradients appear, so a layer used on one
rank only would leave the ranks' collective sequences mismatched.  (The DDP wrappers handle that case with
per-tensor flags; FSDP does not.)

How a sharded layer runs (its ``forward`` is wrapped in place):

1. The full weight is gathered (or an already prefetched gather is waited on) and passed through an identity
   `torch.autograd.Function` (`_GatheredWeight`) whose backward receives dW and starts its reduce-scatter at once.
2. The weight is swapped into the module for the duration of the call, under `saved_tensors_hooks` that replace
   every tensor autograd saves which aliases the gathered buffer (e.g. ``W.t()`` saved by ``F.linear``) by a
   token; the token's unpack re-gathers.  So no full weight outlives its layer's forward, and the backward of
   a layer that never needs W (``F.embedding``, or a Linear whose input needs no gradient) gathers nothing.
   Saved tensors that are not the weight go to the enclosing pair of saved-tensor hooks when there is one (an
   activation-checkpoint region, an offloading or counting hook): autograd applies only the innermost pair, so
   without handing them on, a checkpointed region would still keep every sharded layer's input.
3. A hook on the layer's output (it fires when the output's gradient is ready, i.e. just before the layer's
   backward) is the *pre-backward hook*: it starts the gather for this layer and prefetches the next ones.

Prefetch order and bound: each forward records the order in which sharded layers run; the next forward uses it
as its plan (so the first forward gathers on demand and prefetching starts with the second), and each forward's
backward uses the reverse of its own record, restricted to the calls that saved W.  When call k starts, gathers
for calls k .. k + ``prefetch_depth`` (default 2) are put in flight; a gathered weight is freed after its call
unless one of those next calls uses it again.  Hence ``max_live_gathered <= prefetch_depth + 1`` for a graph
whose backward runs in reverse forward order (sequential models, residual blocks; an activation-checkpoint
recomputation adds at most one on-demand gather at a time).  If the run deviates from the plan, prefetching
stops for the rest of that pass and layers gather on demand (still correct).

Precision: with ``compute_dtype`` (bf16 / fp16) the shard is cast *before* the all-gather (half the traffic)
and the layer computes in ``compute_dtype``: floating-point tensor arguments of a sharded layer (top-level
positional and keyword arguments) and its other floating parameters (a bias: replicated, fp32 master) are cast
to ``compute_dtype``, and its output stays in ``compute_dtype``.
Nothing else is cast: replicated layers run in whatever dtype reaches them.  Gradients are reduced in fp32
and master weights / optimizer states are fp32.  ``compute_dtype=None`` (or float32) computes in fp32.

Tied weights: a Parameter shared by several selected modules (e.g. embedding and LM head) is sharded once and
gathered separately for each use; the gradients of all uses are summed into the one shard.  A Parameter shared
between a selected module's ``weight`` and anything else (another name, an unselected module) is rejected with
a ValueError.

Collectives: ``all_gather_single`` / ``reduce_scatter_single`` (their pre-2.13 names ``all_gather_into_tensor``
/ ``reduce_scatter_tensor`` on older torch), all ``async_op=True`` so gathers overlap compute and reduce-scatters
overlap the rest of the backward.  Both exist on gloo in torch 2.13 (CPU); a backend without reduce-scatter
falls back to an all-reduce of the padded gradient and keeps its own slice (``_reduce_scatter_fallback``).

Activation checkpointing (`torch.utils.checkpoint`, non-reentrant, e.g. cs336_systems.checkpointing): the
recomputation in backward runs the sharded layers outside ``FSDP.forward``; each gathers on demand (a weight
already gathered for the backward is used and left in place), so ``num_gathers`` grows by at most one gather per
recomputed call, and the recomputed graph (its output hooks, its ``_GatheredWeight`` nodes) is discarded unused.

Gradients: call ``finish_gradient_synchronization()`` after the backward and before ``optimizer.step()``; it
waits for the collectives and adds the averages into ``.grad`` (so gradients accumulate over micro-batches when
``.grad`` is not zeroed; the next ``forward`` settles a backward that was not finished).  The shards receive
their gradients only this way: ``torch.autograd.grad`` w.r.t. a shard returns nothing.  Double backward
(``create_graph=True``) is not supported.

Initial values: rank 0's parameters are broadcast at construction (as DDP does), so ranks may start from
different initialisations.  The models themselves must match: construction first compares the parameters'
and buffers' names, shapes, dtypes and ``requires_grad`` across ranks and raises ValueError on every rank,
naming the ranks that differ (a different model would hang the broadcast or be sharded differently).
After wrapping, ``module``'s sharded weights are 1-D shards: code that reads their
shapes (``reset_parameters``) or ``state_dict()`` (local shards) sees them as such; ``gather_full_params()``
gives the full tensors.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from cs336_systems.parallel.launch import check_same_across_ranks, module_signature, require_process_group

__all__ = ["FSDP", "default_shard_predicate"]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
# The innermost (pack, unpack) saved-tensor hooks in force, or None; a private binding (torch._functorch uses it
# too): without it, saved tensors are not handed on to enclosing hooks (correct, but checkpointing saves less).
_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)


def default_shard_predicate(module: nn.Module) -> bool:
    """Shard the ``weight`` of every nn.Linear and nn.Embedding (the layers of cs336_systems.model)."""
    return isinstance(module, (nn.Linear, nn.Embedding))


class _ShardedWeight:
    """One sharded Parameter: its shard, shape bookkeeping and (at most one) live gathered copy."""

    def __init__(self, name: str, full: torch.Tensor, rank: int, world: int) -> None:
        self.name = name
        self.shape = full.shape
        self.numel = full.numel()
        self.shard_numel = max(1, math.ceil(self.numel / world))
        self.padded_numel = self.shard_numel * world
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=full.device)
        flat[: self.numel].copy_(full.detach().reshape(-1))
        begin = rank * self.shard_numel
        self.param = nn.Parameter(flat[begin: begin + self.shard_numel].clone(), requires_grad=full.requires_grad)
        self.gathered: torch.Tensor | None = None  # (padded_numel,) in compute dtype while live
        self.work: Any = None  # the in-flight all-gather filling `gathered`


@dataclass(eq=False)
class _Call:
    """One forward call of a sharded module (a weight used twice in a forward gives two calls)."""

    weight: _ShardedWeight
    needs_weight: bool = False  # autograd saved (a view of) the gathered weight for backward
    plan: list["_Call"] | None = None  # the backward order of the forward that made this call
    position: int | None = None  # index of this call in `plan`


class _SavedWeightView:
    """Stands in for a saved tensor aliasing the gathered weight; unpacking re-gathers."""

    __slots__ = ("call", "size", "stride", "offset")

    def __init__(self, call: _Call, t: torch.Tensor) -> None:
        self.call, self.size, self.stride, self.offset = call, t.size(), t.stride(), t.storage_offset()


class _OuterPacked:
    """A saved tensor packed by the enclosing saved-tensor hooks; unpacking goes through their unpack."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed, self.unpack = packed, unpack


class _GatheredWeight(torch.autograd.Function):
    """Identity from the shard to the gathered full weight; its backward hands dW to the owner."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, full: torch.Tensor, owner: "FSDP", call: _Call) -> torch.Tensor:
        ctx.owner, ctx.call = owner, call
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.owner._on_weight_grad(ctx.call, grad_full)
        return None, None, None, None


class _ShardedForward:
    """Replaces a selected module's ``forward``: gather, swap the weight in, run, free (see module docstring)."""

    def __init__(self, owner: "FSDP", module: nn.Module, weight: _ShardedWeight, forward: Callable) -> None:
        self.owner, self.module, self.weight, self.forward = owner, module, weight, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner._run_sharded(self.module, self.weight, self.forward, args, kwargs)


class FSDP(nn.Module):
    """Fully sharded data-parallel wrapper (see the module docstring for the algorithm).

    module: the model, identical structure on every rank, float32 weights in the sharded layers.
    compute_dtype: None / torch.float32 (compute in fp32), torch.bfloat16 or torch.float16.
    shard: predicate on modules selecting whose ``weight`` is sharded (default: nn.Linear / nn.Embedding).
    prefetch_depth: how many sharded calls ahead of the running one may be gathering (default 2; 0 = none).

    Counters (cumulative until `reset_counters`): ``num_gathers`` (full-weight all-gathers issued),
    ``num_reduce_scatters``, ``num_all_reduces`` (of replicated gradients: one per dtype per finish),
    ``live_gathered`` (full weights materialised now) and
    ``max_live_gathered`` (the most observed at once).  `gathered_storages_alive()` counts gathered buffers
    that are still allocated by anyone (autograd included): 0 between layers proves they were freed.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard: Callable[[nn.Module], bool] | None = None, *, prefetch_depth: int = 2) -> None:
        require_process_group("FSDP")
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {compute_dtype!r}"
            )
        if shard is not None and not callable(shard):
            raise TypeError(f"shard must be a callable predicate on modules or None, got {shard!r}")
        if not isinstance(prefetch_depth, int) or isinstance(prefetch_depth, bool) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be a non-negative int, got {prefetch_depth!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.prefetch_depth = prefetch_depth
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._reduce_scatter_fallback = _reduce_scatter_flat is None
        self._gather_dtype = compute_dtype or torch.float32

        # Before any collective: a different model on some rank would hang them or shard it differently.
        check_same_across_ranks("FSDP", module_signature(module))
        with torch.no_grad():
            for p in module.parameters():  # rank 0's initial values win, as in DDP
                dist.broadcast(p.data, src=0)

        self._weights: dict[int, _ShardedWeight] = {}  # id(original Parameter) -> shard bookkeeping
        self._shard_of: dict[int, _ShardedWeight] = {}  # id(shard Parameter) -> same
        self._select(module, shard or default_shard_predicate)

        # Replicated parameters: marked when autograd accumulates into them, averaged in finish (see there).
        self._replicated = [p for p in module.parameters() if id(p) not in self._shard_of and p.requires_grad]
        # Parameter hooks live on the C++ side, out of reach of Python's cycle collector: a strong
        # reference to self would keep the wrapper (and every gathered buffer it owns) alive forever.
        owner = weakref.ref(self)

        def on_replicated_grad(param: torch.Tensor) -> None:
            wrapper = owner()
            if wrapper is not None:
                wrapper._on_replicated_grad(param)

        for p in self._replicated:
            p.register_post_accumulate_grad_hook(on_replicated_grad)

        self._pending_rs: list[tuple[Any, _ShardedWeight, torch.Tensor, torch.Tensor]] = []
        self._replicated_dirty: set[int] = set()  # ids of replicated parameters with unreduced gradient
        self._fwd_plan: list[_ShardedWeight] | None = None  # sharded weights in the last forward's call order
        self._calls: list[_Call] | None = None  # the running forward's calls (None outside FSDP.forward)
        self._plan_ok = False
        self._backward_callback_queued = False
        self._gather_storages: list[StorageWeakRef] = []
        self.live_gathered = 0
        self.reset_counters()

    # ------------------------------------------------------------------ construction
    def _select(self, module: nn.Module, predicate: Callable[[nn.Module], bool]) -> None:
        selected: dict[int, nn.Module] = {}
        for name, m in module.named_modules():
            if not predicate(m) or id(m) in selected:
                continue
            w = m._parameters.get("weight")
            if not isinstance(w, nn.Parameter):
                raise ValueError(f"shard selected module {name!r} ({type(m).__name__}) without a 'weight' Parameter")
            if w.dtype != torch.float32:
                raise ValueError(
                    f"sharded weight {name}.weight has dtype {w.dtype}; FSDP keeps float32 master weights: build the "
                    "module in float32 and pass compute_dtype for low-precision compute"
                )
            if isinstance(m, nn.Embedding) and (m.sparse or m.max_norm is not None):
                raise ValueError(f"Embedding {name!r} with sparse=True or max_norm is not supported by FSDP")
            selected[id(m)] = m
            if id(w) not in self._weights:
                self._weights[id(w)] = _ShardedWeight(f"{name}.weight" if name else "weight", w,
                                                      self.rank, self.world_size)
        # A sharded Parameter may only appear as the `weight` of selected modules (tying between them is fine).
        for mname, m in module.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is not None and id(p) in self._weights and not (id(m) in selected and pname == "weight"):
                    raise ValueError(
                        f"parameter {mname + '.' if mname else ''}{pname} is tied to the sharded weight "
                        f"{self._weights[id(p)].name}, but is not the 'weight' of a sharded module; FSDP only "
                        "supports tying between sharded modules' weights"
                    )
        for m in selected.values():
            sw = self._weights[id(m._parameters["weight"])]
            m._parameters["weight"] = sw.param
            m.forward = _ShardedForward(self, m, sw, m.forward)
        self._shard_of = {id(sw.param): sw for sw in self._weights.values()}

    # ------------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._calls is not None:  # re-entered from inside the module: no extra bookkeeping
            return self.module(*args, **kwargs)
        if self._pending_rs or self._replicated_dirty:  # gradient accumulation: settle the previous backward
            self.finish_gradient_synchronization()
        # A backward that raised leaves its gathers (and the end-of-backward callback flag) behind: start
        # clean, so this forward never computes with a weight gathered before the last optimizer step.  Not
        # while a backward runs (checkpoint() around the whole wrapper recomputes this forward inside it,
        # and the backward's prefetched gathers are still wanted then).
        if torch._C._current_graph_task_id() == -1:
            self._release_all()
            self._backward_callback_queued = False
        self._calls = []
        self._plan_ok = self._fwd_plan is not None
        try:
            return self.module(*args, **kwargs)
        finally:
            calls, self._calls = self._calls, None
            self._release_all()  # prefetches the run did not use (it deviated from the plan)
            self._fwd_plan = [c.weight for c in calls]
            plan = [c for c in reversed(calls) if c.needs_weight]
            for i, c in enumerate(plan):
                c.plan, c.position = plan, i

    def finish_gradient_synchronization(self) -> None:
        """Wait for the outstanding reduce-scatters, average the replicated gradients, write the fp32 averages.

        Replicated gradients are all-reduced here, once, in one flat buffer per dtype (they are small: norm
        gains, biases), not from their accumulation hooks: a hook sees the accumulated ``.grad``, so two
        backward passes before a finish (two forwards then two backwards, ``retain_graph``) would reduce the
        first pass's gradient twice.  ``.grad`` = old (equal on every rank after the last finish) + this
        step's local sums, so sum / world = old + the average of the new contributions.
        """
        replicated = [p for p in self._replicated if id(p) in self._replicated_dirty and p.grad is not None]
        self._replicated_dirty.clear()
        reductions = []
        for dtype in dict.fromkeys(p.grad.dtype for p in replicated):  # first-seen order: same on every rank
            grads = [p.grad for p in replicated if p.grad.dtype == dtype]
            flat = torch._utils._flatten_dense_tensors(grads)
            reductions.append((dist.all_reduce(flat, async_op=True), flat, grads))
            self.num_all_reduces += 1
        pending_rs, self._pending_rs = self._pending_rs, []
        for work, sw, out, full in pending_rs:
            work.wait()
            if self._reduce_scatter_fallback:
                begin = self.rank * sw.shard_numel
                out = full[begin: begin + sw.shard_numel]
            out = out.div_(self.world_size)
            if sw.param.grad is None:
                sw.param.grad = out.clone() if self._reduce_scatter_fallback else out
            else:
                sw.param.grad.add_(out)
        for work, flat, grads in reductions:
            work.wait()
            flat.div_(self.world_size)
            for grad, average in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(average)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name as in the original module's named_parameters(): full float32 tensor}; a collective."""
        result = {}
        for name, p in self.module.named_parameters():
            sw = self._shard_of.get(id(p))
            if sw is None:
                result[name] = p.detach().float().clone()
                continue
            flat = torch.empty(sw.padded_numel, dtype=torch.float32, device=p.device)
            _all_gather_flat(flat, p.detach())
            result[name] = flat[: sw.numel].view(sw.shape).clone()
        return result

    @property
    def sharded_parameter_names(self) -> list[str]:
        """Names (first use) of the sharded weights, in registration order."""
        return [sw.name for sw in self._weights.values()]

    def reset_counters(self) -> None:
        self.num_gathers = 0
        self.num_reduce_scatters = 0
        self.num_all_reduces = 0
        self.max_live_gathered = self.live_gathered

    def gathered_storages_alive(self) -> int:
        """How many gathered full-weight buffers are still allocated (held by anyone, autograd included)."""
        self._gather_storages = [ref for ref in self._gather_storages if not ref.expired()]
        return len(self._gather_storages)

    # ------------------------------------------------------------------ gathers
    def _start_gather(self, sw: _ShardedWeight) -> None:
        if sw.gathered is not None:
            return
        shard = sw.param.detach().to(self._gather_dtype)
        sw.gathered = torch.empty(sw.padded_numel, dtype=self._gather_dtype, device=shard.device)
        sw.work = _all_gather_flat(sw.gathered, shard, async_op=True)
        self.num_gathers += 1
        self.live_gathered += 1
        self.max_live_gathered = max(self.max_live_gathered, self.live_gathered)
        # Weak references for gathered_storages_alive(); expired ones are dropped as new ones come, so the
        # list stays as long as the gathers actually alive (each ref pins a small C++ object).
        if len(self._gather_storages) >= 64:
            self._gather_storages = [ref for ref in self._gather_storages if not ref.expired()]
        self._gather_storages.append(StorageWeakRef(sw.gathered.untyped_storage()))

    def _wait_gather(self, sw: _ShardedWeight) -> torch.Tensor:
        self._start_gather(sw)
        if sw.work is not None:
            sw.work.wait()
            sw.work = None
        return sw.gathered

    def _release(self, sw: _ShardedWeight) -> None:
        if sw.gathered is None:
            return
        if sw.work is not None:  # never drop a buffer a collective is still writing
            sw.work.wait()
            sw.work = None
        sw.gathered = None
        self.live_gathered -= 1

    def _release_all(self) -> None:
        for sw in self._weights.values():
            self._release(sw)

    # ------------------------------------------------------------------ forward of one sharded layer
    def _run_sharded(self, module: nn.Module, sw: _ShardedWeight, forward: Callable,
                     args: tuple, kwargs: dict) -> Any:
        calls = self._calls
        k = len(calls) if calls is not None else None
        plan = self._fwd_plan
        if k is not None and self._plan_ok and k < len(plan) and plan[k] is sw:
            for nxt in plan[k: k + self.prefetch_depth + 1]:
                self._start_gather(nxt)
        else:
            self._plan_ok = False
        # Outside FSDP.forward (e.g. an activation-checkpoint recomputation in backward) a weight that is already
        # gathered belongs to the backward's prefetch: use it and leave it for the backward.
        keep = calls is None and sw.gathered is not None
        flat = self._wait_gather(sw)
        full = flat[: sw.numel].view(sw.shape)

        if self.compute_dtype is not None:
            args = tuple(_cast(a, self.compute_dtype) for a in args)
            kwargs = {key: _cast(v, self.compute_dtype) for key, v in kwargs.items()}
        call = _Call(sw)
        track = torch.is_grad_enabled()
        weight = _GatheredWeight.apply(sw.param, full, self, call) if track and sw.param.requires_grad else full
        # The hooks outlive the call (autograd keeps them with every saved tensor): capture no tensor here.
        storage_ptr, device = flat.untyped_storage().data_ptr(), flat.device
        # Autograd applies only the innermost hooks: hand the other saved tensors to the enclosing pair.
        outer = _top_saved_tensors_hooks(False)

        def pack(t: torch.Tensor) -> Any:
            if t.device == device and _storage_ptr(t) == storage_ptr:
                call.needs_weight = True
                return _SavedWeightView(call, t)
            return t if outer is None else _OuterPacked(outer[0](t), outer[1])

        # The layer's other parameters (a replicated bias) compute in compute_dtype too; autograd casts
        # their gradients back to fp32.
        originals = {name: p for name, p in module._parameters.items()
                     if name != "weight" and p is not None and self.compute_dtype is not None
                     and p.is_floating_point() and p.dtype != self.compute_dtype}
        try:
            module._parameters["weight"] = weight
            for name, p in originals.items():
                module._parameters[name] = p.to(self.compute_dtype)
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                out = forward(*args, **kwargs)
        finally:
            module._parameters["weight"] = sw.param
            module._parameters.update(originals)
        if calls is not None:
            calls.append(call)
        if not keep and not (calls is not None and self._plan_ok and sw in plan[k + 1: k + 1 + self.prefetch_depth]):
            self._release(sw)
        if track:
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, call=call: self._pre_backward(call))
        return out

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, call: _Call) -> None:
        """Runs when the gradient of a sharded call's output is ready: gather its weight and prefetch."""
        if not self._backward_callback_queued:
            # Flag only once queued: queue_callback raises outside a backward (a saved weight unpacked by hand)
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
            self._backward_callback_queued = True
        if not call.needs_weight:
            return
        if call.plan is None:  # made outside FSDP.forward: gather on demand
            self._start_gather(call.weight)
            return
        for nxt in call.plan[call.position: call.position + self.prefetch_depth + 1]:
            self._start_gather(nxt.weight)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _OuterPacked):
            return saved.unpack(saved.packed)
        if not isinstance(saved, _SavedWeightView):
            return saved
        self._pre_backward(saved.call)  # idempotent; covers a backward that skipped the output hook
        flat = self._wait_gather(saved.call.weight)
        return flat.as_strided(saved.size, saved.stride, saved.offset)

    def _on_weight_grad(self, call: _Call, grad_full: torch.Tensor) -> None:
        """dW of one call is ready (its layer's backward is done): free the weight, reduce-scatter dW."""
        sw = call.weight
        later = call.plan[call.position + 1: call.position + 1 + self.prefetch_depth] if call.plan else []
        if not any(c.weight is sw for c in later):
            self._release(sw)
        if grad_full.dtype == torch.float32 and sw.numel == sw.padded_numel:
            full = grad_full.reshape(-1)  # autograd no longer needs this buffer: reduce it as it is
        else:  # fp32 gradients even when computed in low precision; zeros in the padding
            full = torch.empty(sw.padded_numel, dtype=torch.float32, device=grad_full.device)
            full[: sw.numel].copy_(grad_full.reshape(-1))
            full[sw.numel:].zero_()
        if self._reduce_scatter_fallback:
            out = full  # all-reduce everything; finish_gradient_synchronization keeps this rank's slice
            work = dist.all_reduce(full, async_op=True)
        else:
            out = torch.empty(sw.shard_numel, dtype=torch.float32, device=grad_full.device)
            work = _reduce_scatter_flat(out, full, async_op=True)
        self.num_reduce_scatters += 1
        self._pending_rs.append((work, sw, out, full))

    def _on_replicated_grad(self, p: nn.Parameter) -> None:
        self._replicated_dirty.add(id(p))  # reduced in finish_gradient_synchronization

    def _post_backward(self) -> None:
        self._backward_callback_queued = False
        self._release_all()


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, functional)
        return None


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
