"""Float8 Linear layers through torchao (cs336_systems.float8): which modules convert, the step with
AdamWMaster and with Hugging Face's Llama, and the reasons a device cannot train in float8.  On a CPU the
float8 casts are emulated (torchao's emulate mode): the same numerics path, float32 matmuls."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cs336_systems import float8, model
from cs336_systems.bench.workloads import lm

torchao = pytest.importorskip("torchao", reason=f"float8 training needs torchao: {float8.INSTALL}")


def tiny():
    torch.manual_seed(0)
    return model.build("tiny", attention="naive", vocab_size=64, context_length=32)


@pytest.mark.parametrize("precision", ["fp8-tensorwise", "fp8-rowwise"])
def test_every_block_linear_converts_and_the_head_stays(precision):
    lm_model = tiny()
    linears = {name for name, m in lm_model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = float8.convert_linears(lm_model, precision)
    assert set(names) == linears - {"lm_head"} and names == float8.converted(lm_model)
    assert float8.convert_linears(tiny(), "bf16") == []
    with pytest.raises(ValueError, match="unknown linear precision 'fp8'"):
        float8.convert_linears(tiny(), "fp8")


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-master"])
def test_a_float8_train_step_runs_and_learns(optimizer):
    step = lm.lm_step(size="tiny", context=32, batch_size=2, mode="train-step", precision="bf16", attention="sdpa",
                      vocab_size=64, optimizer=optimizer, linear_precision="fp8-rowwise")
    weight = step.model.layers[0].attn.qkv_proj.weight
    before = weight.detach().clone()
    step()
    assert not torch.equal(before, weight.detach())  # the optimizer updated the converted layer's weight
    assert "layers.0.attn.qkv_proj" in float8.converted(step.model)
    with pytest.raises(ValueError, match="precision must be 'bf16'"):
        lm.lm_step(size="tiny", context=32, batch_size=2, mode="forward", precision="fp32",
                   linear_precision="fp8-rowwise")


def test_hugging_faces_llama_converts_the_same_way():
    pytest.importorskip("transformers")
    step = lm.lm_step(size="tiny", context=32, batch_size=2, mode="train-step", precision="bf16", attention="sdpa",
                      vocab_size=64, impl="hf-llama", linear_precision="fp8-tensorwise")
    step()
    names = float8.converted(step.model)
    assert names and not any(name.endswith("lm_head") for name in names)


def test_reasons_a_device_cannot_train_in_float8(monkeypatch):
    assert float8.unavailable_reason("bf16", "cpu") is None
    assert float8.unavailable_reason("fp8-rowwise", "cpu") is None  # emulated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert "compute capability 8.9 or more; this GPU has 8.0" in float8.unavailable_reason("fp8-rowwise", "cuda:0")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "needs torchao" in float8.unavailable_reason("fp8-tensorwise", "cpu")
    with pytest.raises(ValueError, match="needs torchao"):
        float8.convert_linears(tiny(), "fp8-tensorwise")


def test_float8_layers_under_activation_checkpointing_give_the_same_gradients():
    """Recomputing a checkpointed block recomputes its float8 casts (dynamic scales: the same ones), so the
    gradients equal those of the run without checkpointing."""
    grads = []
    for policy in ("none", "every-1"):
        torch.manual_seed(0)
        lm_model = model.build("tiny", attention="naive", vocab_size=64, context_length=32, checkpoint=policy)
        float8.convert_linears(lm_model, "fp8-rowwise")
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        loss = torch.nn.functional.cross_entropy(lm_model(tokens).flatten(0, 1), tokens.flatten())
        grads.append(torch.autograd.grad(loss, list(lm_model.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_a_float8_model_and_its_adamw_master_state_round_trip_through_state_dicts(tmp_path):
    from cs336_systems.optim.adamw_master import AdamWMaster, linear_weights

    def trained():
        torch.manual_seed(0)
        lm_model = model.build("tiny", attention="naive", vocab_size=64, context_length=32)
        float8.convert_linears(lm_model, "fp8-tensorwise")
        opt = AdamWMaster(lm_model.parameters(), lr=1e-3, compute_params=linear_weights(lm_model))
        return lm_model, opt

    def step(lm_model, opt, seed):
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(lm_model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    first, first_opt = trained()
    step(first, first_opt, 1)
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    second, second_opt = trained()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    second.load_state_dict(saved["model"])
    second_opt.load_state_dict(saved["opt"])
    for lm_model, opt in ((first, first_opt), (second, second_opt)):
        step(lm_model, opt, 2)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_loss_curve_tool_trains_each_precision_on_the_same_batches_and_judges_them(tmp_path):
    import json

    from cs336_systems.tools import float8_loss

    data, source = float8_loss.stdlib_bytes(2**20)
    assert source["files"] > 10 and data.numel() == source["bytes"] <= 2**20 and int(data.max()) < 256
    out = tmp_path / "loss.json"
    assert float8_loss.main(["--steps", "12", "--window", "4", "--context", "16", "--batch", "2", "--device", "cpu",
                             "--data-bytes", str(2**20), "--precisions", "bf16,fp8-rowwise", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["precision"], r["seed"]) for r in result["runs"]] == [("bf16", 0), ("bf16", 1), ("fp8-rowwise", 0)]
    assert all(len(r["losses"]) == 12 for r in result["runs"])
    assert set(result["verdict"]["agrees"]) == {"fp8-rowwise seed 0"} and result["verdict"]["over_steps"] == [6, 12]
    assert result["command"].startswith("python -m cs336_systems.tools.float8_loss --steps 12")
    with pytest.raises(ValueError, match="two seeds"):
        float8_loss.verdict(result["runs"][:1] + result["runs"][2:], 4)


def test_the_gemm_count_tool_times_each_block_linear_in_each_precision_and_predicts_the_step(tmp_path):
    import json

    from cs336_systems.tools import float8_gemms

    assert float8_gemms.block_linears("2.7B") == [("qkv_proj", 2560, 7680), ("output_proj", 2560, 2560),
                                                  ("ffn.w13", 2560, 20480), ("ffn.w2", 10240, 2560)]
    # the block's Linears are the model's: same names and shapes
    block = model.build("tiny", attention="naive", vocab_size=64, context_length=32).layers[0]
    linears = {name: (m.in_features, m.out_features) for name, m in block.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 4 and all(
        [shape for name, shape in linears.items() if name.endswith(tool_name)] == [(fin, fout)]
        for tool_name, fin, fout in float8_gemms.block_linears("tiny"))
    out = tmp_path / "gemms.json"
    assert float8_gemms.main(["--sizes", "tiny", "--tokens", "32", "--eager", "--warmup", "1", "--rounds", "2",
                              "--precisions", "bf16,fp8-rowwise", "--step-ms", "tiny=100", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert [row["linear"] for row in result["linears"]] == ["qkv_proj", "output_proj", "ffn.w13", "ffn.w2"]
    for row in result["linears"]:
        assert set(row["gemm_ms"]) == set(row["layer_ms"]) == {"bf16", "fp8-rowwise"}
        assert all(value > 0 for value in [*row["gemm_ms"].values(), *row["layer_ms"].values()])
    for recipe, saving in result["saving"].items():
        expected = result["n_layers"] * sum(row["layer_ms"]["bf16"] - row["layer_ms"][recipe]
                                            for row in result["linears"])
        assert saving["layer_ms_per_step"] == pytest.approx(expected)
        assert result["predicted_step_ms"][recipe] == pytest.approx(100 - expected)
    with pytest.raises(SystemExit):
        float8_gemms.main(["--step-ms", "tiny:100", "--out", str(out)])


def test_the_gemm_count_tool_times_float8_gemms_that_compute_the_bf16_products():
    from cs336_systems.tools import float8_gemms

    device = torch.device("cpu")
    ref = float8_gemms._gemm_step(32, 64, 48, "bf16", device)()
    for recipe in float8_gemms.RECIPES:
        got = float8_gemms._gemm_step(32, 64, 48, recipe, device)()
        for a, b in zip(got, ref):
            assert a.shape == b.shape and a.dtype == torch.bfloat16
            # float8 operands (3 mantissa bits; 2 for the e5m2 gradient): a few percent of the norm
            assert (a.float() - b.float()).norm() <= 0.15 * b.float().norm()


@pytest.mark.gpu
def test_on_a_gpu_a_few_float8_steps_track_the_bf16_loss():
    from cs336_systems.tools import float8_loss

    device = torch.device("cuda")
    if float8.unavailable_reason("fp8-tensorwise", device):
        pytest.skip(float8.unavailable_reason("fp8-tensorwise", device))
    data, _ = float8_loss.stdlib_bytes(2**22)
    runs = {precision: float8_loss.train(data, precision=precision, seed=0, steps=40, size="tiny", context=128,
                                         batch=16, lr=3e-3, data_seed=0, device=device)
            for precision in ("bf16", *float8.PRECISIONS[1:])}
    start = sum(runs["bf16"][:5]) / 5
    for precision, losses in runs.items():
        end = sum(losses[-10:]) / 10
        assert end < start - 1.0, (precision, start, end)  # it learns
        bf16_end = sum(runs["bf16"][-10:]) / 10
        assert abs(end - bf16_end) <= 0.05 * bf16_end, (precision, end, bf16_end)
