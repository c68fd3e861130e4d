"""Kernel profiles per phase (cs336_systems.tools.kernel_summary summaries, the cs336_systems.tools.profile CLI), on CPU.

The CUDA attribution path (kernels placed by their launch time) is checked on a synthetic trace, since no
GPU is available here; the CPU path runs through the real torch.profiler on the tiny model.
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from cs336_systems.tools import profile as prof_cli
from cs336_systems.tools import kernel_summary as profiling
from cs336_systems.bench.workloads import lm as workloads
from cs336_systems.model import SIZES

TINY = SIZES["tiny"]
CONTEXT, BATCH, STEPS = 32, 2, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from intra-op threads; on a shared machine the threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- categories ------------------------------------------------------------------------------
H100_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "matmul",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "matmul",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "flash_fwd_kernel": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t> >(Flash_fwd_params)": "matmul",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 64, true, true>::Params)": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "softmax",
    "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<8, float, float, float, at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)": "softmax",
    "triton_per_fused__softmax_0": "softmax",
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>)": "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float*, float, float, float, float, float, float, bool*, float*>(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float*, float, float, float, float, float, float, bool*, float*)": "elementwise",
    "triton_poi_fused_add_mul_silu_0": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)": "reduction",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "reduction",
    "triton_red_fused_sum_1": "reduction",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, float const*, float const*, float const*, float*, float*, float*)": "reduction",
    "void nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)": "reduction",
    "Memcpy DtoD (Device -> Device)": "other",
    "Memset (Device)": "other",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(at::cuda::detail::TensorInfo<float, unsigned int>, at::cuda::detail::TensorInfo<float, unsigned int>, at::cuda::detail::TensorInfo<long, unsigned int>, int, int, unsigned int, unsigned int, long)": "other",
}
CPU_OP_NAMES = {
    "aten::mm": "matmul", "aten::bmm": "matmul", "aten::addmm": "matmul", "aten::linear": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "matmul", "aten::_softmax": "softmax",
    "aten::_log_softmax_backward_data": "softmax", "aten::mul_": "elementwise", "aten::silu_backward": "elementwise",
    "aten::_foreach_addcdiv_": "elementwise", "aten::copy_": "elementwise", "aten::sum": "reduction",
    "aten::_fused_rms_norm": "reduction", "aten::nll_loss_forward": "reduction", "aten::view": "other",
    "aten::embedding_dense_backward": "other", "autograd::engine::evaluate_function: MmBackward0": "other",
}


@pytest.mark.parametrize("name, category", [*H100_NAMES.items(), *CPU_OP_NAMES.items()])
def test_categories_of_real_kernel_and_op_names(name, category):
    assert profiling.categorize(name) == category


def test_short_names_drop_namespaces_and_keep_the_telling_functor():
    short = profiling.short_name
    assert short(next(n for n in H100_NAMES if "MulFunctor" in n)) == "vectorized_elementwise_kernel<MulFunctor>"
    assert short(next(n for n in H100_NAMES if "SoftMaxForward" in n)) == "cunn_SoftMaxForward<SoftMaxForwardEpilogue>"
    assert short(next(n for n in H100_NAMES if "MeanOps" in n)) == "reduce_kernel<MeanOps>"
    long = next(n for n in H100_NAMES if n.startswith("sm90_xmma"))
    assert len(short(long, width=40)) == 40 and short(long, width=40).startswith("sm90_xmma_gemm")
    assert short("aten::mm") == "aten::mm"
    with pytest.raises(TypeError, match="name must be a str"):
        profiling.categorize(3)


# ---- attribution on a synthetic CUDA trace ---------------------------------------------------
def _event(name, start, end, *, gpu=False, annotation=False, id=0, linked=0, self_us=None, activity=None):
    return SimpleNamespace(
        name=name, device_type=DeviceType.CUDA if gpu else DeviceType.CPU, is_user_annotation=annotation,
        id=id, linked_correlation_id=linked, time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=end - start if self_us is None else self_us, is_async=False, activity_type=activity,
    )


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
SOFTMAX = next(n for n in H100_NAMES if "SoftMaxForward" in n)


def _synthetic_cuda_trace():
    """Main thread: step [0, 1000] > forward [0, 300], backward [300, 800], optimizer [800, 950]; backward
    ops launch from another thread; kernels run on the GPU long after their launch (times in us)."""
    ann = dict(annotation=True, activity="user_annotation")
    return [
        _event("step", 0, 1000, **ann), _event("forward", 0, 300, **ann), _event("backward", 300, 800, **ann),
        _event("optimizer", 800, 950, **ann),
        _event("softmax", 150, 250, **ann),  # an attention sub-step inside forward
        # forward: a GEMM launched at t=12 that runs at GPU t=400..500, while the CPU is inside "backward"
        _event("aten::mm", 10, 20, id=1), _event("cudaLaunchKernel", 12, 14, id=101, linked=1),
        _event(GEMM, 400, 500, gpu=True, id=101, linked=1, activity="kernel"),
        _event("aten::_softmax", 200, 210, id=2), _event("cudaLaunchKernel", 205, 206, id=102, linked=2),
        _event(SOFTMAX, 500, 520, gpu=True, id=102, linked=2, activity="kernel"),
        # the GPU projection of "forward" is not work
        _event("forward", 400, 520, gpu=True, annotation=True, activity="gpu_user_annotation"),
        # backward: launched from autograd's thread (its own ranges do not include "backward")
        _event("aten::mm", 350, 360, id=3), _event("cudaLaunchKernel", 352, 353, id=103, linked=3),
        _event(GEMM, 600, 700, gpu=True, id=103, linked=3, activity="kernel"),
        # optimizer: the runtime call is missing, the launching op's start stands in
        _event("aten::_fused_adamw_", 810, 820, id=4),
        _event("multi_tensor_apply_kernel", 900, 905, gpu=True, id=104, linked=4, activity="kernel"),
        # inside "step" but in no phase
        _event("cudaMemsetAsync", 960, 961, id=106, linked=5), _event("aten::zero_", 955, 965, id=5),
        _event("Memset (Device)", 970, 972, gpu=True, id=106, linked=5, activity="gpu_memset"),
        # no launch and no op: unattributed; launched after every range: outside
        _event("orphan_kernel", 980, 983, gpu=True, id=105, linked=99, activity="kernel"),
        _event("aten::add", 1100, 1110, id=6), _event("cudaLaunchKernel", 1101, 1102, id=107, linked=6),
        _event("vectorized_elementwise_kernel", 1200, 1207, gpu=True, id=107, linked=6, activity="kernel"),
    ]


def test_cuda_kernels_are_attributed_by_launch_time_not_execution_time():
    s = profiling.summarize_events(_synthetic_cuda_trace(), device="cuda")
    fwd, bwd, opt, step = (s.ranges[n] for n in ("forward", "backward", "optimizer", "step"))
    assert {k.name: k.calls for k in fwd.kernels} == {GEMM: 1, SOFTMAX: 1}
    assert fwd.total_ms == pytest.approx(0.120) and fwd.span_ms == pytest.approx(0.120)
    assert fwd.category_ms["matmul"] == pytest.approx(0.100) and fwd.category_ms["softmax"] == pytest.approx(0.020)
    assert [(k.name, k.calls) for k in bwd.kernels] == [(GEMM, 1)] and bwd.total_ms == pytest.approx(0.100)
    assert [k.name for k in opt.kernels] == ["multi_tensor_apply_kernel"] and opt.total_ms == pytest.approx(0.005)
    assert opt.category_share["elementwise"] == 1.0
    assert step.total_ms == pytest.approx(0.120 + 0.100 + 0.005 + 0.002)  # the memset: in the step, no phase
    assert step.calls == 5 and step.span_ms == pytest.approx(0.572)  # GPU 400 .. 972
    assert [k.name for k in s.ranges["softmax"].kernels] == [SOFTMAX]
    assert s.unattributed_ms == pytest.approx(0.003) and s.outside_ranges_ms == pytest.approx(0.007)
    assert [k.share for k in fwd.kernels] == pytest.approx([100 / 120, 20 / 120])


def test_cpu_summary_uses_self_time_and_merges_nested_same_name_ranges():
    ann = dict(annotation=True, activity="user_annotation")
    events = [
        _event("forward", 0, 100, **ann), _event("forward", 10, 40, **ann),  # nested: one occurrence
        _event("aten::linear", 5, 60, self_us=5), _event("aten::mm", 6, 58, self_us=52),
        _event("forward", 200, 300, **ann), _event("aten::mm", 210, 260, self_us=50),
        _event("cudaLaunchKernel", 212, 213, id=9, linked=3),  # a runtime call is not an op
    ]
    s = profiling.summarize_events(events, device="cpu", top_k=1)
    fwd = s.ranges["forward"]
    assert fwd.occurrences == 2 and fwd.calls == 3 and fwd.total_ms == pytest.approx(0.107)
    assert [(k.name, k.calls) for k in fwd.kernels] == [("aten::mm", 2)] and fwd.distinct_kernels == 2
    assert fwd.calls_per_occurrence(fwd.kernels[0]) == 1.0
    assert fwd.category_ms["matmul"] == pytest.approx(0.107)


def test_summary_argument_errors():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        profiling.summarize_events([], device="tpu")
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        profiling.summarize_events([], device="cpu", top_k=0)


# ---- the phased step and the ranges ----------------------------------------------------------
def test_phased_step_is_the_benchmark_step():
    case = prof_cli.Case(size="tiny", context=16, batch_size=2, mode="train-step")
    phased, plain = prof_cli.PhasedStep(case), workloads.lm_step(**vars(case))
    phased()
    plain()
    for a, b in zip(phased.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = prof_cli.PhasedStep(prof_cli.Case(size="tiny", context=16, batch_size=2, mode="train-step", seed=1))
    other()  # a different batch moves the parameters elsewhere: the comparison above can fail
    assert any(not torch.equal(a, b) for a, b in zip(other.model.parameters(), plain.model.parameters()))


def test_measured_range_holds_exactly_the_steps_after_warmup():
    step = prof_cli.PhasedStep(prof_cli.Case(size="tiny", context=8, batch_size=1, mode="forward-backward"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prof_cli.run_ranges(step, warmup=1, steps=2)
    ranges = {}
    for e in prof.events():
        if e.is_user_annotation:
            ranges.setdefault(e.name, []).append((e.time_range.start, e.time_range.end))
    (measured,), (warmup,) = ranges["measured"], ranges["warmup"]
    inside = [s for s in ranges["step"] if measured[0] <= s[0] and s[1] <= measured[1]]
    assert len(ranges["step"]) == 3 and len(inside) == 2 and warmup[1] <= measured[0]
    assert len(ranges["forward"]) == len(ranges["backward"]) == 3 and "optimizer" not in ranges


# ---- the CLI on the tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    paths = {k: out / f"report.{k}" for k in ("json", "md")} | {"trace": out / "trace.json"}
    argv = ["--size", "tiny", "--context", str(CONTEXT), "--batch-size", str(BATCH), "--mode", "train-step",
            "--precision", "fp32", "--device", "cpu", "--warmup", "1", "--steps", str(STEPS), "--rounds", "2",
            "--top-k", "1000", "--json", str(paths["json"]), "--md", str(paths["md"]), "--trace", str(paths["trace"])]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert prof_cli.main(argv) == 0
    report = prof_cli.ProfileReport.from_dict(json.loads(paths["json"].read_text()))
    return report, paths, stdout.getvalue()


def test_cli_profiles_every_phase_of_train_step_and_the_forward_case(cli_run):
    report, _, _ = cli_run
    assert list(report.cases) == ["train-step", "forward"]
    train, fwd = report.cases["train-step"].summary, report.cases["forward"].summary
    assert [r.name for r in train.phases()] == ["forward", "backward", "optimizer"]
    assert [r.name for r in fwd.phases()] == ["forward"]
    for summary in (train, fwd):
        assert summary.device == "cpu" and summary.unattributed_ms == 0
        for r in summary.ranges.values():
            assert r.total_ms > 0 and r.calls > 0 and all(k.calls > 0 for k in r.kernels)
            assert sum(r.category_share.values()) == pytest.approx(1.0)
            assert sum(k.share for k in r.kernels) == pytest.approx(1.0)  # --top-k 1000 lists them all
            assert sum(k.total_ms for k in r.kernels) == pytest.approx(r.total_ms)
        assert summary.ranges["step"].occurrences == STEPS
        # zero_grad(set_to_none) runs no op: the phases partition the step
        assert sum(p.total_ms for p in summary.phases()) == pytest.approx(summary.ranges["step"].total_ms)


def test_cli_counts_match_the_model(cli_run):
    report, _, _ = cli_run
    layers = TINY["n_layers"]
    fwd = report.cases["forward"].summary
    calls = {k.name: fwd.ranges["forward"].calls_per_occurrence(k) for k in fwd.ranges["forward"].kernels}
    assert calls["aten::mm"] == 4 * layers + 1  # qkv, out, w13, w2 per layer + LM head
    assert calls["aten::bmm"] == 2 * layers  # QK^T and PV
    assert calls["aten::_softmax"] == layers
    assert fwd.ranges["softmax"].occurrences == layers * STEPS
    train = report.cases["train-step"].summary
    assert any(k.name == "aten::_log_softmax" for k in train.ranges["forward"].kernels)  # the loss
    assert train.ranges["optimizer"].category_share["elementwise"] > 0.5


def test_cli_answers(cli_run):
    report, _, _ = cli_run
    a = report.answers
    for key, mode in (("forward_time", "forward"), ("step_time", "train-step")):
        t, result = a[key], report.cases[mode]
        assert t["mode"] == mode and t["harness_median_ms"] == result.harness["median_ms"] > 0
        assert t["profiled_span_ms"] == result.summary.ranges["step"].span_ms > 0
        assert t["ratio"] == pytest.approx(t["profiled_span_ms"] / t["harness_median_ms"])
        assert t["gpu_busy_share"] == pytest.approx(t["profiled_busy_ms"] / t["profiled_span_ms"])
        assert t["verdict"] == prof_cli._verdict(t["ratio"], t["gpu_busy_share"])
    fwd_range = report.cases["forward"].summary.ranges["forward"]
    assert a["dominant_forward"]["name"] == fwd_range.kernels[0].name
    assert a["dominant_forward"]["calls_per_occurrence"] == fwd_range.kernels[0].calls / STEPS
    assert set(a["matmul_share"]) == {"train-step", "forward"}
    assert all(0 < s < 1 for s in a["matmul_share"].values())
    att = a["attention"]
    d_head = TINY["d_model"] // TINY["n_heads"]
    assert att["available"] and att["flop_ratio_matmul_over_softmax"] == pytest.approx(0.8 * d_head)
    scores_matmul = report.cases["forward"].summary.ranges["attention scores"].category_ms["matmul"]
    final_matmul = report.cases["forward"].summary.ranges["final matmul"].category_ms["matmul"]
    assert att["matmul_ms"] == pytest.approx((scores_matmul + final_matmul) / STEPS)
    assert att["matmul_flops"] == TINY["n_layers"] * 4 * BATCH * TINY["n_heads"] * CONTEXT**2 * d_head


def test_cli_writes_json_markdown_and_trace(cli_run):
    report, paths, stdout = cli_run
    data = json.loads(paths["json"].read_text())
    assert report.to_dict() == data  # JSON round-trips through the dataclasses
    md = paths["md"].read_text()
    assert md == stdout
    for needle in ("## Answers", "#### forward", "#### backward", "#### optimizer", "#### softmax",
                   "| kernel | category | calls | ms | share |", "| category | ms | share |", "`aten::mm`"):
        assert needle in md
    for trace in (paths["trace"], paths["trace"].with_name("trace.forward.json")):
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {"step", "forward", "aten::mm"} <= names


def test_nvtx_only_mode_runs_the_ranges_without_profiler(capsys):
    argv = ["--size", "tiny", "--context", "8", "--batch-size", "1", "--mode", "forward", "--device", "cpu",
            "--warmup", "1", "--steps", "1", "--profiler", "nvtx"]
    assert prof_cli.main(argv) == 0
    assert "inside NVTX range 'measured'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value, message",
    [("--size", "huge", "invalid choice: 'huge'"), ("--mode", "inference", "invalid choice: 'inference'"),
     ("--precision", "fp8", "invalid choice: 'fp8'"), ("--context", "0", "must be >= 1, got 0"),
     ("--device", "tpu", "device must be cpu or cuda"), ("--md", "/proc/report.md", "--md: cannot write"),
     ("--json", "/", "--json: / is a directory"), ("--trace", "/no/such/dir/t.json", "--trace: cannot write")],
)
def test_cli_rejects_bad_arguments(flag, value, message, capsys):
    argv = {"--size": "tiny", "--context": "8", "--mode": "forward", "--precision": "fp32", "--device": "cpu"}
    argv[flag] = value
    with pytest.raises(SystemExit) as exc:
        prof_cli.main([x for kv in argv.items() for x in kv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_case_validation():
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        prof_cli.Case(size="huge", context=8, batch_size=1, mode="forward")
    with pytest.raises(ValueError, match="unknown mode 'inference'"):
        prof_cli.Case(size="tiny", context=8, batch_size=1, mode="inference")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        prof_cli.Case(size="tiny", context=8, batch_size=1, mode="forward", precision="fp8")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        prof_cli.Case(size="tiny", context=8, batch_size=0, mode="forward")
    with pytest.raises(TypeError, match="context must be an int"):
        prof_cli.Case(size="tiny", context=8.0, batch_size=1, mode="forward")


def test_attention_answer_needs_the_naive_sub_step_ranges(cli_run):
    report, _, _ = cli_run
    result = report.cases["forward"]
    ranges = {n: r for n, r in result.summary.ranges.items() if n not in profiling.ATTENTION_SUBSTEPS}
    sdpa_like = prof_cli.CaseResult(
        prof_cli.Case(**{**vars(result.case), "attention": "sdpa"}), result.warmup, result.steps,
        profiling.KernelSummary("cpu", ranges), result.harness,
    )
    att = prof_cli.answers({"forward": sdpa_like}, "forward")["attention"]
    assert not att["available"] and "'sdpa' has no" in att["reason"] and "--attention naive" in att["reason"]
    assert "- Attention: n/a" in prof_cli._answer_lines({**report.answers, "attention": att})[-1]
    # naive, but compiled: the advice is to drop --compile, not to pick the attention already picked
    compiled = prof_cli.CaseResult(
        prof_cli.Case(**{**vars(result.case), "compile": True}), result.warmup, result.steps,
        profiling.KernelSummary("cpu", ranges), result.harness,
    )
    att = prof_cli.answers({"forward": compiled}, "forward")["attention"]
    assert not att["available"] and "without --compile" in att["reason"] and "--attention naive" not in att["reason"]


def test_out_of_memory_becomes_a_message(monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(prof_cli, "profile", oom)
    assert prof_cli.main(["--size", "tiny", "--context", "8", "--device", "cpu"]) == 1
    assert "out of memory profiling" in capsys.readouterr().err


def test_raw_kineto_events_carry_the_fields_the_cuda_path_reads():
    """The CUDA summary reads the raw Kineto events (their kernel -> launch link exists in every torch 2.x;
    FunctionEvents of torch 2.11 lack it, which left every kernel of the H100 run unattributed)."""
    from cs336_systems.tools import kernel_summary as profiling

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("forward"):
            x = torch.randn(32, 32)
            (x @ x).sum()
    events = profiling._kineto_events(prof)
    assert events, "no raw events"
    forward = [e for e in events if e.name == "forward"]
    assert len(forward) == 1 and forward[0].is_user_annotation
    ops = [e for e in events if e.name == "aten::mm"]
    assert ops and all(e.linked_correlation_id == 0 and not e.is_user_annotation for e in ops)
    # ops nest inside the range on the same (microsecond) clock
    assert forward[0].time_range.start <= ops[0].time_range.start <= ops[0].time_range.end <= forward[0].time_range.end


def test_timing_verdicts():
    assert prof_cli._verdict(None, 0.5) == "no harness timing"
    assert prof_cli._verdict(1.04, 0.3) == "agree within 5%"
    assert prof_cli._verdict(0.96, 0.99) == "agree within 5%"
    host = prof_cli._verdict(1.237, 49.652 / 129.233)  # the xl forward on the H100
    assert host.startswith("differ: host-bound step (kernels busy 38% of the span)")
    assert prof_cli._verdict(1.3, 0.95).startswith("differ although the GPU is busy")
