"""FLOP formulas and MFU."""

import pytest
import torch

from cs336_systems import model
from cs336_systems.bench import flops
from cs336_systems.bench import machine


@pytest.mark.parametrize("size", list(model.SIZES))
def test_matmul_parameters_match_the_module(size):
    with torch.device("meta"):
        lm = model.build(size)
    assert flops.matmul_parameters(lm.config) == flops.count_matmul_parameters(lm)
    # everything but the embedding and the norm gains
    cfg = lm.config
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert flops.count_matmul_parameters(lm) == model.count_parameters(lm) - cfg.vocab_size * cfg.d_model - norms


def test_lm_flops_by_hand():
    cfg = model.ModelConfig(d_model=4, d_ff=8, n_layers=2, n_heads=2, vocab_size=10)
    n = 2 * (4 * 16 + 3 * 4 * 8) + 4 * 10  # 360
    b, t = 3, 5
    forward = 2 * n * b * t + 4 * 2 * t * 4 * b * t * 0.5
    assert flops.lm_flops(cfg, b, t, "forward") == forward
    assert flops.lm_flops(cfg, b, t, "forward-backward") == 3 * forward
    assert flops.lm_flops(cfg, b, t, "train-step") == 3 * forward


def test_attention_flops_conventions():
    fwd = flops.attention_flops(16, 1024, 1024, 64, causal=False)
    assert fwd == 4 * 16 * 1024 * 1024 * 64
    assert flops.attention_flops(16, 1024, 1024, 64, causal=True) == fwd / 2
    # Nq != Nk: the causal area follows the mask (query i sees keys j <= i), not half of Nq x Nk
    for nq, nk in [(128, 1024), (1024, 128), (1, 4096), (300, 301), (4096, 1)]:
        exact_pairs = sum(min(i + 1, nk) for i in range(nq))
        got_pairs = flops.attention_flops(1, nq, nk, 1, causal=True) / 4
        assert abs(got_pairs - exact_pairs) <= min(nq, nk) / 2, (nq, nk, got_pairs, exact_pairs)
    assert flops.attention_flops(16, 1024, 1024, 64, causal=False, mode="backward") == 2.5 * fwd
    assert flops.attention_flops(16, 1024, 1024, 64, causal=False, mode="forward-backward") == 3.5 * fwd


def test_unknown_modes_raise():
    cfg = model.config("tiny")
    with pytest.raises(ValueError, match="unknown mode 'sideways'"):
        flops.lm_flops(cfg, 1, 8, "sideways")
    with pytest.raises(ValueError, match="unknown mode 'both'"):
        flops.attention_flops(1, 8, 8, 8, causal=True, mode="both")


def test_mfu_and_peak_lookup():
    assert flops.mfu(989.4e12 * 0.5, 1.0, 989.4) == pytest.approx(0.5)
    assert flops.mfu(1e12, 1.0, None) is None
    assert machine.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert machine.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert machine.peak_tflops("NVIDIA H200", "fp32") == 66.9
    assert machine.peak_tflops("Some Future GPU", "bf16") is None
    assert machine.peak_tflops(None, "bf16") is None
