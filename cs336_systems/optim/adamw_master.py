"""AdamW with float32 master weights, for a model that computes with bf16 weights.

Under bf16 autocast a model with float32 weights pays twice per step for every GEMM weight: the forward casts it
to bf16 (4 bytes read, 2 written) and the backward casts the bf16 weight gradient back to float32 (2 read,
4 written).  The values the GEMMs see are the same bf16 roundings either way.  `AdamWMaster` keeps the
float32 master itself and lets the model hold the bf16 weight:

  * at construction, each of ``compute_params`` (float32) gives its float32 values to the optimizer's state
    as its master, and the parameter itself is given a ``compute_dtype`` copy;
  * autocast then finds the weight already in bf16 (no cast), and autograd produces its gradient in bf16
    (no cast back): the value autocast's GEMM produced before its cast to float32;
  * `step` runs one fused kernel per tensor (`adamw_kernel`): it reads the master, the bf16 gradient and the
    two float32 moments, and writes the master, the moments and the master rounded to bf16 into the parameter.

How the master is kept (``master_format``):
  "split"    (the default for bf16) the bf16 weight is the master's upper 16 bits and the state keeps only
             the 16 bits rounding removed ("master_lo", int16; `split_float`): the same float32 master, exactly,
             in 2 bytes beside the weight instead of 4.  14 bytes an element with the gradient and moments
             (6.3 GiB less than float32 masters at 2.7B) and 26 bytes of traffic an update.  The bf16 weight is
             the master rounded to nearest with ties away from zero (torch rounds ties to even: the two
             differ on one master value in 65536, by one bf16 step).
  "float32"  (the only choice for fp16) a float32 copy ("master"): the parameter's own float32 storage, kept
             as it was; 28 bytes of traffic an update, as many as torch's fused AdamW on float32 parameters.

Parameters not in ``compute_params`` (embeddings, norm gains: not GEMM operands, and kept float32 so the
residual stream and the norms keep their precision) are their own masters and are updated by the same kernel
without the bf16 write.  The update is torch's AdamW (decoupled weight decay, bias-corrected moments), so
one step matches `torch.optim.AdamW` on the float32 masters with the bf16 gradients upcast, to float32
rounding, in either format (tests/optim/test_adamw_master.py).

What changes against autocast over float32 weights: nothing in the values of one step from the same masters
(with split masters, the bf16 rounding of ties).  Gradient accumulation over several backward passes would
sum in bf16; step after each backward or keep the default (float32 parameters and `torch.optim.AdamW`) when
accumulating.  The model must run under autocast: its bf16 weights meet float32 activations (the
embedding's output, the norms) that autocast casts.

Usage::

    model = build("2.7B", device="cuda")  # float32
    opt = AdamWMaster(model.parameters(), lr=3e-4, compute_params=linear_weights(model))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.master(p)  # a parameter's float32 master (for split masters: joined into a new tensor)

``impl``: "triton" (the kernel; CUDA tensors, or CPU ones under TRITON_INTERPRET=1), "torch" (the same update
in PyTorch ops, `adamw_update_reference`, any device), or "auto" (the kernel on CUDA, PyTorch ops elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import chain

import torch
from torch import nn

from cs336_systems import switches
from cs336_systems.optim import split_float

IMPLS = ("auto", "triton", "torch")
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
MASTER_FORMATS = ("split", "float32")


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
    sqrt_bias2: float, eps: float, lo: torch.Tensor | None = None,
) -> None:
    """`adamw_kernel.adamw_update` in PyTorch ops (same arguments, same order of operations), in place."""
    if lo is not None:  # split master: join, update, split back into the weight and its low bits
        master = split_float.join(compute, lo)
        adamw_update_reference(master, grad, exp_avg, exp_avg_sq, None, decay=decay, beta1=beta1, beta2=beta2,
                               step_size=step_size, sqrt_bias2=sqrt_bias2, eps=eps)
        hi, low = split_float.split(master)
        compute.copy_(hi)
        lo.copy_(low)
        return
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


def _check_betas(name: str, betas: object) -> None:
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{name} must be two numbers in [0, 1), got {betas!r}")


def _check_group(group: dict, where: str) -> None:
    """A param group's hyperparameters (as the constructor checks its defaults), naming the group."""
    for key in ("lr", "eps", "weight_decay"):
        _check_non_negative(f"{where}: {key}", group.get(key))
    _check_betas(f"{where}: betas", group.get("betas"))


class AdamWMaster(torch.optim.Optimizer):
    """AdamW over float32 masters; ``compute_params`` are held by the model in ``compute_dtype`` (module docstring).

    lr, betas, eps, weight_decay: as `torch.optim.AdamW` (same defaults).  ``state[p]`` holds "step" (an int),
    "exp_avg" and "exp_avg_sq" (float32, from the first step) and, for a compute parameter, "master_lo"
    (int16, ``master_format`` "split") or "master" (float32, "float32").  ``master_format`` None: "split" for
    a bf16 ``compute_dtype``, "float32" for fp16.  With split masters the model's bf16 weights are half of
    each master: a checkpoint needs the model's state dict as well as this optimizer's.

    Each param group's own hyperparameters are checked as the defaults are (at construction and in
    `add_param_group`, which also takes float32 parameters only).  `load_state_dict` refuses, before loading
    anything, a state whose compute parameters have no master (a `torch.optim.AdamW` state dict: the weights
    would go on in bf16 without their float32 masters), state tensors of other shapes, and bad saved group
    hyperparameters; torch AdamW's state for parameters that are their own masters loads.
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
        master_format: str | None = None,
        impl: str = "auto",
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            _check_non_negative(name, value)
        _check_betas("betas", betas)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if master_format is None:
            master_format = "split" if compute_dtype == torch.bfloat16 else "float32"
        if master_format not in MASTER_FORMATS:
            raise ValueError(f"master_format must be one of {MASTER_FORMATS}, got {master_format!r}")
        if master_format == "split" and compute_dtype != torch.bfloat16:
            # fp16 has 5 exponent bits: it is not the upper half of a float32
            raise ValueError(f"master_format 'split' needs compute_dtype torch.bfloat16, got {compute_dtype!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.impl = impl
        self.compute_dtype = compute_dtype
        self.master_format = master_format
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        for p in dict.fromkeys(compute_params):  # a parameter named twice is cast once
            if id(p) not in owned:
                raise ValueError("compute_params must be parameters this optimizer updates; got one of shape "
                                 f"{tuple(p.shape)} that is not in params")
            if p.dtype != torch.float32:
                raise ValueError(f"compute_params must be float32 when the optimizer is built (their float32 "
                                 f"storage becomes the master); got one of dtype {p.dtype} and shape {tuple(p.shape)}")
            if master_format == "split":
                p.data, self.state[p]["master_lo"] = split_float.split(p.data)
                continue
            # The parameter's own float32 storage becomes the master and the parameter gets a new bf16 one:
            # construction holds the float32 weights and their bf16 copies (19 GiB at 2.7B), not two float32
            # copies (25 GiB) of which one is freed.
            self.state[p]["master"] = p.data if p.data.is_contiguous() else p.data.contiguous()
            hold_in([p], compute_dtype)
        for group in self.param_groups:
            for p in group["params"]:
                if not self._is_compute(p) and p.dtype != torch.float32:
                    raise ValueError(f"params not in compute_params must be float32 (they are their own masters); "
                                     f"got one of dtype {p.dtype} and shape {tuple(p.shape)}")
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and each group's hyperparameters checked as the constructor checks its defaults (a group's
        own ``lr=-1`` or ``weight_decay=nan`` would otherwise train wrong or fail only at `step`); a group added
        after construction must hold float32 parameters (they are their own masters: compute parameters are
        chosen when the optimizer is built)."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group, f"param group {index}")
            if getattr(self, "_built", False):
                for p in group["params"]:
                    if p.dtype != torch.float32:
                        raise ValueError(f"param group {index}: a group added after construction must hold float32 "
                                         f"parameters (their own masters); got one of dtype {p.dtype} and shape "
                                         f"{tuple(p.shape)}")
        except ValueError:
            self.param_groups.pop()
            raise

    def _is_compute(self, p: torch.Tensor) -> bool:
        return "master" in self.state[p] or "master_lo" in self.state[p]

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 weights of parameter ``p``: its master (split masters: joined, a new tensor), or ``p``
        itself if it is not a compute parameter."""
        state = self.state[p]
        if "master_lo" in state:
            return split_float.join(p.detach(), state["master_lo"])
        return state.get("master", p)

    def _use_triton(self, tensors: list[torch.Tensor]) -> bool:
        if self.impl == "torch":
            return False
        on_cuda = all(t.is_cuda for t in tensors)
        if self.impl == "auto":
            return on_cuda
        if not on_cuda and not switches.interpreter_active():
            raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for the CPU interpreter; got "
                             f"tensors on {sorted({str(t.device) for t in tensors})}")
        return True

    # torch.amp.GradScaler: `scaler.step(opt)` then checks the gradients for infs itself (in any dtype, fp16
    # included) and hands this step the scale (`grad_scale`) and the verdict (`found_inf`) instead of unscaling
    # the gradients in place, which it refuses for fp16 gradients: the fp16 compute parameters' gradients are
    # unscaled here, in float32, on their way into the update.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return loss  # a step with an inf or NaN gradient is skipped (GradScaler then lowers its scale)
        inv_scale = None if grad_scale is None else 1.0 / float(grad_scale)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, inv_scale)
        return loss

    def _update(self, p: torch.Tensor, group: dict, inv_scale: float | None = None) -> None:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("AdamWMaster does not support sparse gradients")
        if inv_scale is not None:  # GradScaler's scale, divided out in float32 (a new tensor: p.grad stays)
            grad = grad.to(torch.float32) * inv_scale
        state = self.state[p]
        lo = state.get("master_lo")
        master = None if lo is not None else state.get("master", p)
        if "exp_avg" not in state:
            state["step"] = 0
            like = p if master is None else master
            state["exp_avg"] = torch.zeros_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = state["step"]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        compute = p if self._is_compute(p) else None
        args = dict(decay=1.0 - lr * group["weight_decay"], beta1=beta1, beta2=beta2,
                    step_size=lr / (1.0 - beta1**t), eps=group["eps"], lo=lo)
        sqrt_bias2 = math.sqrt(1.0 - beta2**t)
        tensors = [x for x in (master, compute, lo, state["exp_avg"], state["exp_avg_sq"]) if x is not None]
        if self._use_triton(tensors + [grad]) and all(x.is_contiguous() for x in tensors):
            from cs336_systems.optim import adamw_kernel  # imports Triton

            adamw_kernel.adamw_update(master, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], compute,
                                      sqrt_bias2=sqrt_bias2, **args)
        else:  # PyTorch ops; also a non-contiguous parameter, which the flat kernel cannot index
            adamw_update_reference(master, grad, state["exp_avg"], state["exp_avg_sq"], compute,
                                   sqrt_bias2=sqrt_bias2, **args)

    def _check_loadable(self, state_dict: dict) -> None:
        """ValueError, before anything is loaded, for a state dict this optimizer cannot resume from: one whose
        compute parameters have no master (a `torch.optim.AdamW` state dict, or another ``master_format``:
        the weights would go on training without their float32 masters), state tensors of other shapes (a
        model of other sizes), or group hyperparameters the constructor would refuse."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            return  # torch's own error names the mismatch
        key = "master_lo" if self.master_format == "split" else "master"
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            _check_group(saved, f"saved param group {gi}")
            for pi, (saved_id, p) in enumerate(zip(saved["params"], group["params"])):
                where = f"param group {gi}, parameter {pi} (shape {tuple(p.shape)})"
                state = state_dict.get("state", {}).get(saved_id, {})
                if self._is_compute(p) and key not in state:
                    raise ValueError(f"{where}: the saved state has no {key!r} (keys: {sorted(state) or 'none'}); it is "
                                     f"not an AdamWMaster state with master_format {self.master_format!r} (a "
                                     "torch.optim.AdamW state dict?), and loading it would drop the float32 masters")
                for name, value in state.items():
                    if isinstance(value, torch.Tensor) and name != "step" and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"{where}: the saved {name!r} has shape {tuple(value.shape)}; the state of a "
                                         "model of other sizes")

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader casts every state tensor to a floating-point parameter's dtype, which would round the
        # float32 masters and moments of a bf16 parameter and turn the int16 low bits into bf16 numbers; put the
        # saved tensors back as they were (pairing saved and current parameters in group order, as torch does).
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key == "step":  # torch's AdamW saves a tensor: the update's bias correction takes a number
                    self.state[p][key] = int(value.item()) if isinstance(value, torch.Tensor) else value
                elif isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)
