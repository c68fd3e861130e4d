"""The Transformer LM: sizes, parameter counts, validation, causality, RoPE, trainability."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems import model

EXACT_COUNTS = {
    "small": 128_625_408,
    "large": 969_411_840,
    "xl": 1_998_235_200,
    "2.7B": 3_406_809_600,
}


@pytest.mark.parametrize("size", list(EXACT_COUNTS))
def test_parameter_counts_exact_on_meta(size):
    with torch.device("meta"):
        lm = model.build(size)
    assert all(p.device.type == "meta" for p in lm.parameters())
    assert model.count_parameters(lm) == EXACT_COUNTS[size]


def test_medium_matches_formula():
    cfg = model.config("medium")
    d, f, n, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    expected = 2 * v * d + n * (4 * d * d + 3 * d * f + 2 * d) + d
    with torch.device("meta"):
        assert model.count_parameters(model.build("medium")) == expected


def test_meta_forward_shapes_2_7b():
    with torch.device("meta"):
        lm = model.build("2.7B", context_length=512)
        logits = lm(torch.zeros(4, 512, dtype=torch.long))
    assert logits.shape == (4, 512, 10_000)


def test_overrides_and_dtype():
    lm = model.build("tiny", vocab_size=123, context_length=32, dtype=torch.bfloat16)
    assert lm.config.vocab_size == 123 and lm.config.context_length == 32
    assert all(p.dtype == torch.bfloat16 for p in lm.parameters())
    assert lm(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 123)


def test_no_biases():
    lm = model.build("tiny")
    assert all(m.bias is None for m in lm.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: model.build("huge"), r"unknown model size 'huge'.*small"),
        (lambda: model.build("tiny", attention="nope"), r"unknown attention implementation 'nope'.*naive"),
        (lambda: model.build("tiny", widht=3), r"unknown override.*widht"),
        (lambda: model.ModelConfig(d_model=10, d_ff=8, n_layers=1, n_heads=3), r"not divisible by n_heads=3"),
        (lambda: model.ModelConfig(d_model=0, d_ff=8, n_layers=1, n_heads=1), r"d_model must be a positive"),
    ],
)
def test_bad_configuration_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("field, value", [
    ("rope_theta", float("nan")), ("rope_theta", float("inf")), ("rope_theta", 0.0), ("rope_theta", -1.0),
    ("rope_theta", "10000"), ("rope_theta", True),
    ("norm_eps", 0.0), ("norm_eps", -1e-5), ("norm_eps", float("nan")), ("norm_eps", float("inf")),
    ("norm_eps", None),
])
def test_non_finite_or_non_positive_rope_theta_and_norm_eps_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a finite positive number, got {value!r}"):
        model.build("tiny", **{field: value})


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", torch.int64, torch.bool, 16])
def test_build_dtype_must_be_a_floating_point_torch_dtype(dtype):
    with pytest.raises(ValueError, match=rf"dtype must be a floating-point torch.dtype \(e.g. torch.bfloat16\) "
                                         rf"or None, got {dtype!r}"):
        model.build("tiny", dtype=dtype)


def test_build_device_argument():
    lm = model.build("tiny", device="meta")
    assert all(p.device.type == "meta" for p in lm.parameters())
    with pytest.raises(ValueError, match=r"device must be a torch.device or a device string, got 'bf16'"):
        model.build("tiny", device="bf16")


@pytest.mark.parametrize("attention", ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
def test_build_refuses_an_attention_unavailable_on_the_model_device(attention):
    with pytest.raises(ValueError, match=rf"'{attention}' is not available on device cpu; available there: naive"):
        model.build("tiny", attention=attention, device="cpu")
    with torch.device("cpu"), pytest.raises(ValueError, match=rf"'{attention}' is not available on device cpu"):
        model.build("tiny", attention=attention)
    with torch.device("meta"):  # shapes and counts only: nothing runs, nothing is checked
        model.build("tiny", attention=attention)


def test_build_refuses_an_attention_that_does_not_take_the_head_dim(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # flash-triton available on the CPU
    with pytest.raises(ValueError, match=r"'flash-triton' supports head dims .*, got head_dim=84"):
        model.build("tiny", d_model=168, n_heads=2, attention="flash-triton")
    model.build("tiny", d_model=160, n_heads=2, attention="flash-triton")  # the 2.7B model's d_head, 80


def test_a_model_moved_to_a_device_its_attention_cannot_use_fails_at_the_first_forward():
    with torch.device("meta"):
        lm = model.build("tiny", context_length=16, attention="sdpa-flash")
    lm = lm.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"'sdpa-flash' is not available on device cpu; available there: naive"):
        lm(torch.zeros(1, 8, dtype=torch.long))


def test_a_model_cast_to_a_dtype_its_attention_cannot_compute_fails_at_the_first_forward(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("flash-triton's bf16 is refused only under the CPU interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lm = model.build("tiny", context_length=16, attention="flash-triton", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'flash-triton' does not support these inputs on device cpu "
                                         r"\(torch.bfloat16.*interpreter"):
        lm(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("tokens, match", [
    (torch.tensor([[1, 2, 64]]), r"tokens must be ids in \[0, vocab_size=64\); got 64 \(tokens range from 1 to 64\)"),
    (torch.tensor([[1, -1, 3]]), r"tokens must be ids in \[0, vocab_size=64\); got -1"),
    (torch.tensor([[1, 2, 3]], dtype=torch.int32) + 100, r"got 103"),
    (torch.tensor([[1.0, 2.0]]), r"tokens must hold integer token ids \(torch.int64 or torch.int32\), got dtype torch.float32"),
    (torch.tensor([[True, False]]), r"got dtype torch.bool"),
    (torch.tensor([[1, 2]], dtype=torch.uint8), r"got dtype torch.uint8"),
    (torch.tensor([1, 2, 3]), r"tokens must have shape \(batch, seq\), got shape \(3,\)"),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"tokens must have shape \(batch, seq\), got shape \(1, 2, 3\)"),
    (torch.zeros(1, 17, dtype=torch.long), r"sequence length 17 of tokens exceeds context_length=16"),
    (torch.zeros(1, 4, dtype=torch.long, device="meta"), r"tokens are on device meta but the model is on cpu"),
    ([[1, 2]], r"tokens must be a torch.Tensor of token ids, got list"),
])
def test_bad_tokens_raise_value_error_naming_tokens(tokens, match):
    lm = model.build("tiny", vocab_size=64, context_length=16)
    with pytest.raises(ValueError, match=match):
        lm(tokens)


def test_token_range_check_on_an_accelerator_runs_once_per_tokens_tensor(monkeypatch):
    """The range check reads two numbers back: on the CPU every call; on an accelerator (a sync there) once
    per tokens tensor and version, so a loop that feeds the same batch syncs on its first step only.  The
    accelerator path is exercised on the CPU by taking the CPU out of RANGE_CHECK_EVERY_CALL."""
    lm = model.build("tiny", vocab_size=64, context_length=16)
    tokens = torch.randint(0, 64, (2, 8))
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or real(t))
    lm(tokens)
    lm(tokens)
    assert len(calls) == 2  # CPU: every call
    monkeypatch.setattr(model, "RANGE_CHECK_EVERY_CALL", frozenset())
    calls.clear()
    for _ in range(3):
        lm(tokens)
    assert len(calls) == 1  # the same tensor, unchanged: checked once
    tokens[0, 0] = 64  # in place: a new version is checked again
    with pytest.raises(ValueError, match="got 64"):
        lm(tokens)
    lm(torch.randint(0, 64, (2, 8)))
    assert len(calls) == 3  # a new tensor is checked
    lm.check_token_range = False
    with pytest.raises(IndexError):  # switched off: no range check, the embedding's own error
        lm(torch.full((1, 3), 99))
    assert len(calls) == 3


@pytest.mark.gpu
def test_gpu_out_of_range_tokens_raise_before_the_device_asserts():
    lm = model.build("tiny", vocab_size=64, context_length=16, device="cuda")
    good = torch.randint(0, 64, (2, 8), device="cuda")
    lm(good)
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, vocab_size=64\); got 64"):
        lm(torch.full((2, 8), 64, device="cuda"))
    lm(good)  # the CUDA context is still usable
    bad = good.clone()
    lm(bad)
    bad[0, 0] = 64  # in place: a new version, checked again
    with pytest.raises(ValueError, match="got 64"):
        lm(bad)
    torch.cuda.synchronize()


def test_sequence_longer_than_context_raises():
    lm = model.build("tiny", context_length=16)
    with pytest.raises(ValueError, match="exceeds context_length=16"):
        lm(torch.zeros(1, 17, dtype=torch.long))


@settings(max_examples=20, deadline=None)
@given(
    seq=st.integers(2, 24),
    t=st.integers(0, 22),
    attention=st.sampled_from(["naive", "sdpa"]),
    seed=st.integers(0, 2**16),
)
def test_causality_future_tokens_never_change_past_logits(seq, t, attention, seed):
    t = t % (seq - 1)  # position whose logits must not move; tokens after it change
    torch.manual_seed(seed)
    lm = model.build("tiny", context_length=32, attention=attention).eval()
    tokens = torch.randint(0, 10_000, (2, seq))
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, 10_000, (2, seq - t - 1))
    with torch.no_grad():
        a, b = lm(tokens), lm(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-5)
    if not torch.equal(tokens[:, t + 1 :], changed[:, t + 1 :]):
        assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the future itself does react


def test_naive_and_sdpa_models_agree():
    torch.manual_seed(0)
    naive = model.build("tiny", context_length=64, attention="naive").eval()
    sdpa = model.build("tiny", context_length=64, attention="sdpa").eval()
    sdpa.load_state_dict(naive.state_dict())
    tokens = torch.randint(0, 10_000, (3, 64))
    with torch.no_grad():
        torch.testing.assert_close(naive(tokens), sdpa(tokens), rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(d=st.sampled_from([4, 8, 16, 64]), seq=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rope_preserves_norms(d, seq, seed):
    torch.manual_seed(seed)
    rope = model.RotaryEmbedding(d, context_length=64, theta=10_000.0)
    x = torch.randn(2, 3, seq, d, dtype=torch.float64)
    y = rope(x.float(), torch.arange(seq)).double()
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    # Pairs (2i, 2i+1) rotate among themselves: each pair's norm is preserved too.
    torch.testing.assert_close(
        y.unflatten(-1, (d // 2, 2)).norm(dim=-1), x.unflatten(-1, (d // 2, 2)).norm(dim=-1), rtol=1e-5, atol=1e-5
    )


@settings(max_examples=25, deadline=None)
@given(p=st.integers(0, 50), q=st.integers(0, 50), shift=st.integers(0, 13), seed=st.integers(0, 2**16))
def test_rope_scores_depend_only_on_relative_position(p, q, shift, seed):
    torch.manual_seed(seed)
    d = 16
    rope = model.RotaryEmbedding(d, context_length=64, theta=10_000.0)
    query, key = torch.randn(d), torch.randn(d)

    def score(i, j):
        return rope(query[None], torch.tensor([i])) @ rope(key[None], torch.tensor([j])).T

    torch.testing.assert_close(score(p, q), score(p + shift, q + shift), rtol=1e-4, atol=1e-4)


def test_rope_position_zero_is_identity_and_rotation_matches_formula():
    rope = model.RotaryEmbedding(4, context_length=8, theta=10_000.0)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(rope(x, torch.tensor([0])), x)
    # position 1, pair 0 rotates by angle 1 rad, pair 1 by 10000^(-2/4) = 0.01 rad
    import math

    c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expected = torch.tensor([[1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1]])
    torch.testing.assert_close(rope(x, torch.tensor([1])), expected)


def test_adamw_overfits_one_tiny_batch():
    torch.manual_seed(0)
    lm = model.build("tiny", vocab_size=64, context_length=16)
    tokens = torch.randint(0, 64, (4, 16))
    targets = torch.randint(0, 64, (4, 16))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lm(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.5  # ~ln(64) at init
    assert losses[-1] < 0.1 * losses[0]


def test_attention_keeps_token_major_layouts():
    """q, k, v reach the kernel as (B, H, T, d) views of (B, T, H, d) memory, v not a view of the qkv
    projection: so the backward keeps no qkv output and output_proj's input is a view of the attention's."""
    lm = model.build("tiny", context_length=16)
    seen = {}

    def spy(q, k, v, is_causal):
        seen.update(q=q, k=k, v=v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    attn = lm.layers[0].attn
    attn.attention_fn = spy
    x = torch.randn(2, 16, 64)
    out = attn(x, torch.arange(16))
    assert out.shape == (2, 16, 64)
    for name in ("q", "k", "v"):
        t = seen[name]
        assert t.shape == (2, 4, 16, 16)
        assert t.transpose(1, 2).is_contiguous(), name  # token-major memory
    # each its own (B, T, H, d) tensor: a view of the (B, T, 3d) projection output would keep all of it
    assert all(seen[n]._base is not None and seen[n]._base.numel() == seen[n].numel() for n in "qkv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_is_the_pair_formula_bit_for_bit(dtype):
    """x * C + swap(x) * S against the even/odd pair formula: the same products and sums, so equal exactly."""
    torch.manual_seed(0)
    rope = model.RotaryEmbedding(16, context_length=32, theta=10_000.0)
    x = torch.randn(2, 32, 3, 16).to(dtype)
    positions = torch.arange(32)[:, None]
    inv_freq = 10_000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    angles = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype)  # (T, 1, d/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    want = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    assert torch.equal(rope(x, positions), want)
