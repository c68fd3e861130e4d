"""A pre-norm decoder-only Transformer language model (the CS336 "basics" architecture).

    tokens (B, T) -> embedding (B, T, d)
      -> n_layers x [ x + Attn(RMSNorm(x)) ; x + SwiGLU(RMSNorm(x)) ]
      -> RMSNorm -> untied LM head -> logits (B, T, vocab)

No biases anywhere.  Attention is causal multi-head self-attention with rotary position embeddings
(RoPE, theta = 10000, rotating adjacent pairs (x[2i], x[2i+1]) as in the handout), and the attention
kernel itself is chosen by name from `cs336_systems.attention`.

Two projections are fused for speed without changing the parameter count: Q, K and V come from one
(3d x d) weight, and the SwiGLU gate and up projections from one (2 d_ff x d) weight.  One larger GEMM
keeps the tensor cores busier than three small ones at the handout's batch sizes.

`build(size, **overrides)` is the entry point; it allocates on ``device`` or, by default, the current default
device, so ``with torch.device("meta"): build("2.7B")`` counts and shapes the 2.7B model without memory.

Validation (ValueError naming the argument and its value):
  * the configuration, when a `ModelConfig` is constructed (sizes, ``rope_theta`` and ``norm_eps`` finite
    and positive, a registered attention implementation, a checkpoint policy);
  * `build`: ``dtype`` a floating-point torch.dtype; the attention implementation available on the device
    the model is built on and taking its head dim (`attention.check_available`; not on the meta device,
    where nothing runs);
  * the first forward of each attention layer on a (device, dtype): the implementation available there and
    supporting the inputs (`attention.check_inputs`), so a model built on one device and moved to another,
    or cast, fails with the reason rather than deep inside a kernel (skipped while torch.compile traces);
  * every forward: ``tokens`` an int64 / int32 tensor of shape (batch, seq) on the model's device with
    seq <= context_length (shape, dtype and device only: no device work), and its values in
    [0, vocab_size).  The range check reads two numbers back from the device: on the CPU it runs every
    call; on CUDA it runs once per tokens tensor (object and version), so a loop that feeds the same batch
    (every benchmark here) synchronizes only on its first step, and never while torch.compile traces or a
    CUDA graph is captured.  Out-of-range ids on CUDA would otherwise trip a device-side assert that
    poisons the CUDA context.  Set ``model.check_token_range = False`` to skip it (e.g. a training loop
    that feeds a new, already validated batch every step and wants no synchronization).

Packed documents: ``model(tokens, packing=Packing.of(lengths, device))`` with tokens (1, total) runs several
documents in one row: positions restart at each document's first token (RoPE) and attention stays within
each document (`flash_attention_varlen`, so attention="flash-triton"), so each document's logits are what it
alone would give.  The loss should skip each document's last target, the next document's first token
(`Packing.target_mask`).

Activation checkpointing: ``ModelConfig.checkpoint`` ("none", "every-<k>", "sqrt"; e.g.
``build("xl", checkpoint="sqrt")``) selects which runs of consecutive blocks are recomputed in backward instead
of keeping their activations (`cs336_systems.checkpointing`).  It changes memory and time, never the values or
the parameters.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import attention as attention_registry
from cs336_systems.checkpointing import CheckpointPolicy, run_blocks


@dataclass(frozen=True)
class Packing:
    """Documents packed into one row of tokens: ``cu_seqlens`` (D + 1,) int32 offsets on the tokens' device
    (document i is tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1), ``max_seqlen`` the longest document's
    length, and ``positions`` (total,) int64: each token's position within its document."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor

    @staticmethod
    def of(lengths, device: torch.device | str | None = None) -> "Packing":
        """The packing of documents of these lengths (ints >= 1), in order."""
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"lengths must be one or more document lengths >= 1; got {lengths}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(n) for n in lengths])
        return Packing(torch.tensor(offsets, dtype=torch.int32, device=device), max(lengths),
                       positions.to(device))

    @property
    def total(self) -> int:
        return self.positions.shape[0]

    def target_mask(self) -> torch.Tensor:
        """(total,) bool: False at each document's last token, whose next-token target is the next
        document's first token (a boundary the model must not be trained to predict)."""
        mask = torch.ones(self.total, dtype=torch.bool, device=self.positions.device)
        mask[self.cu_seqlens[1:].long() - 1] = False
        return mask


# Devices whose tokens are range-checked on every forward (reading them back costs no synchronization);
# elsewhere once per tokens tensor and version (module docstring).
RANGE_CHECK_EVERY_CALL = frozenset({"cpu"})


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyperparameters of the LM; validated on construction."""

    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    vocab_size: int = 10_000
    context_length: int = 1024
    rope_theta: float = 10_000.0
    attention: str = "naive"
    norm_eps: float = 1e-5
    checkpoint: str = "none"  # activation checkpointing of the block stack: "none" | "every-<k>" | "sqrt"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head dimension d_model/n_heads={self.d_model // self.n_heads} must be even for RoPE"
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        if not isinstance(self.attention, str):
            raise ValueError(f"attention must be an implementation name (str), got {self.attention!r}")
        attention_registry.get(self.attention)  # raises ValueError naming the valid implementations
        # Raises TypeError / ValueError naming `checkpoint`; a CheckpointPolicy is stored as its spec string.
        object.__setattr__(self, "checkpoint", str(CheckpointPolicy.parse(self.checkpoint)))

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


# The handout's model sizes, plus "tiny" for CPU runs and tests.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=256, n_layers=2, n_heads=4),
    "small": dict(d_model=768, d_ff=3072, n_layers=12, n_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, n_layers=24, n_heads=16),
    "large": dict(d_model=1280, d_ff=5120, n_layers=36, n_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, n_layers=48, n_heads=25),
    "2.7B": dict(d_model=2560, d_ff=10240, n_layers=32, n_heads=32),
}


def config(size: str, **overrides) -> ModelConfig:
    """The ModelConfig of a named size with field overrides (vocab_size, context_length, attention, checkpoint...)."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; valid: {', '.join(SIZES)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown override(s) {unknown} for size {size!r}; valid: {sorted(fields)}")
    return ModelConfig(**{**SIZES[size], **overrides})


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32 and returned in x's dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Upcast: squaring bf16/fp16 activations loses too much precision in the mean.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each adjacent pair (x[2i], x[2i+1]) at position p by angle p * theta^(-2i/d).

    Computed as x * C + swap(x) * S, where swap exchanges the two elements of each pair and the (T, d) tables
    hold cos(angle) twice per pair (C) and (-sin, +sin) per pair (S): the pair formula
    (x0 c - x1 s, x0 s + x1 c) with the same products and sums, so the same roundings in any dtype, in 4 eager
    kernels (swap, two products, sum; besides gathering and casting the tables) and 4 in the backward, where
    the even/odd form takes 7 and about 12.
    The tables are non-persistent buffers (not parameters).
    """

    def __init__(self, d_head: int, context_length: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # (d/2,)
        angles = torch.arange(context_length, dtype=torch.float32)[:, None] * inv_freq  # (T, d/2)
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos_pairs", cos.repeat_interleave(2, dim=-1), persistent=False)  # (T, d)
        self.register_buffer("sin_pairs", torch.stack((-sin, sin), dim=-1).flatten(-2), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, d); positions: (T,) or broadcastable (..., T) integer positions.  Positions of shape
        (T, 1) rotate x of shape (..., T, H, d): one position per token, shared by its heads."""
        cos = self.cos_pairs[positions].to(x.dtype)  # (..., T, d)
        sin = self.sin_pairs[positions].to(x.dtype)
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
        return x * cos + swapped * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attention = cfg.attention
        self.attention_fn = attention_registry.get(cfg.attention).fn
        self.qkv_proj = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.output_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = rope
        self._checked: tuple[torch.device, torch.dtype] | None = None  # (device, dtype) the inputs passed on

    def forward(self, x: torch.Tensor, positions: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads)
        q, k, v = qkv.unbind(2)  # each (B, T, H, d_head), views of qkv
        # Layout, for memory: RoPE runs on (B, T, H, d) (positions (T, 1) broadcast over heads), so q and k are
        # new tensors in token-major memory, and v is copied into its own; the transposes below are views.
        # SDPA's output then comes in the same token-major memory, so the reshape for output_proj is a view
        # too, and nothing the backward keeps is a view of qkv: per layer that saves the (B, T, 3d) projection
        # output and a (B, T, d) copy of the attention output (1.0 GiB of the 2.7B step's 7.7 GiB).
        pos = positions[:, None]
        q, k, v = self.rope(q, pos), self.rope(k, pos), v.contiguous()
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, d_head)
        if not torch.compiler.is_compiling() and self._checked != (q.device, q.dtype):
            # first call on this device and dtype (built elsewhere and moved, cast, autocast): can the
            # implementation run these inputs?  ValueError naming it and the alternatives if not.
            attention_registry.check_inputs(self.attention, q, k, v, True)
            self._checked = (q.device, q.dtype)
        if packing is not None:  # one row of documents: attention within each (module docstring)
            from cs336_systems.attention.flash_varlen import flash_attention_varlen

            cu, longest = packing.cu_seqlens, packing.max_seqlen
            out = flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                         longest, longest, True)  # (T, H, d_head)
            return self.output_proj(out.reshape(batch, seq, d_model))
        out = self.attention_fn(q, k, v, is_causal=True)  # (B, H, T, d_head)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    """W2 (SiLU(W1 x) * W3 x), with W1 and W3 stored as one (2 d_ff, d) weight."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # (B, T, d_ff) each
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, rope)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, packing)
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.token_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # One RoPE table shared by all layers (registered once, in layers[0]'s attention).
        rope = RotaryEmbedding(cfg.d_head, cfg.context_length, cfg.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(cfg, rope) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpoint_policy = CheckpointPolicy.parse(cfg.checkpoint)
        self.check_token_range = True  # see the module docstring (False: no range check, no sync)
        self._range_checked: tuple[weakref.ref, int] | None = None  # (tokens, version) checked on an accelerator
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The handout's initialisation: truncated normals at +-3 sigma, norms at 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                std = math.sqrt(2.0 / (fan_in + fan_out))
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, nn.Embedding):
                nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def _check_tokens(self, tokens: torch.Tensor, packing: Packing | None = None) -> None:
        """ValueError naming ``tokens`` unless it is an int64 / int32 (B, T) tensor on the model's device, with
        T <= context_length and ids in [0, vocab_size) (the range check: module docstring); with ``packing``,
        one row of its total length, documents no longer than context_length, and flash-triton attention."""
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, seq), got shape {tuple(tokens.shape)}")
        if tokens.dtype != torch.int64 and tokens.dtype != torch.int32:
            raise ValueError(f"tokens must hold integer token ids (torch.int64 or torch.int32), got dtype {tokens.dtype}")
        seq = tokens.shape[1]
        if packing is not None:
            if tokens.shape[0] != 1 or seq != packing.total:
                raise ValueError(f"packed tokens must have shape (1, {packing.total}) (the packing's total), got "
                                 f"{tuple(tokens.shape)}")
            if packing.cu_seqlens.device != tokens.device or packing.positions.device != tokens.device:
                raise ValueError(f"the packing's tensors must be on the tokens' device {tokens.device}; got "
                                 f"{packing.cu_seqlens.device}")
            if self.config.attention != "flash-triton":
                raise ValueError(f"packed documents need attention='flash-triton' (flash_attention_varlen); this "
                                 f"model has attention={self.config.attention!r}")
            seq = packing.max_seqlen  # positions restart per document: each must fit the context
        if seq > self.config.context_length:
            raise ValueError(
                f"sequence length {seq} of tokens exceeds context_length={self.config.context_length}"
            )
        device = tokens.device
        weight_device = self.token_embeddings.weight.device
        if device != weight_device:
            raise ValueError(f"tokens are on device {device} but the model is on {weight_device}")
        if not self.check_token_range or torch.compiler.is_compiling() or device.type == "meta":
            return
        every_call = device.type in RANGE_CHECK_EVERY_CALL
        if not every_call:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            checked = self._range_checked
            if checked is not None and checked[0]() is tokens and checked[1] == tokens._version:
                return  # this very batch passed already: no second sync
        if tokens.numel():
            low, high = (int(x) for x in torch.aminmax(tokens))  # on an accelerator: one sync
            vocab = self.config.vocab_size
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ValueError(
                    f"tokens must be ids in [0, vocab_size={vocab}); got {bad} (tokens range from {low} to {high})")
        if not every_call:
            self._range_checked = (weakref.ref(tokens), tokens._version)

    def forward(self, tokens: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """tokens: (B, T) int64 (or int32) ids in [0, vocab_size), T <= context_length -> logits (B, T, vocab_size).
        ``packing``: tokens (1, total) hold documents packed in one row (module docstring)."""
        self._check_tokens(tokens, packing)
        seq = tokens.shape[1]
        if packing is None:
            positions = torch.arange(seq, device=tokens.device)
            x = run_blocks(self.layers, self.token_embeddings(tokens), positions, policy=self.checkpoint_policy)
        else:
            x = run_blocks(self.layers, self.token_embeddings(tokens), packing.positions, packing,
                           policy=self.checkpoint_policy)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)


def build(
    size: str, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None, **overrides
) -> TransformerLM:
    """Build the LM of a named size (see SIZES) on ``device`` (default: the current default device).

    ``overrides`` replace ModelConfig fields (vocab_size, context_length, attention, rope_theta, checkpoint, ...);
    ``dtype`` casts parameters (default: float32 master weights, the mixed-precision setup).
    ``device="cuda"``, or ``with torch.device("cuda")`` / ``("meta")`` around the call, chooses where it lives.
    The attention implementation must be available on that device and take the model's head dim (ValueError
    naming it, the device and the alternatives; not checked on the meta device): build where the model runs
    rather than on the CPU and moving it (a move is checked at the first forward).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch.device or a device string, got {device!r}: {exc}") from None
    cfg = config(size, **overrides)
    target = device if device is not None else torch.get_default_device()
    if target.type != "meta":
        attention_registry.check_available(cfg.attention, target, head_dim=cfg.d_head)
    if device is None:
        model = TransformerLM(cfg)
    else:
        with torch.device(device):
            model = TransformerLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (works on meta tensors)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
