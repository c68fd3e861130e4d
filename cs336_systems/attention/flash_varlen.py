"""Variable-length (packed) FlashAttention in Triton: documents packed into one row, attention within each.

    flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False) -> o
    q, o: (total_q, H, d)   k, v: (total_k, H_kv, d), H_kv dividing H (grouped-query attention)
    cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 on q's device, 0 = cu[0] <= cu[1] <= ... <= cu[B] = total
    max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's query / key count

FlashAttention-2's convention: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and
attend to its keys only; an empty sequence (no queries) is allowed, a sequence with queries and no keys is
not.  Causal masking is aligned at each sequence's first token, as the dense path (query i of a sequence
sees its keys j <= i).  d a multiple of 8 from 8 to 256; float32, bfloat16, float16 (as the dense path: no
bfloat16 under Triton's interpreter).  Forward and backward are the portable kernels of
`kernels.portable.varlen`; both are `torch.library` operators (cs336::flash_attn_varlen_fwd / _bwd, with
fake kernels), so `torch.compile(fullgraph=True)` traces a call.

Eager calls check the offsets' values (increasing from 0, ending at the token count, within the max
lengths), which reads them on the host: a synchronization that leaves the GPU idle while the host launches
what follows.  A pair of offsets that passed is remembered (`_CHECKED`: the tensors, weakly, with their
version counters and the sizes they were checked against), so a later call with the same tensors, unchanged,
skips the read: a training loop that packs each batch's offsets once and runs several layers on them reads
them once, not once a layer.  An in-place change bumps a tensor's version and is checked again.  Traced calls
check shapes, dtypes and devices only.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from cs336_systems.attention.checks import dims_text
from cs336_systems.attention.flash_replays import KERNELS_INTERPRETED
from cs336_systems.attention.kernels.portable import varlen
from cs336_systems.attention.kernels.portable.autotune import interpreter_active
from cs336_systems.attention.kernels.portable.configs import HEAD_DIMS

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_offsets(name: str, cu: torch.Tensor, total: int, max_len: int, max_name: str) -> list[int]:
    """The offsets as a list, or ValueError naming ``name`` (or ``max_name``) and what is wrong."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {values[0]} ({name} = {values[:8]}...)")
    steps = [b - a for a, b in zip(values, values[1:])]
    if any(s < 0 for s in steps):
        at = next(i for i, s in enumerate(steps) if s < 0)
        raise ValueError(f"{name} must not decrease; {name}[{at + 1}] = {values[at + 1]} < {name}[{at}] = {values[at]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the token count {total}; it ends at {values[-1]}")
    if steps and max(steps) > max_len:
        raise ValueError(f"{max_name} = {max_len} is below the longest sequence's {max(steps)} tokens")
    return steps


def _validate(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, check_values: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a (tokens, heads, head_dim) tensor; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have one head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k's heads ({k.shape[1]}) must divide q's ({q.shape[1]}) (grouped-query attention)")
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"flash_attention_varlen supports head dims that are {dims_text(HEAD_DIMS)}; got d={d}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of float32, bfloat16, float16; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not q.is_cuda and not (q.device.type == "cpu" and interpreter_active()):
        raise ValueError(f"flash_attention_varlen needs CUDA tensors (q is on {q.device}); on CPU it runs only under "
                         "the Triton interpreter (TRITON_INTERPRET=1 before importing cs336_systems.attention)")
    if q.dtype is torch.bfloat16 and (KERNELS_INTERPRETED or not q.is_cuda):
        raise ValueError("flash_attention_varlen cannot compute bfloat16 under Triton's interpreter (its bf16 "
                         "tl.dot is wrong); use float32 or float16 there")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor of B + 1 offsets; got "
                             f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__} "
                             f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else ''}".rstrip())
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {cu.device}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (B + 1); got {cu_q.numel()} and "
                         f"{cu_k.numel()}")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        # (a traced call may pass them as SymInts: their values are checked when the op runs eagerly)
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or (isinstance(value, int)
                                                                                     and value < 0):
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    if is_causal is not True and is_causal is not False:
        raise ValueError(f"is_causal must be a bool (True or False), got {is_causal!r}")
    if check_values:
        key = (id(cu_q), cu_q._version, id(cu_k), cu_k._version, q.shape[0], k.shape[0], max_q, max_k)
        refs = _CHECKED.get(key)
        if refs is not None and refs[0]() is cu_q and refs[1]() is cu_k:
            return
        n_q = _check_offsets("cu_seqlens_q", cu_q, q.shape[0], max_q, "max_seqlen_q")
        n_k = _check_offsets("cu_seqlens_k", cu_k, k.shape[0], max_k, "max_seqlen_k")
        empty = [b for b, (a, c) in enumerate(zip(n_q, n_k)) if a and not c]
        if empty:
            raise ValueError(f"sequence {empty[0]} has {n_q[empty[0]]} queries and no keys (cu_seqlens_k); a query "
                             "must see at least one key")
        _CHECKED[key] = (weakref.ref(cu_q), weakref.ref(cu_k))
        while len(_CHECKED) > CHECKED_PAIRS:
            _CHECKED.popitem(last=False)


# Offsets that passed `_validate`'s value checks: (ids and versions of cu_q and cu_k, the sizes they were checked
# against) -> weak references to both tensors (an id can be reused once a tensor is freed: the references tell).
CHECKED_PAIRS = 64
_CHECKED: OrderedDict[tuple, tuple[weakref.ref, weakref.ref]] = OrderedDict()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


_LIBRARY = torch.library.Library("cs336", "FRAGMENT")
_LIBRARY.define("flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int max_q, "
                "int max_k, bool is_causal) -> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.define("flash_attn_varlen_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor cu_q, "
                "Tensor cu_k, int max_q, int max_k, bool is_causal) -> (Tensor, Tensor, Tensor)",
                tags=(torch.Tag.pt2_compliant_tag,))


def _fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
    return varlen.forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal)


def _bwd(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, is_causal):
    return varlen.backward(q, k, v, o, lse, _unit_last(do), cu_q, cu_k, max_q, max_k, is_causal)


for _dispatch_key in ("CUDA", "CPU"):
    _LIBRARY.impl("flash_attn_varlen_fwd", _fwd, _dispatch_key)
    _LIBRARY.impl("flash_attn_varlen_bwd", _bwd, _dispatch_key)


@torch.library.register_fake("cs336::flash_attn_varlen_fwd", lib=_LIBRARY)
def _fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.register_fake("cs336::flash_attn_varlen_bwd", lib=_LIBRARY)
def _bwd_fake(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttentionVarlen(torch.autograd.Function):
    """apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal) -> o (module
    docstring); inputs checked by `flash_attention_varlen`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
        o, lse = torch.ops.cs336.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, is_causal)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and grad_out.requires_grad:
            raise RuntimeError("flash_attention_varlen does not support double backward")
        dq, dk, dv = torch.ops.cs336.flash_attn_varlen_bwd(q, k, v, o, lse, grad_out, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           is_causal: bool = False) -> torch.Tensor:
    """Attention within each packed sequence (module docstring): o (total_q, H, d) like q."""
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, check_values=eager)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    return FlashAttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal)
