"""FlashAttention-2 in Triton: the autograd.Function and the registry's entry (`flash_attention`).

    FlashAttentionTriton.apply(q, k, v, is_causal=False) -> o
    q: (..., Nq, d)   k, v: (..., Nk, d)   o: (..., Nq, d)   d a multiple of 8, 8 <= d <= 256

Layouts: the kernels address a slice as z * stride_z + h * stride_h with a row stride, so (Z, H, N, d)
inputs with any strides but a unit one on d are read in place (a head-major view of token-major
(B, N, H, d) memory, as the model passes, costs no copy), and O, dQ, dK, dV come back in the layout of
q, k, v.  The portable kernels load unmasked K/V tiles through TMA descriptors only for contiguous K and V (the
Hopper kernels below take rank-4 descriptors over strided views).

Grouped-query attention: k and v may have fewer heads (dim -3) than q, Hkv dividing Hq; query head h reads
K/V head h // (Hq // Hkv) without K/V being repeated in memory, and dK, dV sum over each group's query heads
inside the dK/dV kernel (no atomics).  Head dims that are not a power of two run in the next power-of-two
register tile with the padding columns masked, or in two power-of-two tiles side by side where that saves columns
(80 = 64 + 16, 96 = 32 + 64; `kernels.portable.configs.d_tiles`): none by default or with CS336_FLASH_SPLIT_D=0, every
kernel with CS336_FLASH_SPLIT_D=1 (experimental: the split kernels fault under load on Hopper).

Forward: one fused kernel (grid: query tiles x batch*heads) with an online softmax over key tiles;
saves Q, K, V, O and L = logsumexp(Q K^T / sqrt(d)) (shape q.shape[:-1], float32).
Backward: a dQ kernel (Q, dO resident, loop over key tiles) that first computes D = rowsum(O * dO) for its
query rows and stores it, then a dK/dV kernel (K, V resident, loop over query tiles) that reads D: two
launches, every output tile has exactly one writer, no atomics.

On Hopper (compute capability 9.x, Triton 3.6, bf16/fp16) each launch may instead be a Gluon kernel with
asynchronous warpgroup MMAs (`kernels/hopper`: forward, forward_ws, dq, dkdv), or
the whole backward one fused Gluon pass (`kernels/hopper/backward`: five tile products instead of seven, dQ
summed in float32 by TMA reductions, so dQ is not bitwise reproducible run to run).  Which kernels run is
decided in one place, `cs336_systems.attention.plan.plan` (its table `RULES` holds every size rule with its
reason and measurement; `cs336-flash-autotune --explain B,H,N,d` prints the plan for a shape), from the
call's sizes, the device and the options (`plan.FlashOptions`, given to `flash_attention`; the
``CS336_FLASH_*`` switches of `cs336_systems.switches` override them, for debugging).

Under tracing (`torch.compile(FlashAttentionTriton.apply, fullgraph=True)`, AOTAutograd, a dispatch mode)
the Function calls two `torch.library.triton_op`s (cs336::flash_attn_fwd_inductor / _bwd_inductor), whose
bodies run as plain Python while the graph is traced and ask the plan for the traced path:
  * "triton_op": the portable kernels, launched through `wrap_triton` with pointer loads: inductor traces
    them into its graph and launches them with its own launcher, so a call pays no custom-op dispatch or
    Triton JIT binding (the models' short sequences);
  * "custom_op": the opaque operators cs336::flash_attn_fwd / _bwd (a `torch.library.Library` fragment with
    fake (shape-only) kernels), which plan each call on its concrete sizes and launch what an eager call
    launches: where a Gluon kernel runs or the portable configuration wants TMA descriptors (torch 2.11
    cannot trace host-side descriptors inside a `triton_op`), under the interpreter, and wherever the
    traced sizes are symbolic (automatic dynamic shapes after a shape change, ``dynamic=True``,
    ``mark_dynamic``): one graph then serves every size, each call with the kernels of its size.
    The price is the operators' dispatch and Python on the host, not device time
    (docs/flash-attention-experiments.md, Sections 3, 6, 13 and 14).
An eager call on plain tensors (nothing tracing) launches the same kernels directly, skipping any
dispatch: at small sizes that dispatch is most of the call.  From the second eager call of a signature
(shapes, strides, dtypes, device, ``is_causal``, input alignment, switches) on, its kernels'
launches are replayed as the first call recorded them (`flash_replays`, `kernels/replay`): no validation, no
configuration lookup, no launcher Python and no Triton JIT binding, only the output allocations and one
launcher call per kernel (Gluon kernels and TMA descriptors included: a replay rebuilds each descriptor on
the new tensor).  Calls that take a workspace (key or group splits) launch the ordinary way.  The custom
ops replay the same way when a compiled graph runs them (their tensors are plain then), under signatures
of their own.  ``CS336_FLASH_REPLAY=0`` turns replays off.
The registry's entry, `flash_attention`, is ``FlashAttentionTriton.apply`` except for eager calls that record no
graph (``torch.no_grad()``, or no input requiring grad): those skip the autograd.Function and its context.
Tile configurations per kernel come from `kernels.portable.autotune.select` (autotune cache, the
H100-measured table in `kernels.portable.configs`, or a default); launchers live in `kernels.portable.launch`.
One call's launches (plan, record, replay) are `flash_calls`'; the torch.library operators are `flash_ops`'.

Double backward (``create_graph=True`` through this op) raises a RuntimeError, for eager calls and for calls
under a dispatch mode (under torch.compile, AOTAutograd rejects double backward itself): the kernels'
gradients carry no graph.

On a CPU tensor the kernels only run under Triton's interpreter (TRITON_INTERPRET=1 set before this
module is imported); otherwise a ValueError says so.  The interpreter's bf16 ``tl.dot`` is wrong (errors of
~1e8), so bfloat16 inputs under the interpreter are refused with a ValueError; float32 and float16 run there.
Empty problems: no queries or an empty batch give an empty output (and zero gradients for K and V); queries
with no keys (Nk = 0) are refused; ``is_causal`` must be a bool.  float32 inputs multiply with tf32x3 dots (three
TF32 tensor-core products per fp32 product, near-fp32 accuracy, as PyTorch's fp32 mem-efficient SDPA does),
or with IEEE FMA dots under ``CS336_FLASH_FP32_DOT=ieee`` (`kernels.portable.configs.fp32_dot`); never plain TF32.
"""

from __future__ import annotations

import torch

from cs336_systems.attention import flash_calls as calls
from cs336_systems.attention import flash_ops  # registers the cs336:: operators
from cs336_systems.attention import flash_replays as replays
from cs336_systems.attention.checks import check_qkv, dims_text
from cs336_systems.attention.flash_calls import available
from cs336_systems.attention.flash_replays import KERNELS_INTERPRETED, REPLAY_ENV
from cs336_systems.attention.kernels.portable.autotune import interpreter_active
from cs336_systems.attention.kernels.portable.configs import HEAD_DIMS
from cs336_systems.attention.plan import FlashOptions

__all__ = ["FlashAttentionTriton", "KERNELS_INTERPRETED", "REPLAY_ENV", "SUPPORTED_HEAD_DIMS", "available",
           "flash_attention", "flash_attention_triton", "flash_ops"]
SUPPORTED_HEAD_DIMS = HEAD_DIMS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _eager(t: torch.Tensor) -> bool:
    """True when nothing traces this call: a plain tensor, no dynamo, no dispatch mode (make_fx, fake).

    Then the kernels are launched directly, skipping the custom-op dispatch (tens of microseconds per
    call, which is most of the time of a small attention call); otherwise the registered ops run, so
    torch.compile and AOTAutograd see opaque, traceable ops.
    """
    return type(t) is torch.Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: object) -> bool:
    """ValueError naming what flash-triton cannot take; returns True for an empty problem (no queries or an
    empty batch: nothing to launch).  Plain Python on shapes, dtypes and devices: no device work."""
    check_qkv(q, k, v, allow_gqa=True)
    if is_causal is not True and is_causal is not False:
        raise ValueError(f"is_causal must be a bool (True or False), got {is_causal!r} ({type(is_causal).__name__})")
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash-triton supports head dims that are {dims_text(SUPPORTED_HEAD_DIMS)}; got d={d} "
                         f"(q shape {tuple(q.shape)})")
    dtype = q.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"flash-triton supports float32, bfloat16, float16; got dtype {dtype}")
    on_cuda = q.is_cuda  # a CUDA tensor exists only where CUDA is available
    if not on_cuda and not (q.device.type == "cpu" and interpreter_active()):
        raise ValueError(
            f"flash-triton needs CUDA tensors (q is on {q.device}); on CPU it runs only under the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing cs336_systems.attention.flash_triton"
        )
    if dtype is torch.bfloat16 and (KERNELS_INTERPRETED or not on_cuda):
        raise ValueError(
            f"flash-triton cannot compute dtype {dtype} under Triton's interpreter (TRITON_INTERPRET=1): the "
            "interpreter's bf16 tl.dot returns wrong results; use float32 or float16 there, or a CUDA device "
            "without the interpreter")
    if not q.numel():
        return True
    if not k.shape[-2]:
        raise ValueError(f"flash-triton needs Nk >= 1 when there are queries; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return False


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, N, d) -> (Z, H, N, d) with unit stride on d, a view whenever the layout allows: the kernels
    take any Z, H and N strides, so a head-major view of a token-major (B, N, H, d) tensor, as the model
    passes, is read in place.  (N, d) -> (1, 1, N, d); (BH, N, d) -> (1, BH, N, d)."""
    if t.dim() < 4:
        t = t.view((1,) * (4 - t.dim()) + tuple(t.shape))
    elif t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _other_autodiff() -> bool:
    """Whether a derivative other than reverse-mode autograd's could be asked of this call: a forward-mode
    dual level is open (dual tensors report requires_grad=False) or a functorch transform (vmap, grad, jvp)
    is active.  Those calls go through the Function, which refuses them with their own errors instead of
    returning an output without the derivative."""
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _forward_call(q, k, v, is_causal, eager: bool, options: str = ""):
    """One forward call, the Function's and the registry entry's: (o like q, L (q.shape[:-1]), replay key,
    empty).  An eager call (`_eager`) whose signature was seen before skips validation (it passed when it was
    recorded) and launches directly, replayed or recorded; a traced call takes the registered ops, which
    plan its kernels (`flash_attn_fwd_inductor`).  ``empty``: no queries or an empty batch, an empty output
    and no launch."""
    key = replays.replay_key("fwd", is_causal, (q, k, v), options) if eager else None
    empty = False if key is not None and key in replays.recorded else _validate(q, k, v, is_causal)
    if empty:
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32), key, True
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    if eager:
        o, lse = calls.forward(q4, k4, v4, is_causal, may_tune=True, key=key, options=options)
    else:
        o, lse = torch.ops.cs336.flash_attn_fwd_inductor(q4, k4, v4, is_causal, options)
    if q.dim() != 4:
        o = o.reshape(q.shape)  # a view unless q had more than 4 dims that do not merge
        lse = lse.view(q.shape[:-1])
    return o, lse, key, False


def _options_text(options: FlashOptions | str | None) -> str:
    if options is None:
        return ""
    if isinstance(options, str):  # already `FlashOptions.text` (a constant a compiled graph can hold)
        return options
    if not isinstance(options, FlashOptions):
        raise ValueError(f"options must be a FlashOptions, its text, or None; got {options!r}")
    return options.text()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    options: FlashOptions | str | None = None) -> torch.Tensor:
    """``FlashAttentionTriton.apply(q, k, v, is_causal, options.text())`` (shapes in the module docstring): the
    registry's "flash-triton" entry.  ``options``: explicit kernel choices (`plan.FlashOptions`, or its
    `text`; the environment's ``CS336_FLASH_*`` switches override them, for debugging).

    An eager call that records no autograd graph (grad mode off, or no input that requires grad: a forward
    under ``torch.no_grad()``, as in inference and the forward benchmarks) skips the autograd.Function, whose
    context and graph bookkeeping are most of what such a call costs on the host once its launches are
    replayed (about 10 us of 35 at the models' context 512); the validation, the launches and the output are
    the Function's (`_forward_call`).  A call that records a graph, a traced call, a tensor subclass, an open
    forward-mode dual level or a functorch transform goes through the Function.
    """
    text = _options_text(options)
    if (type(k) is torch.Tensor and type(v) is torch.Tensor and _eager(q) and not _other_autodiff()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return _forward_call(q, k, v, is_causal, True, text)[0]
    return FlashAttentionTriton.apply(q, k, v, is_causal, text)


class FlashAttentionTriton(torch.autograd.Function):
    """apply(q, k, v, is_causal=False, options="") -> o; ``options``: `FlashOptions.text` ("" for defaults)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, options=""):
        o, lse, ctx.key, ctx.empty = _forward_call(q, k, v, is_causal, _eager(q), options)
        ctx.is_causal = is_causal
        ctx.options = options
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.empty:  # no query saw any key: dQ is empty, dK and dV are zero
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
        q4 = _as_4d(q)
        lse4 = lse if lse.dim() == 3 else lse.reshape(q4.shape[:-1])
        args = (q4, _as_4d(k), _as_4d(v), _as_4d(o), lse4, _as_4d(grad_out), ctx.is_causal)
        if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and any(t.requires_grad for t in (q, k, v, grad_out))):
            # create_graph=True: the kernels' results would carry no graph, so a second derivative through
            # attention would silently be zero.  Checked on every path, the registered ops' included (a
            # dispatch mode such as FlopCounterMode sends an eager call there): they have no autograd kernel.
            raise RuntimeError(
                "flash-triton does not support double backward: its backward ran with create_graph=True "
                "and its gradients would not be differentiable; use the 'naive' attention for "
                "higher-order gradients")
        if _eager(grad_out):
            key = None if ctx.key is None else replays.replay_key("bwd", ctx.is_causal, args[:4] + args[5:6], ctx.options)
            dq, dk, dv = calls.backward(*args, key=key, options=ctx.options)
        else:
            dq, dk, dv = torch.ops.cs336.flash_attn_bwd_inductor(*args, ctx.options)
        if q.dim() == 4:  # (the reshapes would return views of the same shape: ~2 us each)
            return dq, dk, dv, None, None
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                           options: FlashOptions | None = None) -> torch.Tensor:
    return FlashAttentionTriton.apply(q, k, v, is_causal, _options_text(options))
