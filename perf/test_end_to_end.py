"""End-to-end LM benchmarks (cases from benchmarks.json).

end_to_end    size x context x batch x mode x precision x eager/compiled x implementation: our model ("own") or a
              baseline of the same size ("hf-llama": transformers' LlamaForCausalLM), timed in the same run
              x optimizer ("adamw": torch's fused AdamW, float32 weights; "adamw-master": bf16 compute weights,
              float32 masters in cs336_systems.optim.AdamWMaster, split into the weight and its low bits;
              "adamw-master-fp32": the same with float32 copies as masters).
              A baseline whose package is missing is skipped with the install command as the reason.
              x packing: dense rows, or the batch's tokens as documents packed in one row or padded one a row
              (tokens/s counts the documents' tokens in both, so they compare).
checkpointing the same step per activation-checkpointing policy (none, every-k, sqrt, nested): time and peak memory
warmup_study  the same step measured after 0, 1, 2, 5 warm-up steps.  With no warm-up the measured
              steps include allocator growth, cuBLAS/cuDNN heuristics and (compiled) compilation: a
              higher mean and a much larger std.  Each case builds a fresh model and resets dynamo, but
              the process's CUDA context exists once any case has run, so the 0-warm-up numbers
              understate a cold process's first step.
"""

import pytest

from cs336_systems import float8, model
from cs336_systems.bench import flops
from cs336_systems.bench.workloads import lm as workloads


def _run_lm_case(case, bench, device):
    impl = case.get("impl", workloads.DEFAULT_IMPL)
    reason = workloads.unavailable_reason(impl) or float8.unavailable_reason(
        case.get("linear_precision", float8.DEFAULT_PRECISION), device)
    if reason is not None:
        pytest.skip(reason)
    # The baselines have our model's parameters (tests/bench/test_hf_llama.py), hence its FLOPs per step.
    cfg = model.config(case["size"], context_length=case["context"], attention=case["attention"])
    packing = case.get("packing", "none")
    if packing == "packed":  # each document's FLOPs (attention within it)
        lengths = workloads.document_lengths(case["batch_size"] * case["context"], case["documents"], case["context"])
        step_flops = sum(flops.lm_flops(cfg, 1, n, case["mode"]) for n in lengths)
    elif packing == "padded":  # the work done: every row of the context, padding included
        step_flops = flops.lm_flops(cfg, case["documents"], case["context"], case["mode"])
    else:
        step_flops = flops.lm_flops(cfg, case["batch_size"], case["context"], case["mode"])
    bench(
        lambda: workloads.lm_step(
            size=case["size"], context=case["context"], batch_size=case["batch_size"],
            mode=case["mode"], precision=case["precision"], compile=case["compile"],
            attention=case["attention"], checkpoint=case.get("checkpoint", "none"), device=device, impl=impl,
            optimizer=case.get("optimizer", workloads.DEFAULT_OPTIMIZER), cuda_graphs=case.get("cuda_graphs", False),
            packing=packing, documents=case.get("documents", 16),
            linear_precision=case.get("linear_precision", float8.DEFAULT_PRECISION),
        ),
        case=case,
        flops_per_step=step_flops,
        tokens=case["batch_size"] * case["context"],  # packed and padded: the same documents' tokens
    )


@pytest.mark.suite("end_to_end")
def test_end_to_end(case, bench, perf_device):
    _run_lm_case(case, bench, perf_device)


@pytest.mark.suite("warmup_study")
def test_warmup_study(case, bench, perf_device):
    _run_lm_case(case, bench, perf_device)


@pytest.mark.suite("checkpointing")
def test_checkpointing(case, bench, perf_device):
    _run_lm_case(case, bench, perf_device)
