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

`build(size, **overrides)` is the entry point; it allocates on the current default device, so
``with torch.device("meta"): build("2.7B")`` counts and shapes the 2.7B model without memory.

Activation checkpointing: ``ModelConfig.checkpoint`` ("none", "every-<k>", "sqrt"; e.g.
``build("xl", checkpoint="sqrt")``) selects which runs of consecutive blocks are recomputed in backward instead
of keeping their activations (`cs336_systems.checkpointing`).  It changes memory and time, never the values or
the parameters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import attention as attention_registry
from cs336_systems.checkpointing import CheckpointPolicy, run_blocks


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
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
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

    cos/sin tables of shape (context_length, d/2) are non-persistent buffers (not parameters).
    """

    def __init__(self, d_head: int, context_length: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # (d/2,)
        angles = torch.arange(context_length, dtype=torch.float32)[:, None] * inv_freq  # (T, d/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, d); positions: (T,) or broadcastable (..., T) integer positions."""
        cos = self.cos[positions].to(x.dtype)  # (..., T, d/2)
        sin = self.sin[positions].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]  # (..., T, d/2) each
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)  # (..., T, d), pairs interleaved back


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attention_fn = attention_registry.get(cfg.attention).fn
        self.qkv_proj = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.output_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, d_head)
        q, k = self.rope(q, positions), self.rope(k, positions)
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) int64 with T <= context_length -> logits (B, T, vocab_size)."""
        seq = tokens.shape[-1]
        if seq > self.config.context_length:
            raise ValueError(
                f"sequence length {seq} exceeds context_length={self.config.context_length}"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embeddings(tokens)  # (B, T, d)
        x = run_blocks(self.layers, x, positions, policy=self.checkpoint_policy)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)


def build(size: str, *, dtype: torch.dtype | None = None, **overrides) -> TransformerLM:
    """Build the LM of a named size (see SIZES) on the current default device.

    ``overrides`` replace ModelConfig fields (vocab_size, context_length, attention, rope_theta, checkpoint, ...);
    ``dtype`` casts parameters (default: float32 master weights, the mixed-precision setup).
    Use ``with torch.device("cuda")`` / ``("meta")`` around the call to choose where it lives.
    """
    model = TransformerLM(config(size, **overrides))
    if dtype is not None:
        model = model.to(dtype)
    return model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (works on meta tensors)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
