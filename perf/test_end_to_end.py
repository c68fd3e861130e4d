"""End-to-end LM benchmarks (cases from benchmarks.json).

end_to_end    size x context x batch x mode x precision x eager/compiled x implementation: our model ("own") or a
              baseline of the same size ("hf-llama": transformers' LlamaForCausalLM), timed in the same run
              x optimizer ("adamw": torch's fused AdamW, float32 weights; "adamw-master": bf16 compute weights,
              float32 masters in cs336_systems.optim.AdamWMaster, split into the weight and its low bits;
              "adamw-master-fp32": the same with float32 copies as masters).
              A baseline whose package is missing is skipped with the install command as the reason.
checkpointing the same step per activation-checkpointing policy (none, every-k, sqrt, nested): time and peak memory
warmup_study  the same step measured after 0, 1, 2, 5 warm-up steps.  With no warm-up the measured
              steps include allocator growth, cuBLAS/cuDNN heuristics and (compiled) compilation: a
              higher mean and a much larger std.  Each case builds a fresh model and resets dynamo, but
              the process's CUDA context exists once any case has run, so the 0-warm-up numbers
              understate a cold process's first step.
"""

import pytest

from cs336_systems import model
from cs336_systems.bench import flops
from cs336_systems.bench.workloads import lm as workloads


def _run_lm_case(case, bench, device):
    impl = case.get("impl", workloads.DEFAULT_IMPL)
    reason = workloads.unavailable_reason(impl)
    if reason is not None:
        pytest.skip(reason)
    # The baselines have our model's parameters (tests/bench/test_hf_llama.py), hence its FLOPs per step.
    cfg = model.config(case["size"], context_length=case["context"], attention=case["attention"])
    bench(
        lambda: workloads.lm_step(
            size=case["size"], context=case["context"], batch_size=case["batch_size"],
            mode=case["mode"], precision=case["precision"], compile=case["compile"],
            attention=case["attention"], checkpoint=case.get("checkpoint", "none"), device=device, impl=impl,
            optimizer=case.get("optimizer", workloads.DEFAULT_OPTIMIZER), cuda_graphs=case.get("cuda_graphs", False),
        ),
        case=case,
        flops_per_step=flops.lm_flops(cfg, case["batch_size"], case["context"], case["mode"]),
        tokens=case["batch_size"] * case["context"],
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
