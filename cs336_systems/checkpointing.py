"""Activation-checkpointing policies for a stack of residual blocks (x_{i+1} = block_i(x_i, ...)).

A policy splits the N blocks into *segments* of consecutive blocks.  Each segment runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward keeps only the segment's input
(its boundary activation) and drops every tensor the blocks would have saved for backward; the backward
recomputes the segment's forward once, when it first needs one of those tensors, and then runs the segment's
backward on the recomputed tensors.  Cost: one extra forward of every checkpointed block (~+33% FLOPs of
forward + backward, whatever the segmentation).  Activation memory, in units of one block's saved tensors
``A`` and one boundary tensor ``b`` (B*T*d elements, ``A`` is many times ``b``):

    policy      spec        segments of N blocks                    after forward     peak in backward
    none        "none"      none (nothing recomputed)               N*A               N*A
    every-k     "every-<k>" [0,k), [k,2k), ... (last may be shorter) ceil(N/k)*b       ceil(N/k)*b + k*A
    sqrt        "sqrt"      ceil(N/m) segments, m = ceil(sqrt(N)),   ~sqrt(N)*b        ~sqrt(N)*(b + A)
                            lengths differing by at most one (longest first)

    nested      "nested"    the sqrt segments, and inside each       ~sqrt(N)*b        ~2 sqrt(N)*b + A
                            segment every block checkpointed again

"nested" is two-level checkpointing: the forward keeps only the outer boundaries, as "sqrt"; the backward
recomputes one outer segment keeping only its block inputs (inner checkpoints), then recomputes each block
once more just before its own backward, so at most one block's saved tensors ``A`` are alive at a time.
Cost: two extra forwards of every block instead of one (non-reentrant checkpoints nest).

"every-1" is per-block checkpointing (the usual "full activation checkpointing"); "every-N" (or more) is one
segment: only the stack's input is kept and the whole stack is recomputed.  "sqrt" is Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost": with both kept boundaries and the recomputed segment counted
in one unit, segments + longest segment is minimised; m = ceil(sqrt(N)) attains the minimum ceil(2 sqrt(N)) of
ceil(N/k) + k, and balancing the lengths never makes the longest segment longer.

Non-reentrant checkpointing is used because it works with autocast (the recomputation re-enters the autocast
state of the forward), with keyword and non-tensor arguments, with tensor hooks and with inputs that do not
require grad, and it lets ``torch.autograd.grad`` / partial backwards work.  RNG state is not preserved by
default: the blocks must be deterministic (cs336_systems.model has no dropout); pass ``preserve_rng_state=True``
to `run_blocks` for stochastic blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointPolicy", "POLICY_FORMS", "run_blocks"]

POLICY_FORMS = ("none", "every-<k>", "sqrt", "nested")
_EVERY = re.compile(r"every-([1-9][0-9]*)")


@dataclass(frozen=True)
class CheckpointPolicy:
    """kind: "none" | "every" | "sqrt" | "nested"; k: the segment length for "every" (a positive int), else None."""

    kind: str = "none"
    k: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("none", "every", "sqrt", "nested"):
            raise ValueError(f"checkpoint policy kind must be 'none', 'every', 'sqrt' or 'nested', got {self.kind!r}")
        if self.kind == "every":
            if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k <= 0:
                raise ValueError(f"checkpoint policy 'every' needs a positive integer k, got k={self.k!r}")
        elif self.k is not None:
            raise ValueError(f"checkpoint policy {self.kind!r} takes no k, got k={self.k!r}")

    @classmethod
    def parse(cls, spec: "str | CheckpointPolicy") -> "CheckpointPolicy":
        """"none" | "every-<k>" (k a positive integer, no sign or leading zeros) | "sqrt" | "nested", or a policy."""
        if isinstance(spec, CheckpointPolicy):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"checkpoint must be a string ({', '.join(POLICY_FORMS)}) or a CheckpointPolicy, "
                            f"got {type(spec).__name__} {spec!r}")
        if spec in ("none", "sqrt", "nested"):
            return cls(spec)
        match = _EVERY.fullmatch(spec)
        if match is None:
            raise ValueError(f"checkpoint must be one of {', '.join(POLICY_FORMS)} (k a positive integer), "
                             f"got {spec!r}")
        return cls("every", int(match.group(1)))

    def __str__(self) -> str:
        return f"every-{self.k}" if self.kind == "every" else self.kind

    def segments(self, n_blocks: int) -> tuple[range, ...]:
        """The checkpointed segments of ``n_blocks`` blocks as ranges of block indices, in order.

        They partition range(n_blocks) into consecutive runs; "none" checkpoints nothing and returns ().
        "nested" returns its outer segments (the same as "sqrt"); each of their blocks is checkpointed again.
        """
        if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or n_blocks < 0:
            raise ValueError(f"n_blocks must be a non-negative integer, got {n_blocks!r}")
        if self.kind == "none" or n_blocks == 0:
            return ()
        if self.kind == "every":
            return tuple(range(i, min(i + self.k, n_blocks)) for i in range(0, n_blocks, self.k))
        m = math.isqrt(n_blocks - 1) + 1  # ceil(sqrt(N)): the segment length minimising ceil(N/m) + m
        count = -(-n_blocks // m)
        base, extra = divmod(n_blocks, count)  # balanced: `extra` segments of base+1, then base
        bounds = [0]
        for i in range(count):
            bounds.append(bounds[-1] + base + (i < extra))
        return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


def _run_segment(blocks: tuple[nn.Module, ...], x: torch.Tensor, *args: Any) -> torch.Tensor:
    for block in blocks:
        x = block(x, *args)
    return x


def _run_segment_per_block(blocks: tuple[nn.Module, ...], x: torch.Tensor, preserve_rng_state: bool,
                           *args: Any) -> torch.Tensor:
    """The inner level of "nested": every block of the segment under its own checkpoint."""
    for block in blocks:
        x = checkpoint(block, x, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return x


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, *args: Any,
               policy: "CheckpointPolicy | str" = "none", preserve_rng_state: bool = False) -> torch.Tensor:
    """x -> blocks[-1](... blocks[0](x, *args) ..., *args), checkpointed by ``policy`` (see module docstring).

    x: the stack's input, e.g. (B, T, d); ``args`` (e.g. RoPE positions (T,)) go unchanged to every block.
    Without autograd recording (``torch.no_grad()``, inference mode) nothing would be saved anyway, so the
    blocks run plainly.
    """
    policy = CheckpointPolicy.parse(policy)
    blocks = tuple(blocks)
    if policy.kind == "none" or not torch.is_grad_enabled():
        return _run_segment(blocks, x, *args)
    for seg in policy.segments(len(blocks)):
        if policy.kind == "nested":
            x = checkpoint(_run_segment_per_block, blocks[seg.start: seg.stop], x, preserve_rng_state, *args,
                           use_reentrant=False, preserve_rng_state=preserve_rng_state)
        else:
            x = checkpoint(_run_segment, blocks[seg.start: seg.stop], x, *args,
                           use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return x
