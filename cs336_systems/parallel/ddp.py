"""Data-parallel training wrappers: four ways to average gradients across ranks.

All four share one interface (docs/distributed.md):

    ddp = DDPBucketed(model, bucket_size_mb=25)     # broadcasts rank 0's parameters and buffers
    loss = loss_fn(ddp(x_local), y_local)           # forward = model.forward
    loss.backward()
    ddp.finish_gradient_synchronization()           # afterwards every p.grad is the average over ranks
    optimizer.step()

| wrapper                 | all-reduces per step               | launched                                |
|-------------------------|------------------------------------|-----------------------------------------|
| NaiveDDP                | 1 (flags) + 1 per tensor with grad | in finish, blocking, one after another  |
| FlatDDP                 | 1 per (dtype, device)              | in finish                               |
| DDPIndividualParameters | 1 per trainable tensor + 1 (flags) | async from backward hooks (overlapped)  |
| DDPBucketed             | 1 per bucket                       | async from backward hooks (overlapped)  |

Semantics common to all (checked against single-process training and torch DDP in tests/parallel/test_ddp.py):

* Gradients are averaged.  On NCCL the all-reduce averages (ReduceOp.AVG): the division happens inside
  the reduction, not as a separate pass over every gradient after the last all-reduce, where it would
  sit on the step's critical path (8 GB read and written for the XL model in fp32).  gloo has no AVG:
  all-reduce(SUM), then divide by the world size.
* Only parameters with ``requires_grad=True`` at construction are communicated; frozen ones are
  never touched.  A parameter reachable twice (tied weights) is communicated once (``parameters()``
  de-duplicates by identity).
* Unused parameters never hang a step and behave as in torch DDP: each communicated gradient travels
  with a "had a gradient" flag (one extra element per tensor in the flat buffers, a separate flags
  all-reduce in NaiveDDP and DDPIndividualParameters).  A parameter without a gradient on every rank
  keeps ``grad=None``, so optimizers skip it exactly as in single-process training; one used on some
  ranks gets the average with zeros from the others.
* ``no_sync()``: inside it nothing is communicated (hooks are idle, finish is a no-op) and gradients
  accumulate locally; the first finish outside it averages the accumulated sums.  Micro-steps go inside
  it *before* the synchronized one: the hook-based wrappers have launched a synchronized backward's
  buckets (and dropped those gradients, or are reducing them in place) by the time it ends, so a
  no_sync() forward or backward between it and its finish raises instead of having its gradients
  overwritten (NaiveDDP and FlatDDP, which communicate only in finish, raise at such a forward too).
* A skipped finish is detected.  After a synchronized backward, the next forward pass raises RuntimeError
  naming finish_gradient_synchronization() until finish has run: an ``optimizer.step()`` in between used
  un-averaged gradients, and the replicas would drift apart silently.  The hook-based wrappers know from
  their gradient hooks; NaiveDDP and FlatDDP put one hook on the tensors their forward returns, which
  fires when backward reaches them.  Only a forward that cannot make gradients inside no_sync() (under
  ``torch.no_grad()``) is allowed in between.
* Every rank must hold the same model: construction compares the parameters' and buffers' names, shapes,
  dtypes and ``requires_grad`` across ranks (one all-gather of a digest) and raises ValueError on every
  rank, naming the ranks that differ, instead of hanging in (or corrupting) the first broadcast.
* Gradient storage (FlatDDP and DDPBucketed; NaiveDDP and DDPIndividualParameters average each
  ``p.grad`` in place, a non-contiguous one through a dense copy, and DDPIndividualParameters does so
  from the moment its hook fires, copying first a gradient whose memory another tensor references: its
  p.grad is a buffer in flight until finish).  When
  a bucket (FlatDDP: a dtype group) is launched, its gradients are copied into a fresh flat buffer
  (``_pack``) and dropped (``p.grad = None``), so each gradient's memory is free as soon as it has been
  copied.  **Between a bucket's launch and the end of finish its parameters' p.grad is None** (for the
  hook-based wrappers that is from the middle of backward on: read gradients only after finish; for
  FlatDDP the launch is inside finish).  Finish divides the all-reduced buffers in place and makes each
  ``p.grad`` a view of its slice of the buffer, shaped like the parameter (like torch DDP's
  ``gradient_as_bucket_view=True``).  So after finish the gradients of a bucket share one storage, which
  stays alive while any of them does; in-place use (optimizers, clipping, ``GradScaler.unscale_``,
  ``zero_grad(set_to_none=False)``, accumulation by the next backward or under ``no_sync()``) works as
  usual, and both ``zero_grad(set_to_none=True)`` and ``set_to_none=False`` work: the next launch copies
  whatever ``p.grad`` holds into a new buffer and drops the views.  Exception: in a bucket where some
  parameter got a gradient on no rank, the others get fresh tensors instead of views, so the unused
  parameter's slice (and the flags) are not kept alive by them; and a non-contiguous parameter gets a
  copy in its own strides (autograd's gradient layout contract), at the cost of one extra pass over it.
* Copy-out cost.  Averaging is one in-place multi-tensor division over all of the step's buffers
  (``torch._foreach_div_``): it reads and writes each gradient element once, as the former
  per-parameter ``torch.div(slice, world_size, out=p.grad)`` did, but in one host call instead of one
  per tensor and without allocating (on CUDA its kernels are launched from C++, one per ~21M elements
  or 110 tensors, so their number follows the bytes, not the tensor count).  The views are made when
  a bucket is launched (one ``unflatten_dense_tensors`` call, during backward for the hook-based
  wrappers), so finish's remaining per-parameter host work is the ``p.grad = view`` assignment.  Copy-in is one
  ``torch.cat`` and one flags fill per bucket (plus a zero fill per locally missing gradient).
* Gradients keep the parameters' dtype (fp32 master weights under bf16 autocast give fp32 grads).
  Dense gradients on one device per (dtype) group are assumed.

Collective ordering.  Collectives are matched across ranks by issue order, so the hook-based
wrappers launch buckets strictly in bucket-index order: a bucket whose gradients are all ready waits
until every earlier bucket has been launched, and finish launches whatever is left (buckets holding a
parameter that got no gradient on this rank).  Every rank therefore issues the same collectives in
the same order even when ranks use different subsets of the parameters.  Since bucket order is the
reverse of registration order (~ the order autograd produces gradients), this rarely delays a launch.

Timing hooks for benchmarks: after each ``finish_gradient_synchronization()`` the wrapper's
``last_sync`` is a `SyncStats`: host wall time spent inside finish, the number of all-reduces launched
before finish (from hooks: the overlapped ones) and inside it, and the bytes all-reduced.  For
NaiveDDP and FlatDDP ``collectives_before_finish`` is always 0.  With ``record_timing=True`` and CUDA
parameters, finish records CUDA events on the compute stream around itself: their distance is the
device time from the end of backward's kernels to the end of synchronization (the communication
backward did not hide, plus the copy-out), read lazily, with no host synchronization in the step;
on CPU/gloo the host clock is already exact because ``wait()`` blocks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.parallel.launch import check_same_across_ranks, module_signature, require_process_group

__all__ = ["SyncStats", "NaiveDDP", "FlatDDP", "DDPIndividualParameters", "DDPBucketed", "plan_buckets"]

_MB = 2**20  # bucket_size_mb counts mebibytes, as torch DDP's bucket_cap_mb does


@dataclass(frozen=True)
class SyncStats:
    """Communication of one step, recorded by finish_gradient_synchronization().

    ``finish_time_s``: the time finish took.  With CUDA events (``record_timing=True`` on CUDA) it is read
    lazily: the first read waits for the end event, so read it after the timed region, not inside it.
    """

    collectives_before_finish: int  # all-reduces launched from backward hooks (overlapped with compute)
    collectives_in_finish: int  # all-reduces launched inside finish
    bytes_all_reduced: int  # payload of all those all-reduces (flags included)
    host_time_s: float  # host wall time inside finish
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # compute stream: before / after finish

    @property
    def finish_time_s(self) -> float:
        """Device time from the end of backward's kernels to the end of synchronization (CUDA events), else
        the host time inside finish (exact on CPU/gloo, where ``wait()`` blocks)."""
        if self.events is None:
            return self.host_time_s
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


# ---------------------------------------------------------------------------------------------------
# flat buffers: grads (zeros where missing) followed by one "had a gradient" flag per tensor
# ---------------------------------------------------------------------------------------------------

def _pack(params: list[nn.Parameter]) -> torch.Tensor:
    """-> (sum(numel) + len(params),) buffer in the params' dtype: flattened grads, then 0/1 flags.

    Built with device ops only (no host -> device copy of the flags, which would block the CPU until the
    device caught up: called from backward hooks, that would stall every kernel launch behind it).
    """
    first = params[0]
    pieces = [
        p.grad.reshape(-1) if p.grad is not None
        else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        for p in params
    ]
    flags = torch.ones(len(params), dtype=first.dtype, device=first.device)
    for i, p in enumerate(params):
        if p.grad is None:
            flags[i] = 0  # a device fill, no synchronization
    return torch.cat(pieces + [flags])


def _present_flags(buffers: list[tuple[list[nn.Parameter], torch.Tensor, bool]]) -> list[list[bool]]:
    """Per buffer, which tensors had a gradient on some rank.

    ``buffers`` holds (params, all-reduced buffer, complete) where ``complete`` says every tensor had a
    gradient on this rank when the buffer was packed: then every flag is >= 1 after the all-reduce and
    nothing needs reading.  The other buffers' flags are read in one device -> host copy, so the common
    step (every gradient present) never stalls the CPU here and keeps queueing the copies and the
    optimizer behind the communication.
    """
    unknown = [(params, buf) for params, buf, complete in buffers if not complete]
    read: list[bool] = []
    if unknown:
        read = torch.cat([buf[-len(params):].float() for params, buf in unknown]).gt(0).tolist()
    out, offset = [], 0
    for params, _, complete in buffers:
        if complete:
            out.append([True] * len(params))
        else:
            out.append(read[offset:offset + len(params)])
            offset += len(params)
    return out


class _Layout:
    """A fixed list of same-dtype parameters and their place in a flat buffer (see _pack).

    ``zero_size`` lists the positions of parameters with no elements, whose views need an explicit
    reshape (``unflatten_dense_tensors`` may give them a fresh ``(0,)`` tensor).  ``strided`` lists the
    non-contiguous parameters (rare): a contiguous view would break autograd's gradient layout contract
    (grad strides = param strides; accumulating into it warns), so they get a copy in their own layout.
    """

    __slots__ = ("params", "zero_size", "strided")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.zero_size = [i for i, p in enumerate(params) if p.numel() == 0]
        self.strided = [p for p in params if not p.is_contiguous()]

    def pack_and_release(self) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        """Copy the gradients into a new buffer and drop them from the parameters.

        -> (buffer (sum numel + n,), one view of the buffer per parameter shaped like it, complete) where
        ``complete`` says every parameter had a gradient here.  Setting ``p.grad = None`` frees each
        gradient once copied (autograd does not touch it again this backward: the post-accumulate-grad
        hook runs after accumulation), so gradients and buffers do not both stay allocated.
        """
        complete = all(p.grad is not None for p in self.params)
        buf = _pack(self.params)
        for p in self.params:
            p.grad = None
        return buf, self.views(buf), complete

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``buf`` per parameter, in one C++ call (the flags at the end are not covered)."""
        views = list(torch._utils._unflatten_dense_tensors(buf, self.params))
        for i in self.zero_size:
            views[i] = views[i].view(self.params[i].shape)
        return views


def _average_into_grads(packed: list[tuple[_Layout, torch.Tensor, list[torch.Tensor], bool]],
                        divisor: int) -> None:
    """Turn all-reduced buffers (see _pack) into averaged ``p.grad`` where any rank had a gradient.

    ``divisor``: the world size after a SUM all-reduce, 1 after an AVG one (the flags, averaged, stay > 0
    exactly where some rank had a gradient).

    ``packed`` holds (layout, summed buffer, its per-parameter views, complete).  Buckets whose every
    parameter had a gradient on some rank (the common case) are divided in place, all buffers in one
    multi-tensor op, and their views become the gradients; in the others, the present slices are divided
    out of place (one more multi-tensor op) into fresh tensors, so the buffer can be freed.  Either way
    every gradient element is read once and written once.  A parameter without a gradient on every rank
    keeps ``grad=None``, as single-process training would.
    """
    presence = _present_flags([(layout.params, buf, complete) for layout, buf, _, complete in packed])
    in_place: list[torch.Tensor] = []
    params: list[nn.Parameter] = []
    grads: list[torch.Tensor] = []
    copy_params: list[nn.Parameter] = []
    copy_slices: list[torch.Tensor] = []
    for (layout, buf, views, _), present in zip(packed, presence):
        if all(present):
            in_place.append(buf)
            params.extend(layout.params)
            grads.extend(views)
        else:
            for p, view, has_grad in zip(layout.params, views, present):
                if has_grad:
                    copy_params.append(p)
                    copy_slices.append(view)
    if in_place and divisor != 1:
        torch._foreach_div_(in_place, divisor)  # the flags are divided too: harmless, already read
    if copy_slices:
        params.extend(copy_params)
        grads.extend(torch._foreach_div(copy_slices, divisor))  # out of place even for 1: frees the buffer
    for p, grad in zip(params, grads):
        p.grad = grad
    for layout, *_ in packed:
        for p in layout.strided:  # an extra copy, but only of non-contiguous parameters' gradients
            if p.grad is not None:
                p.grad = torch.empty_like(p, requires_grad=False).copy_(p.grad)


def _output_tensors(out) -> list[torch.Tensor]:
    """The tensors of a forward's output (a tensor, or tensors in tuples, lists and dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _output_tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _output_tensors(item)]
    return []


def _check_module(module: object, who: str) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    return module


class _DDPBase(nn.Module):
    """Shared machinery: broadcast at construction, forward, no_sync, counted all-reduces, timing."""

    def __init__(self, module: nn.Module, *, record_timing: bool = False) -> None:
        super().__init__()
        who = type(self).__name__
        _check_module(module, who)
        require_process_group(who)
        # Before any per-tensor collective: a different model on some rank would hang or corrupt them.
        check_same_across_ranks(who, module_signature(module))
        self.module = module
        self.world_size = dist.get_world_size()
        self.averages_in_collective = dist.get_backend() == "nccl"  # ReduceOp.AVG; see the module docstring
        # What the all-reduced gradients still have to be divided by.
        self._divisor = 1 if self.averages_in_collective else self.world_size
        self.record_timing = bool(record_timing)
        # Unique by identity (tied weights appear once), in registration order; frozen ones excluded.
        self._params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            # Gradient hooks would fire on one autograd thread per device and race on the bucket state,
            # so ranks could issue their collectives in different orders.
            raise ValueError(f"{who}: trainable parameters must live on one device, got {sorted(map(str, devices))}")
        names = {id(p): n for n, p in module.named_parameters()}
        self._name_of = {id(p): names[id(p)] for p in self._params}
        self._require_sync = True
        # NaiveDDP / FlatDDP: a synchronized backward ran through this wrapper's output since the last finish
        # (set by a hook on the output, see _watch_backward); the hook-based wrappers track their gradients.
        self._unfinished_backward = False
        self._launched = 0  # all-reduces issued since construction
        self._launched_at_last_finish = 0
        self._bytes = 0  # bytes all-reduced since construction
        self._bytes_at_last_finish = 0
        self.last_sync: SyncStats | None = None
        self._broadcast_from_rank0()

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # Frozen parameters and buffers too: every rank must start from identical state.
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(tensor.detach(), src=0)

    def forward(self, *args, **kwargs):
        """``module(*args, **kwargs)``.  Raises if the last synchronized backward was not finished: its
        gradients are not averaged yet, so an optimizer step on them would let the replicas drift apart."""
        # Inside no_sync() too (its gradients would join the unfinished ones), unless it cannot make gradients.
        # The same rule as the hook-based wrappers' forward.
        if self._unfinished_backward and (self._require_sync or torch.is_grad_enabled()):
            raise RuntimeError(self._pending_message("a forward pass"))
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._watch_backward(out)
        return out

    def _watch_backward(self, out) -> None:
        """Mark a backward through ``out`` (one hook per output tensor, fired when its gradient is computed)
        as unfinished until finish_gradient_synchronization(); held weakly, like the gradient hooks."""
        owner = weakref.ref(self)

        def mark(grad: torch.Tensor) -> None:
            wrapper = owner()
            if wrapper is not None and wrapper._require_sync:
                wrapper._unfinished_backward = True

        for t in _output_tensors(out):
            if t.requires_grad:
                t.register_hook(mark)

    def _pending_message(self, what: str) -> str:
        return (
            f"{type(self).__name__}: {what} while a synchronized backward pass's gradients have not been "
            "finished; call finish_gradient_synchronization() after that backward and before "
            "optimizer.step() (gradient-accumulation micro-steps go inside no_sync() before the synchronized "
            "one, not after it)"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no communication for backward passes (and finishes) inside."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool):
        self._launched += 1
        self._bytes += tensor.numel() * tensor.element_size()
        op = dist.ReduceOp.AVG if self.averages_in_collective else dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, async_op=async_op)

    def finish_gradient_synchronization(self) -> None:
        """Wait for (or issue) all communication of this step; afterwards p.grad holds the rank average.

        A no-op inside no_sync().  Records this step's `SyncStats` in ``last_sync``.
        """
        device = self._params[0].device if self._params else torch.device("cpu")
        events = None
        if self.record_timing and device.type == "cuda":
            # Events on the compute stream, not host synchronization: a sync here would serialize host and
            # device and so slow down exactly the host-bound steps being measured.  The start event fires
            # when backward's kernels are done (backward compute is not communication); the end event once
            # the stream has waited for every collective and the gradients are copied out.
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(torch.cuda.current_stream(device))
        launched_before = self._launched - self._launched_at_last_finish
        start_count = self._launched
        start = time.perf_counter()
        if self._require_sync:
            self._finish()
            self._unfinished_backward = False
        if events is not None:
            events[1].record(torch.cuda.current_stream(device))
        elapsed = time.perf_counter() - start
        self.last_sync = SyncStats(
            collectives_before_finish=launched_before,
            collectives_in_finish=self._launched - start_count,
            bytes_all_reduced=self._bytes - self._bytes_at_last_finish,
            host_time_s=elapsed,
            events=events,
        )
        self._launched_at_last_finish = self._launched
        self._bytes_at_last_finish = self._bytes

    def _finish(self) -> None:
        raise NotImplementedError


class NaiveDDP(_DDPBase):
    """All-reduce every parameter's gradient separately, blocking, after backward (in finish).

    One preliminary all-reduce of a (n_trainable,) flag vector tells every rank which tensors have a
    gradient on some rank, so all ranks issue the same per-tensor all-reduces: 1 + n collectives, n the
    number of tensors with a gradient on some rank.
    """

    def _finish(self) -> None:
        if not self._params:
            return
        first = self._params[0]
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.float32,
                             device=first.device)
        self._all_reduce(flags, async_op=False)
        reduced: list[tuple[nn.Parameter, torch.Tensor]] = []
        for p, any_grad in zip(self._params, (flags > 0).tolist()):
            if not any_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # used on another rank: contribute zeros
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            self._all_reduce(grad, async_op=False)
            reduced.append((p, grad))
        if reduced and self._divisor != 1:  # one multi-tensor launch instead of one division per tensor
            torch._foreach_div_([grad for _, grad in reduced], self._divisor)
        for p, grad in reduced:
            if grad is not p.grad:
                p.grad.copy_(grad)


def _group_by_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    return list(groups.values())


class FlatDDP(_DDPBase):
    """After backward, one all-reduce of all gradients flattened into a single buffer.

    Buffer layout per (dtype, device) group: (sum numel + n_tensors,) = grads then flags (see _pack).
    Mixed-dtype models get one buffer, and one all-reduce, per dtype.
    """

    def __init__(self, module: nn.Module, *, record_timing: bool = False) -> None:
        super().__init__(module, record_timing=record_timing)
        self._groups = [_Layout(group) for group in _group_by_dtype(self._params)]

    def _finish(self) -> None:
        packed, works = [], []
        for layout in self._groups:
            buf, views, complete = layout.pack_and_release()
            packed.append((layout, buf, views, complete))
            works.append(self._all_reduce(buf, async_op=True))  # overlap the dtype groups
        for work in works:
            work.wait()
        _average_into_grads(packed, self._divisor)


class _HookedBucketDDP(_DDPBase):
    """Buckets of parameters, each all-reduced asynchronously once all its gradients are accumulated.

    Per-step state: ``_waiting[b]`` counts bucket b's gradients not yet accumulated; ``_next`` is the
    first bucket not yet launched; ``_in_flight`` holds (layout, buffer, views, complete, work) of
    launched buckets (views: the buffer's per-parameter slices; complete: every gradient of the bucket
    was present on this rank when it was packed).  Launching a bucket drops its parameters' gradients
    (see the module docstring), so p.grad is None from then until finish.
    """

    def __init__(self, module: nn.Module, buckets: list[list[int]], *, record_timing: bool) -> None:
        super().__init__(module, record_timing=record_timing)
        self._buckets = [[self._params[i] for i in bucket] for bucket in buckets]
        self._layouts = [_Layout(bucket) for bucket in self._buckets]
        self._bucket_of = {id(self._params[i]): b for b, bucket in enumerate(buckets) for i in bucket}
        self._reset_step()
        # The hooks live on the parameters (C++ side, invisible to Python's cycle collector): a hook that
        # referenced the wrapper strongly would keep wrapper, model and gradients alive forever.  They
        # hold a weak reference and do nothing once the wrapper is gone.
        owner = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            wrapper = owner()
            if wrapper is not None:
                wrapper._on_grad_ready(param)

        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._name_of[id(p)] for p in bucket] for bucket in self._buckets]

    def _reset_step(self) -> None:
        self._waiting = [len(bucket) for bucket in self._buckets]
        self._ready: set[int] = set()
        self._next = 0
        self._in_flight: list[tuple[_Layout, torch.Tensor, list[torch.Tensor], bool, object]] = []

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._require_sync:
            if self._ready:
                # The synchronized backward's buckets are already launched with their gradients (and those
                # were dropped): what accumulates now would be overwritten by finish, silently.
                raise RuntimeError(self._pending_message("a backward pass inside no_sync()"))
            return  # inside no_sync(): just accumulate
        if id(param) in self._ready:
            name = self._name_of[id(param)]
            raise RuntimeError(
                f"{type(self).__name__}: parameter {name!r} received a second gradient in one step; call "
                "finish_gradient_synchronization() between backward passes, or run the earlier ones "
                "inside no_sync()"
            )
        self._ready.add(id(param))
        self._waiting[self._bucket_of[id(param)]] -= 1
        # Launch in bucket order only, so every rank issues the same collectives in the same order.
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        layout = self._layouts[b]
        buf, views, complete = layout.pack_and_release()
        self._in_flight.append((layout, buf, views, complete, self._all_reduce(buf, async_op=True)))
        self._next = b + 1

    def forward(self, *args, **kwargs):
        # Inside no_sync() too (its gradients could not be communicated), unless it cannot make gradients.
        if self._ready and (self._require_sync or torch.is_grad_enabled()):
            raise RuntimeError(self._pending_message("a forward pass"))
        return self.module(*args, **kwargs)

    def _finish(self) -> None:
        try:
            # Buckets still waiting hold a parameter that got no gradient on this rank: launch them now.
            while self._next < len(self._buckets):
                self._launch(self._next)
            for *_, work in self._in_flight:
                work.wait()
            _average_into_grads([entry[:4] for entry in self._in_flight], self._divisor)
        finally:
            self._reset_step()


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@functools.cache
def _sole_owner_refs() -> int:
    """What `_storage_refs` reads for a tensor that nothing else references (calibrated, not assumed)."""
    return _storage_refs(torch.empty(1))


def _shares_memory(t: torch.Tensor) -> bool:
    """True if any other tensor (an autograd buffer, another parameter's gradient) references ``t``'s
    memory right now.  A view's flags cannot tell: autograd detaches the gradient it keeps, and two
    ``unsqueeze`` views of one (1, N) buffer each span all of it.  Without the (private) storage use
    count, assume sharing: a copy is always safe."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return True
    return _storage_refs(t) > _sole_owner_refs()


class DDPIndividualParameters(_HookedBucketDDP):
    """One asynchronous all-reduce per gradient, launched from its post-accumulate-grad hook.

    Each trainable tensor is its own bucket, in reverse registration order (see the module docstring for
    why launches follow that order).  Unlike the flat buffers, the gradient is all-reduced in place: no
    copy and no flag per tensor (a copy-in per tensor is a pass over every gradient on the device and
    several host calls per tensor inside backward, which dominate a host-bound step).  Which tensors had
    a gradient on some rank travels instead in one (n_tensors,) flags all-reduce issued by finish; the
    flags are read on the host only by a rank that lacked some gradient.  A tensor without a gradient
    here (launched by finish) contributes zeros; a gradient whose memory another tensor references (see
    `_launch`) or that is non-contiguous is copied first.  Until finish, p.grad is the buffer being
    reduced (or the gradient that was copied): read or modify gradients only after finish.
    """

    def __init__(self, module: nn.Module, *, record_timing: bool = False) -> None:
        _check_module(module, type(self).__name__)
        n = sum(1 for p in module.parameters() if p.requires_grad)
        super().__init__(module, [[i] for i in reversed(range(n))], record_timing=record_timing)

    def _launch(self, b: int) -> None:
        (p,) = self._buckets[b]
        grad = p.grad
        if grad is None:  # no gradient on this rank (launched from finish): contribute zeros
            buf = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        elif not grad.is_contiguous() or _shares_memory(grad):
            # The collective needs dense memory it owns.  Autograd keeps an incoming gradient as p.grad
            # without copying whenever no other tensor object refers to it, also when it is a *view* of
            # memory that backward still reads (another branch of an add) or that another parameter's
            # gradient views too (``x + a.unsqueeze(0) + b.unsqueeze(0)``): reducing it in place would
            # corrupt those, so such a gradient is copied (it becomes p.grad at finish).
            buf = grad.contiguous() if not grad.is_contiguous() else grad.clone()
        else:
            buf = grad
        self._in_flight.append((p, buf, grad is not None, self._all_reduce(buf, async_op=True)))
        self._next = b + 1

    def _finish(self) -> None:
        try:
            # Buckets still waiting hold a parameter that got no gradient on this rank: launch them now.
            while self._next < len(self._buckets):
                self._launch(self._next)
            if not self._in_flight:
                return
            had = [entry[2] for entry in self._in_flight]
            device = self._in_flight[0][1].device
            complete = all(had)
            # A device fill when every gradient is here (no host -> device copy, which would wait for the
            # device); otherwise the flags are read back below anyway.
            flags = (torch.ones(len(had), dtype=torch.float32, device=device) if complete
                     else torch.tensor(had, dtype=torch.float32, device=device))
            flags_work = self._all_reduce(flags, async_op=True)
            for *_, work in self._in_flight:
                work.wait()
            flags_work.wait()
            present = had if complete else (flags > 0).tolist()
            reduced = []
            for (p, buf, _, _), anywhere in zip(self._in_flight, present):
                if anywhere:
                    reduced.append((p, buf))
                else:
                    p.grad = None  # no rank had a gradient: as in single-process training
            if reduced and self._divisor != 1:
                torch._foreach_div_([buf for _, buf in reduced], self._divisor)
            for p, buf in reduced:
                # a dense copy (non-contiguous parameter) goes back into the parameter's own strides
                p.grad = buf if buf.stride() == p.stride() else torch.empty_like(p).copy_(buf)
        finally:
            self._reset_step()


def plan_buckets(params: list[nn.Parameter], bucket_size_mb: float | None) -> list[list[int]]:
    """Greedy assignment of parameter indices to buckets of at most ``bucket_size_mb`` MiB.

    Walk the parameters in reverse registration order; a parameter joins the open bucket of its
    (dtype, device) if it still fits, otherwise it opens a new one.
    """
    cap = math.inf if bucket_size_mb is None else bucket_size_mb * _MB
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # key -> (index, bytes)
    for i in reversed(range(len(params))):
        p = params[i]
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        if key in open_bucket:
            b, used = open_bucket[key]
            if used + nbytes <= cap:
                buckets[b].append(i)
                open_bucket[key] = (b, used + nbytes)
                continue
        buckets.append([i])
        open_bucket[key] = (len(buckets) - 1, nbytes)
    return buckets


class DDPBucketed(_HookedBucketDDP):
    """Gradients grouped into buckets of at most ``bucket_size_mb`` MiB, each all-reduced asynchronously
    (one flat buffer, grads then flags) the moment its last gradient is accumulated.

    Assignment policy: trainable tensors in reverse registration order (``reversed(model.parameters())``
    ~ the order backward produces gradients), greedily: a tensor joins the current bucket of its dtype
    if the bucket's gradient bytes stay <= bucket_size_mb * 2**20, otherwise it starts a new bucket.
    Consequences: a tensor larger than the cap gets a bucket of its own (and closes the one before it);
    buckets are filled front to back, so the last bucket — the first layers' gradients, ready last —
    holds the remainder and is usually smaller; ``bucket_size_mb=None`` puts everything in one bucket
    (per dtype), which then can only be launched once backward is complete.  Buckets never mix dtypes.

    bucket_size_mb: positive number of MiB, or None for a single bucket.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None, *,
                 record_timing: bool = False) -> None:
        who = type(self).__name__
        if bucket_size_mb is not None:
            if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
                raise TypeError(f"{who}: bucket_size_mb must be a number or None, got {bucket_size_mb!r}")
            if not bucket_size_mb > 0:  # also rejects NaN
                raise ValueError(f"{who}: bucket_size_mb must be positive (or None for a single bucket), "
                                 f"got {bucket_size_mb!r}")
        _check_module(module, who)
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, plan_buckets(params, bucket_size_mb), record_timing=record_timing)
        self.bucket_size_mb = bucket_size_mb
