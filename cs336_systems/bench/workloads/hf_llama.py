"""Hugging Face transformers' `LlamaForCausalLM` as a baseline implementation of the end-to-end LM suite.

The baseline is the same model as `cs336_systems.model` at every size, built from the same `ModelConfig`
(`llama_config` maps it field by field):

  ours (ModelConfig)           LlamaConfig
  d_model, d_ff                hidden_size, intermediate_size (SwiGLU: hidden_act="silu")
  n_layers, n_heads            num_hidden_layers, num_attention_heads = num_key_value_heads (no GQA)
  vocab_size, context_length   vocab_size, max_position_embeddings
  rope_theta, norm_eps         rope_parameters={"rope_type": "default", "rope_theta": ...}, rms_norm_eps
  no biases, untied LM head    attention_bias=False, mlp_bias=False, tie_word_embeddings=False
  attention="sdpa"             attn_implementation="sdpa"; use_cache=False; no pad token (no padding row)

so both have the same parameters, in number and in which of them enter matmuls (the N of the FLOP and
MFU formulas, `cs336_systems.bench.flops`).  What differs is HF's code, which is what the baseline
measures: separate q/k/v and gate/up projections (ours fuse them into one GEMM each), RoPE over the two
halves of the head dim (ours: adjacent pairs; a fixed permutation of the q/k weights, the same work),
cos/sin computed once per forward outside the layers, and HF's model-level bookkeeping (its forward
builds position ids and checks them for packed sequences, which reads a flag back from the device).

Causal attention takes SDPA's ``is_causal`` path, never a materialized mask: with no attention mask, no
cache and no packed sequences, HF's `create_causal_mask` returns None for "sdpa", and each layer then
calls `F.scaled_dot_product_attention(..., attn_mask=None, is_causal=True)` (checked by the tests).

The loss is not HF's: `logits` calls the model without ``labels`` and the caller applies the same
`F.cross_entropy` to the same targets as for our model.  HF's own loss shifts the labels by one and
upcasts the logits to float32 first, an extra (B, T, vocab) copy our step does not make, so passing
``labels`` would time a different loss rather than a different model.

transformers is an optional extra (``pip install -e .[baselines]``); it is imported only when a baseline
is built, and `unavailable_reason()` says why the baseline cannot run here (the perf suite skips its cases
with that reason).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from cs336_systems.model import ModelConfig, config

INSTALL_HINT = "transformers not installed: pip install -e .[baselines]"
# LlamaConfig's `rope_parameters` and the `cache` keyword of the layers are the transformers 5 API.
MIN_MAJOR_VERSION = 5


class BaselineUnavailable(ImportError):
    """transformers is missing or too old for the baseline; the message says how to install it."""


def _transformers():
    """The transformers module, or BaselineUnavailable naming the install command."""
    try:
        module = importlib.import_module("transformers")
    except ImportError:
        raise BaselineUnavailable(INSTALL_HINT) from None
    version = getattr(module, "__version__", "0")
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < MIN_MAJOR_VERSION:
        raise BaselineUnavailable(f"transformers {version} is installed; the hf-llama baseline needs "
                                  f"transformers >= {MIN_MAJOR_VERSION}: pip install -e .[baselines]")
    return module


def unavailable_reason() -> str | None:
    """Why the baseline cannot be built here (transformers missing or too old), or None if it can."""
    try:
        _transformers()
    except BaselineUnavailable as exc:
        return str(exc)
    return None


def llama_config(cfg: ModelConfig):
    """The `transformers.LlamaConfig` of the same model as ``cfg`` (table in the module docstring).

    ``cfg.attention`` must be "sdpa" (HF's attention is picked by its own ``attn_implementation``) and
    ``cfg.checkpoint`` "none" (the baseline does not recompute activations); ValueError otherwise.
    """
    if cfg.attention != "sdpa":
        raise ValueError(f"the hf-llama baseline runs SDPA attention only (attn_implementation='sdpa'); "
                         f"got attention={cfg.attention!r}")
    if cfg.checkpoint != "none":
        raise ValueError(f"the hf-llama baseline does not checkpoint activations; got checkpoint={cfg.checkpoint!r}")
    transformers = _transformers()
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.d_head,
        hidden_act="silu",
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=float(cfg.norm_eps),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        # no padding index: HF would otherwise zero that embedding row's gradient, work ours does not do
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )


def build(size: str, *, device: torch.device | str | None = None, **overrides) -> nn.Module:
    """`transformers.LlamaForCausalLM` of a named size (`cs336_systems.model.SIZES`), float32 master weights,
    on ``device`` (default: the current default device; ``"meta"`` allocates nothing).

    ``overrides`` are `ModelConfig` fields as for `cs336_systems.model.build` (vocab_size, context_length,
    rope_theta, norm_eps, ...); attention defaults to "sdpa", the only one the baseline runs.
    """
    cfg = config(size, **{"attention": "sdpa", **overrides})
    hf_config = llama_config(cfg)
    transformers = _transformers()
    target = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device(target):
        return transformers.LlamaForCausalLM(hf_config)


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules compiled separately for a compiled case, as our model's blocks and final norm are: every
    decoder layer (one graph shared by all layers: HF's layers read no per-layer constant without a cache)
    and the final norm."""
    return [*model.model.layers, model.model.norm]


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) int64 -> logits (B, T, vocab): HF's forward without labels (see the module docstring)."""
    return model(input_ids=tokens).logits
