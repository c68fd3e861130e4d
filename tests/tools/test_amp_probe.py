"""Mixed-precision probes: the dtypes autocast gives the handout's ToyModel, and the accumulation experiment.

The answers are pinned as literals (not read from cs336_systems.amp), so a change in torch's autocast
policy or in the probe shows up here.  CPU answers were checked on torch 2.13; the CUDA answers follow
autocast's CUDA policy lists (layer_norm and the loss on the fp32 list) and run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems import amp
from cs336_systems.tools import amp_probe

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def answers(low: torch.dtype, ln: torch.dtype) -> dict[str, torch.dtype]:
    return {"parameters": F32, "fc1": low, "relu": low, "ln": ln, "logits": low, "loss": F32, "gradients": F32}


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_cpu_autocast_dtypes(dtype):
    # CPU autocast does not put layer_norm on its fp32 list: LayerNorm keeps the low-precision input dtype.
    assert amp_probe.probe_dtypes(dtype, device="cpu") == answers(dtype, ln=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_cuda_autocast_dtypes(dtype):
    # CUDA autocast runs layer_norm in fp32.
    assert amp_probe.probe_dtypes(dtype, device="cuda") == answers(dtype, ln=F32)


def test_precision_names_and_documented_table_match_the_probe():
    assert amp_probe.probe_dtypes("bf16") == amp_probe.probe_dtypes(BF16)
    for dtype in (BF16, F16):
        assert amp_probe.expected_probe(dtype, "cpu") == amp_probe.probe_dtypes(dtype, device="cpu")
        assert amp_probe.expected_probe(dtype, "cuda") == answers(dtype, ln=F32)


def test_probe_leaves_no_hooks_or_autocast_behind():
    assert amp_probe.probe_dtypes(BF16)["fc1"] == BF16
    assert not torch.is_autocast_enabled("cpu")
    model = amp_probe.ToyModel(8, 5)
    x = torch.randn(3, 8)
    assert model(x).shape == (3, 5) and model(x).dtype == F32


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"dtype": F32}, ValueError),
        ({"dtype": "fp32"}, ValueError),
        ({"dtype": "fp8"}, ValueError),
        ({"dtype": BF16, "batch": 0}, ValueError),
        ({"dtype": BF16, "in_features": 2.5}, ValueError),
    ],
)
def test_probe_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        amp_probe.probe_dtypes(**kwargs)


def test_accumulation_experiment_pinned_values():
    result = amp_probe.accumulation_experiment()
    assert [round(v, 4) for v in result] == [10.0001, 9.9531, 10.0021, 10.0021]
    # fp16 sums are exact binary fractions: 9.953125 = 10 - 3/64.
    assert result.fp16 == 9.953125
    # Promotion and the explicit upcast are the same computation.
    assert result.fp16_into_fp32 == result.fp16_upcast
    # The fp16-into-fp32 error is the fp16 representation error of 0.01, accumulated 1000 times.
    fp16_increment = float(torch.tensor(0.01, dtype=F16))
    assert result.fp16_into_fp32 == pytest.approx(1000 * fp16_increment, abs=1e-4)


def test_accumulation_experiment_other_arguments():
    assert amp_probe.accumulation_experiment(steps=0) == (0.0, 0.0, 0.0, 0.0)
    # 0.5 is exact in every format, so every variant is exact.
    assert amp_probe.accumulation_experiment(steps=8, increment=0.5) == (4.0, 4.0, 4.0, 4.0)
    with pytest.raises(ValueError, match="steps"):
        amp_probe.accumulation_experiment(steps=-1)
    with pytest.raises(TypeError, match="increment"):
        amp_probe.accumulation_experiment(increment="0.01")


def test_existing_precision_api_unchanged():
    assert amp.check_precision("bf16") == "bf16"
    with pytest.raises(ValueError):
        amp.check_precision("int8")
    assert amp.grad_scaler("bf16", "cpu") is None
    with amp.autocast("bf16", "cpu"):
        assert torch.get_autocast_dtype("cpu") == BF16
