"""Float8 training of a model's Linear layers through torchao (`torchao.float8.convert_to_float8_training`).

    convert_linears(model, precision, *, emulate=None) -> the names of the converted modules (in place)
    precision: "bf16" (nothing converted: the GEMMs run in the autocast dtype), "fp8-tensorwise" or
    "fp8-rowwise" (torchao's recipes: one scale per tensor, or per row of each operand)

Every `nn.Linear` whose in and out features are multiples of 16 (the float8 GEMMs' alignment) becomes a
`Float8Linear`, except the LM head (``lm_head``: its logits feed the loss directly, and the first and last
layers of an LM are the ones float8 recipes leave in higher precision); embeddings are not Linear layers.
A Float8Linear keeps its weight as it was (float32, or bf16 where `AdamWMaster` holds the Linear weights in
bf16 with their float32 masters in the optimizer): each forward casts it to float8 with a fresh scale, and
the optimizer updates it as any weight.  Convert before building the optimizer and before torch.compile.

Needs torchao (the `fp8` extra, pinned) and, for float8 GEMMs, a CUDA GPU of compute capability 8.9 or
more (`unavailable_reason`).  ``emulate`` (default: on a CPU) does the same casts with float32 matmuls, for
tests anywhere.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

PRECISIONS = ("bf16", "fp8-tensorwise", "fp8-rowwise")
DEFAULT_PRECISION = "bf16"
INSTALL = 'pip install -e ".[fp8]" (torchao)'
_RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
SKIPPED = ("lm_head",)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown linear precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


def unavailable_reason(precision: str, device: torch.device | str) -> str | None:
    """Why ``precision`` cannot train on ``device`` (None if it can): torchao missing, or a GPU without float8
    tensor cores.  On a CPU the casts are emulated."""
    if check_precision(precision) == DEFAULT_PRECISION:
        return None
    if importlib.util.find_spec("torchao") is None:
        return f"float8 training needs torchao: {INSTALL}"
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if capability < (8, 9):
            return f"float8 GEMMs need compute capability 8.9 or more; this GPU has {capability[0]}.{capability[1]}"
    return None


def first_unavailable(precisions: list[str], device: torch.device | str) -> str | None:
    """`unavailable_reason` of the first of ``precisions`` that cannot train on ``device`` (None if all can):
    what a tool checks before it spends time on any of them."""
    return next((r for r in (unavailable_reason(p, device) for p in precisions) if r is not None), None)


def convert_linears(model: nn.Module, precision: str, *, emulate: bool | None = None) -> list[str]:
    """Swap the model's eligible Linear layers for torchao's Float8Linear (module docstring); returns the
    converted modules' names.  "bf16" converts nothing.  ValueError where `unavailable_reason` says why."""
    if check_precision(precision) == DEFAULT_PRECISION:
        return []
    device = next(model.parameters()).device
    reason = unavailable_reason(precision, device)
    if reason is not None:
        raise ValueError(reason)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(_RECIPES[precision])
    if emulate if emulate is not None else device.type == "cpu":
        config = Float8LinearConfig(**{**config.__dict__, "emulate": True})

    def eligible(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and name.split(".")[-1] not in SKIPPED
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    return converted(model)


def converted(model: nn.Module) -> list[str]:
    """The names of the model's Float8Linear modules."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
