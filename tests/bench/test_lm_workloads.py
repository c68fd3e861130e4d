"""LM workloads: each mode does what it says, on CPU."""

import pytest
import torch

from cs336_systems import amp
from cs336_systems.bench.workloads import lm as workloads


def _params(step):
    return step.model, [p.detach().clone() for p in step.model.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_step_updates_every_parameter(precision):
    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode="train-step", precision=precision)
    model, before = _params(step)
    step()
    after = list(model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(p.dtype == torch.float32 for p in after)  # master weights stay fp32 under autocast


def test_forward_changes_nothing_and_keeps_no_graph():
    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode="forward")
    model, before = _params(step)
    step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_forward_backward_fills_grads_without_updating():
    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode="forward-backward")
    model, before = _params(step)
    step()
    step()  # grads are reset each step, not accumulated
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_unknown_mode_and_precision():
    with pytest.raises(ValueError, match="unknown mode 'inference'"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="inference")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="forward", precision="fp8")


def test_precision_modes():
    assert amp.grad_scaler("fp16", "cpu") is not None
    assert amp.grad_scaler("bf16", "cpu") is None
    with amp.autocast("bf16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with amp.autocast("fp32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_compiled_forward_matches_eager():
    torch.manual_seed(0)
    from cs336_systems import model as lm_model

    eager = lm_model.build("tiny", context_length=16)
    compiled = lm_model.build("tiny", context_length=16)
    compiled.load_state_dict(eager.state_dict())
    workloads.compile_blocks(compiled)
    tokens = torch.randint(0, 10_000, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("optimizer", ["adamw-master", "adamw-master-fp32"])
@pytest.mark.parametrize("impl", ["own", "hf-llama"])
@pytest.mark.parametrize("mode", workloads.MODES)
def test_adamw_master_holds_the_linear_weights_in_bf16_in_every_mode(impl, mode, optimizer):
    if workloads.unavailable_reason(impl):
        pytest.skip(workloads.unavailable_reason(impl))
    from cs336_systems.optim.adamw_master import AdamWMaster, linear_weights

    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode=mode, precision="bf16", impl=impl,
                             optimizer=optimizer)
    gemm = {id(p) for p in linear_weights(step.model)}
    assert gemm and all(p.dtype == (torch.bfloat16 if id(p) in gemm else torch.float32)
                        for p in step.model.parameters())
    before = [p.detach().clone() for p in step.model.parameters()]
    step()
    if mode == "train-step":
        assert isinstance(step.optimizer, AdamWMaster)
        assert step.optimizer.master_format == ("split" if optimizer == "adamw-master" else "float32")
        assert all(not torch.equal(a, b) for a, b in zip(step.model.parameters(), before))
        assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in step.model.parameters()
                   if id(p) in gemm)  # gradients come out in bf16: nothing cast them back
    else:
        assert step.optimizer is None


def test_cuda_graphs_need_compile_and_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs=True needs compile=True"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="forward", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device, got device 'cpu'"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="forward", compile=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool, got 'yes'"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="forward", cuda_graphs="yes")


@pytest.mark.gpu
def test_gpu_cuda_graph_train_steps_match_the_compiled_steps():
    """Replayed as CUDA graphs, the compiled blocks compute what they compute without graphs: four train
    steps of each from the same seed give the same weights."""
    results = []
    for cuda_graphs in (False, True):
        step = workloads.lm_step(size="tiny", context=32, batch_size=2, mode="train-step", precision="bf16",
                                 compile=True, device="cuda", cuda_graphs=cuda_graphs)
        for _ in range(4):
            step()
        results.append([p.detach().float().cpu() for p in step.model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adamw_master_needs_bf16_and_unknown_optimizers_are_named():
    with pytest.raises(ValueError, match="optimizer 'adamw-master' holds bf16 compute weights: it needs precision "
                                         "'bf16', got precision 'fp16'"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="train-step", precision="fp16",
                          optimizer="adamw-master")
    with pytest.raises(ValueError, match="optimizer 'adamw-master-fp32' holds bf16 compute weights"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="train-step", precision="fp32",
                          optimizer="adamw-master-fp32")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; valid: adamw, adamw-master, adamw-master-fp32$"):
        workloads.lm_step(size="tiny", context=16, batch_size=1, mode="train-step", optimizer="sgd")


# --- packed and padded documents -------------------------------------------------------------------------

@pytest.mark.parametrize("total, documents, context", [(2048, 16, 512), (128, 4, 64), (64, 2, 32), (100, 100, 1)])
def test_document_lengths_are_a_fixed_long_tailed_draw_that_fits(total, documents, context):
    lengths = workloads.document_lengths(total, documents, context)
    assert sum(lengths) == total and len(lengths) == documents and 1 <= min(lengths) and max(lengths) <= context
    assert lengths == workloads.document_lengths(total, documents, context)  # the same draw every time
    with pytest.raises(ValueError, match="cannot hold"):
        workloads.document_lengths(total, documents, total // documents - 1 if total // documents > 1 else 0)


def test_packed_and_padded_steps_run_and_refuse_what_they_cannot_take():
    from cs336_systems.attention import flash_triton

    if not (flash_triton.KERNELS_INTERPRETED or torch.cuda.is_available()):
        pytest.skip("flash-triton needs CUDA or the interpreter (TRITON_INTERPRET=1)")
    for packing in ("packed", "padded"):
        step = workloads.lm_step(size="tiny", context=32, batch_size=2, mode="train-step", precision="fp32",
                          attention="flash-triton", packing=packing, documents=3)
        step()
    with pytest.raises(ValueError, match="unknown packing 'rows'"):
        workloads.lm_step(size="tiny", context=32, batch_size=2, mode="forward", packing="rows")
    with pytest.raises(ValueError, match="packing 'packed' runs our model only"):
        workloads.lm_step(size="tiny", context=32, batch_size=2, mode="forward", packing="packed", impl="hf-llama")
