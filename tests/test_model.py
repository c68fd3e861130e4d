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
