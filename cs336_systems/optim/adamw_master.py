"""AdamW with float32 master weights, for a model that computes with bf16 weights.

Under bf16 autocast a model with float32 weights pays twice per step for every GEMM weight: the forward casts it
to bf16 (4 bytes read, 2 written) and the backward casts the bf16 weight gradient back to float32 (2 read,
4 written).  The values the GEMMs see are the same bf16 roundings either way.  `AdamWMaster` keeps the
float32 copy itself and lets the model hold the bf16 one:

  * at construction, each of ``compute_params`` (float32) hands its float32 storage to the optimizer's state
    as its master, and the parameter itself is given a ``compute_dtype`` copy;
  * autocast then finds the weight already in bf16 (no cast), and autograd produces its gradient in bf16
    (no cast back): the value autocast's GEMM produced before its cast to float32;
  * `step` runs one fused kernel per tensor (`adamw_kernel`): it reads the float32 master, the bf16 gradient
    and the two float32 moments, and writes the master, the moments and the master rounded to bf16 into the
    parameter; 28 bytes an element, the same as torch's fused AdamW on float32 parameters.

Parameters not in ``compute_params`` (embeddings, norm gains: not GEMM operands, and kept float32 so the
residual stream and the norms keep their precision) are their own masters and are updated by the same kernel
without the bf16 write.  The update is torch's AdamW (decoupled weight decay, bias-corrected moments), so
one step matches `torch.optim.AdamW` on the float32 masters with the bf16 gradients upcast, to float32
rounding (tests/optim/test_adamw_master.py).

What changes against autocast over float32 weights: nothing in the values of one step from the same masters.
Gradient accumulation over several backward passes would sum in bf16; step after each backward or keep the
default (float32 parameters and `torch.optim.AdamW`) when accumulating.  The model must run under autocast:
its bf16 weights meet float32 activations (the embedding's output, the norms) that autocast casts.

Usage::

    model = build("2.7B", device="cuda")  # float32
    opt = AdamWMaster(model.parameters(), lr=3e-4, compute_params=linear_weights(model))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()

``impl``: "triton" (the kernel; CUDA tensors, or CPU ones under TRITON_INTERPRET=1), "torch" (the same update
in PyTorch ops, `adamw_update_reference`, any device), or "auto" (the kernel on CUDA, PyTorch ops elsewhere).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from itertools import chain

import torch
from torch import nn

IMPLS = ("auto", "triton", "torch")
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weight of every nn.Linear in ``model``: the GEMM operands, the parameters worth holding in bf16."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def hold_in(params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
    """Cast each parameter (and its gradient, if any) to ``dtype`` in place: the module keeps the same
    Parameter objects, now of ``dtype``."""
    for p in params:
        p.data = p.data.to(dtype)
        if p.grad is not None:
            p.grad = p.grad.to(dtype)


def adamw_update_reference(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    compute: torch.Tensor | None, *, decay: float, beta1: float, beta2: float, step_size: float,
    sqrt_bias2: float, eps: float,
) -> None:
    """`adamw_kernel.adamw_update` in PyTorch ops (same arguments, same order of operations), in place."""
    g = grad.to(torch.float32)
    master.mul_(decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / sqrt_bias2).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if compute is not None:
        compute.copy_(master)


def _check_non_negative(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")


class AdamWMaster(torch.optim.Optimizer):
    """AdamW over float32 masters; ``compute_params`` are held by the model in ``compute_dtype`` (module docstring).

    lr, betas, eps, weight_decay: as `torch.optim.AdamW` (same defaults).  ``state[p]`` holds "step" (an int),
    "exp_avg" and "exp_avg_sq" (float32, from the first step) and, for a compute parameter, "master" (float32).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        compute_params: Iterable[nn.Parameter] = (),
        compute_dtype: torch.dtype = torch.bfloat16,
        impl: str = "auto",
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            _check_non_negative(name, value)
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.impl = impl
        self.compute_dtype = compute_dtype
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        for p in dict.fromkeys(compute_params):  # a parameter named twice is cast once
            if id(p) not in owned:
                raise ValueError("compute_params must be parameters this optimizer updates; got one of shape "
                                 f"{tuple(p.shape)} that is not in params")
            if p.dtype != torch.float32:
                raise ValueError(f"compute_params must be float32 when the optimizer is built (their float32 "
                                 f"storage becomes the master); got one of dtype {p.dtype} and shape {tuple(p.shape)}")
            # The parameter's own float32 storage becomes the master and the parameter gets a new bf16 one:
            # construction holds the float32 weights and their bf16 copies (19 GiB at 2.7B), not two float32
            # copies (25 GiB) of which one is freed.
            self.state[p]["master"] = p.data if p.data.is_contiguous() else p.data.contiguous()
            hold_in([p], compute_dtype)
        for group in self.param_groups:
            for p in group["params"]:
                if "master" not in self.state[p] and p.dtype != torch.float32:
                    raise ValueError(f"params not in compute_params must be float32 (they are their own masters); "
                                     f"got one of dtype {p.dtype} and shape {tuple(p.shape)}")

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 weights of parameter ``p``: its master, or ``p`` itself if it is not a compute parameter."""
        return self.state[p].get("master", p)

    def _use_triton(self, tensors: list[torch.Tensor]) -> bool:
        if self.impl == "torch":
            return False
        on_cuda = all(t.is_cuda for t in tensors)
        if self.impl == "auto":
            return on_cuda
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for the CPU interpreter; got "
                             f"tensors on {sorted({str(t.device) for t in tensors})}")
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("AdamWMaster does not support sparse gradients")
        state = self.state[p]
        master = state.get("master", p)
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = state["step"]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        compute = p if "master" in state else None
        args = dict(decay=1.0 - lr * group["weight_decay"], beta1=beta1, beta2=beta2,
                    step_size=lr / (1.0 - beta1**t), eps=group["eps"])
        sqrt_bias2 = math.sqrt(1.0 - beta2**t)
        tensors = [master, grad, state["exp_avg"], state["exp_avg_sq"]] + ([compute] if compute is not None else [])
        if self._use_triton(tensors) and all(x.is_contiguous() for x in tensors[:1] + tensors[2:]):
            from cs336_systems.optim import adamw_kernel  # imports Triton

            adamw_kernel.adamw_update(master, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], compute,
                                      sqrt_bias2=sqrt_bias2, **args)
        else:  # PyTorch ops; also a non-contiguous parameter, which the flat kernel cannot index
            adamw_update_reference(master, grad, state["exp_avg"], state["exp_avg_sq"], compute,
                                   sqrt_bias2=sqrt_bias2, **args)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader casts floating-point state to each parameter's dtype, which would round the float32
        # masters and moments of a bf16 parameter; put the saved float32 tensors back (pairing saved and
        # current parameters in group order, as torch does).
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)
