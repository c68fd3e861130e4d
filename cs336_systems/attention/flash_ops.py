"""flash-triton's torch.library operators: what compiled graphs and dispatch modes call.

    cs336::flash_attn_fwd(q, k, v, is_causal, options="") -> (o, lse)         opaque custom op
    cs336::flash_attn_bwd(q, k, v, o, lse, do, is_causal, options="") -> (dq, dk, dv)
    cs336::flash_attn_fwd_inductor / _bwd_inductor: `torch.library.triton_op`s that a traced call runs

Shapes as in `flash_calls` ((Z, H, N, d) views with unit stride on d).  Importing this module registers
the operators (once per process).
"""

from __future__ import annotations

import torch

from cs336_systems.attention import flash_calls as calls
from cs336_systems.attention import flash_replays as replays

def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   options: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The op cs336::flash_attn_fwd: q (Z, H, Nq, d), k, v (Z, H_kv, Nk, d), unit stride on d -> (o like q,
    L (Z, H, Nq) float32); ``options``: `FlashOptions.text`.  Its kernels are planned on the concrete sizes
    of each call (a compiled graph runs it on plain tensors, also where the graph's sizes are symbolic), and
    replayed like an eager call (`flash_replays.replay_key`), under a signature of its own ("fwd op": it
    never tunes, where an eager call may)."""
    key = replays.replay_key("fwd op", is_causal, (q, k, v), options)
    return calls.forward(q, k, v, is_causal, key=key, options=options)


def _flash_attn_fwd_fake(q, k, v, is_causal, options=""):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def flash_attn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    is_causal: bool, options: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op cs336::flash_attn_bwd, gradients of flash_attn_fwd: all tensors (Z, H, N, d) with unit stride on
    d, lse (Z, H, Nq).  Planned and replayed as flash_attn_fwd is."""
    # lse in the key too: the op's caller may pass any lse (an eager backward's is the forward's fresh output)
    key = replays.replay_key("bwd op", is_causal, (q, k, v, o, lse, do), options)
    return calls.backward(q, k, v, o, lse, do, is_causal, key=key, options=options)


def _flash_attn_bwd_fake(q, k, v, o, lse, do, is_causal, options=""):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Registered as a `torch.library.Library` fragment (schema, a kernel per device type, a fake kernel), not
# with `torch.library.custom_op`: a compiled graph calls these ops on every attention call, and custom_op's
# Python wrappers (an autograd kernel, an aliasing check of the outputs) added ~11 µs a call at the 2.7B
# shape, a third of the forward op's host time (docs/flash-attention-experiments.md, Section 13).  The ops are
# internal and not differentiable themselves (no autograd kernel): they run inside `FlashAttentionTriton`,
# whose backward calls flash_attn_bwd and refuses double backward, and compiled graphs call them with grad off.
# Outputs are fresh tensors (no aliasing, no mutation), as the schemas say; pt2_compliant_tag, as custom_op
# sets, lets them run under dynamo's only_allow_pt2_compliant_ops.  CPU: the interpreter's tensors.
# The module registers them once per process: loading its file a second time under another name fails.
_LIBRARY = torch.library.Library("cs336", "FRAGMENT")
_LIBRARY.define('flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool is_causal, str options="") -> (Tensor, Tensor)',
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.define("flash_attn_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool is_causal, "
                'str options="") -> (Tensor, Tensor, Tensor)', tags=(torch.Tag.pt2_compliant_tag,))
for _dispatch_key in ("CUDA", "CPU"):
    _LIBRARY.impl("flash_attn_fwd", flash_attn_fwd, _dispatch_key)
    _LIBRARY.impl("flash_attn_bwd", flash_attn_bwd, _dispatch_key)
torch.library.register_fake("cs336::flash_attn_fwd", _flash_attn_fwd_fake, lib=_LIBRARY)
torch.library.register_fake("cs336::flash_attn_bwd", _flash_attn_bwd_fake, lib=_LIBRARY)


# What a traced call (torch.compile, AOTAutograd, a dispatch mode) runs: `torch.library.triton_op`s whose
# bodies run as plain Python when the graph is traced (dynamo does not trace into them: sizes that are
# symbolic there are `torch.SymInt`s the plan can see).  Each asks the plan (`flash_calls.plan_call`,
# traced=True):
#   * "triton_op": the portable kernels with pointer loads, launched through `wrap_triton`, which inductor
#     traces into its own graph and launches with its generated launcher, as it launches its own kernels: no
#     custom-op dispatch and no Triton JIT argument binding per call at run time (the host cost that dominates
#     short sequences, e.g. the models at context 512); shapes, strides and configurations fixed at tracing;
#   * "custom_op": the opaque ops above, which plan on each call's concrete sizes and launch the eager path's
#     kernels, Gluon ones and TMA descriptors included (torch 2.11 cannot trace host-side descriptors inside
#     a triton_op): where a Gluon kernel runs, the portable configuration wants descriptors, the interpreter
#     runs the kernels, or the sizes are symbolic (dynamic shapes: one graph serves every size, and each call
#     still gets the kernels an eager call of its size gets; the price is the custom op's host dispatch).
@torch.library.triton_op("cs336::flash_attn_fwd_inductor", mutates_args=())
def flash_attn_fwd_inductor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                            options: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_fwd for traced calls: the portable kernels through inductor, or the custom op (see above)."""
    if calls.plan_call(q, k, is_causal, (q, k, v), options, traced=True).traced != "triton_op":
        return torch.ops.cs336.flash_attn_fwd(q, k, v, is_causal, options)
    return calls.forward(q, k, v, is_causal, wrap=torch.library.wrap_triton, tma=0, options=options)


@torch.library.triton_op("cs336::flash_attn_bwd_inductor", mutates_args=())
def flash_attn_bwd_inductor(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    is_causal: bool, options: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn_bwd for traced calls, chosen as flash_attn_fwd_inductor chooses."""
    if calls.plan_call(q, k, is_causal, (q, k, v, o, do), options, traced=True).traced != "triton_op":
        return torch.ops.cs336.flash_attn_bwd(q, k, v, o, lse, do, is_causal, options)
    return calls.backward(q, k, v, o, lse, do, is_causal, wrap=torch.library.wrap_triton, tma=0, options=options)
