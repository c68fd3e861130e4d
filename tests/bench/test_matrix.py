"""benchmarks.json: the repository's matrix validates; malformed matrices fail naming the problem."""

import copy
import json
from pathlib import Path

import pytest
import torch

from cs336_systems.bench import matrix
from cs336_systems.bench.matrix import MatrixError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def data():
    return json.loads((ROOT / "benchmarks.json").read_text())


def test_repository_matrix_is_valid(data):
    m = matrix.parse(data)
    for suite in m.suites:
        assert m.cases(suite, "cpu"), f"{suite} has no cpu cases: CI would measure nothing"


def test_gpu_profile_covers_the_handout_sweep(data):
    cases = matrix.parse(data).cases("end_to_end", "gpu")
    eager = {
        (c["size"], c["context"], c["mode"], c["precision"])
        for c in cases
        if not c["compile"] and c["batch_size"] == 4 and c["warmup"] == 5 and c["rounds"] == 10
    }
    for size in ("small", "medium", "large", "xl", "2.7B"):
        for context in (128, 256, 512, 1024):
            for mode in ("forward", "forward-backward", "train-step"):
                for precision in ("fp32", "bf16"):
                    assert (size, context, mode, precision) in eager
    assert any(c["compile"] and c["size"] == "2.7B" and c["mode"] == "train-step" for c in cases)


def test_cpu_profile_is_small(data):
    cases = matrix.parse(data).cases("end_to_end", "cpu")
    assert {c["size"] for c in cases} == {"tiny"}


def test_cases_are_the_product_without_duplicates():
    grid = {"sizes": ["tiny", "small"], "contexts": [8, 16], "batch_sizes": [1], "modes": ["forward"],
            "precisions": ["fp32"], "compile": [False], "warmup": 1, "rounds": 2}
    data = {"suites": {"end_to_end": {"profiles": {"cpu": [grid, copy.deepcopy(grid)]}}}}
    cases = matrix.parse(data).cases("end_to_end", "cpu")
    assert len(cases) == 4
    assert cases[0] == {"size": "tiny", "context": 8, "batch_size": 1, "mode": "forward", "precision": "fp32",
                        "compile": False, "attention": "sdpa", "impl": "own", "optimizer": "adamw", "cuda_graphs": False,
                        "packing": "none", "documents": 16, "linear_precision": "bf16", "warmup": 1, "rounds": 2,
                        "group": "default"}
    assert matrix.parse(data).cases("end_to_end", "gpu") == []


def test_a_case_shared_by_two_groups_runs_when_either_group_is_selected():
    base = {"sizes": ["tiny"], "contexts": [8], "batch_sizes": [1], "modes": ["forward"], "precisions": ["fp32"],
            "compile": [False], "warmup": 1, "rounds": 2}
    first = {**base, "contexts": [8, 16], "group": "sweep"}
    second = {**base, "group": "baseline"}  # repeats the sweep's context-8 case as its own same-run baseline
    m = matrix.parse({"suites": {"end_to_end": {"profiles": {"cpu": [first, second]}}}})
    assert [(c["context"], c["group"]) for c in m.cases("end_to_end", "cpu")] == [(8, "sweep"), (16, "sweep")]
    assert [(c["context"], c["group"]) for c in m.cases("end_to_end", "cpu", {"baseline"})] == [(8, "baseline")]
    assert len(m.cases("end_to_end", "cpu", {"sweep", "baseline"})) == 2
    assert m.cases("end_to_end", "cpu", {"nope"}) == []


def _grid(data):
    return data["suites"]["end_to_end"]["profiles"]["gpu"][1]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: _grid(d).update(sizez=["small"]), r"profiles\.gpu\[1\]: unknown key 'sizez'"),
        (lambda d: _grid(d).update(sizes=["huge"]), r"gpu\[1\]\.sizes\[0\]: unknown value 'huge'; valid: tiny"),
        (lambda d: _grid(d).update(contexts=[128, 0]), r"gpu\[1\]\.contexts\[1\]: expected a positive integer, got 0"),
        (lambda d: _grid(d).update(contexts=[]), r"gpu\[1\]\.contexts: expected a non-empty list"),
        (lambda d: _grid(d).update(modes=["backward"]), r"modes\[0\]: unknown value 'backward'"),
        (lambda d: _grid(d).update(precisions=["fp8"]), r"precisions\[0\]: unknown value 'fp8'"),
        (lambda d: _grid(d).update(compile=["yes"]), r"compile\[0\]: expected true or false"),
        (lambda d: _grid(d).update(attention=["flashy"]), r"attention\[0\]: unknown value 'flashy'"),
        (lambda d: _grid(d).update(optimizers=["adamw-master"], precisions=["bf16", "fp32"]),
         r"gpu\[1\]: optimizers \['adamw-master'\] need precision 'bf16' only, but the grid also crosses them "
         r"with precisions \['fp32'\]"),
        (lambda d: _grid(d).update(optimizers=["adamw", "adamw-master-fp32"], precisions=["fp16", "bf16"]),
         r"gpu\[1\]: optimizers \['adamw-master-fp32'\] need precision 'bf16' only, but the grid also crosses "
         r"them with precisions \['fp16'\]"),
        (lambda d: _grid(d).update(optimizers=["lion"]), r"optimizers\[0\]: unknown value 'lion'"),
        (lambda d: _grid(d).update(cuda_graphs=[True], compile=[False, True]),
         r"gpu\[1\]: cuda_graphs \[true\] needs compile \[true\] only, but the grid also crosses it with compile "
         r"false"),
        (lambda d: _grid(d).update(cuda_graphs=["yes"]), r"cuda_graphs\[0\]: expected true or false"),
        (lambda d: _grid(d).update(warmup=-1), r"gpu\[1\]\.warmup: expected an integer >= 0"),
        (lambda d: _grid(d).update(rounds=True), r"gpu\[1\]\.rounds: expected a positive integer, got True"),
        (lambda d: _grid(d).pop("rounds"), r"gpu\[1\]: missing required key 'rounds'"),
        (lambda d: d["suites"].update(bogus={"profiles": {}}), r"suites\.bogus: unknown suite 'bogus'"),
        (lambda d: d["suites"]["end_to_end"]["profiles"].update(laptop=[]), r"unknown key 'laptop'; valid: cpu"),
        (lambda d: d.update(extra=1), r"benchmarks\.json: unknown key 'extra'"),
        (lambda d: d.update(gates=[{"name": "g", "suite": "end_to_end", "numerator": {"compile": True},
                                     "denominator": {"compile": False}, "max_ratio": -1}]),
         r"gates\[0\]\.max_ratio: expected a finite positive number"),
        (lambda d: d.update(gates=[{"name": "g"}]), r"gates\[0\]: missing required key"),
    ],
)
def test_malformed_matrix_errors_name_the_problem(data, mutate, match):
    mutate(data)
    with pytest.raises(MatrixError, match=match):
        matrix.parse(data)


def test_valid_gate_is_accepted(data):
    data["gates"] = [{"name": "compile pays", "suite": "end_to_end", "numerator": {"compile": True},
                      "denominator": {"compile": False}, "max_ratio": 1.0}]
    assert matrix.parse(data).gates[0]["max_ratio"] == 1.0


def test_load_reports_invalid_json(tmp_path):
    path = tmp_path / "benchmarks.json"
    path.write_text("{ not json")
    with pytest.raises(MatrixError, match="invalid JSON"):
        matrix.load(path)


def test_unknown_suite_or_profile_in_cases(data):
    m = matrix.parse(data)
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        m.cases("nope", "cpu")
    with pytest.raises(ValueError, match="unknown profile 'laptop'"):
        m.cases("end_to_end", "laptop")


# --- attention suites -------------------------------------------------------------------------------


ATTENTION_SUITES = ("attention", "flash", "leaderboard")


def test_attention_cpu_profiles_use_only_cpu_implementations(data):
    from cs336_systems import attention

    m = matrix.parse(data)
    for suite in ATTENTION_SUITES:
        cases = m.cases(suite, "cpu")
        assert cases, f"{suite} has no cpu cases"
        for case in cases:
            assert attention.get(case["impl"]).available(torch.device("cpu")), case
            assert case["seq_len"] <= 256 and case["rounds"] <= 5, f"cpu case too big for CI: {case}"


def test_attention_gpu_profile_covers_the_handout_sweep(data):
    cases = matrix.parse(data).cases("attention", "gpu")
    covered = {
        (c["impl"], c["head_dim"], c["seq_len"], c["mode"])
        for c in cases
        if c["batch_size"] == 8 and c["heads"] is None and c["dtype"] == "fp32" and not c["causal"]
        and not c["compile"]
    }
    for impl in ("naive", "naive-compiled", "flash-triton"):
        for d in (16, 32, 64, 128):
            for n in (256, 1024, 4096, 8192, 16384):
                for mode in ("forward", "backward"):
                    assert (impl, d, n, mode) in covered
    full = matrix.parse(data).cases("attention", "full")
    assert {c["causal"] for c in full} == {False, True}


def test_flash_gpu_profile_covers_the_sweep(data):
    cases = matrix.parse(data).cases("flash", "gpu")
    covered = {(c["seq_len"], c["head_dim"], c["dtype"], c["mode"]) for c in cases
               if c["batch_size"] == 1 and c["heads"] is None and c["causal"]}
    for n in (2**k for k in range(7, 17)):
        for d in (16, 32, 64, 128):
            for dtype in ("bf16", "fp32"):
                for mode in ("forward", "backward", "forward-backward"):
                    assert (n, d, dtype, mode) in covered
    for dtype in ("bf16", "fp32"):
        impls = {c["impl"] for c in cases if c["dtype"] == dtype}
        assert {"flash-triton", "naive", "sdpa-flash", "sdpa-cudnn"} <= impls


def test_flash_graph_groups_cover_the_long_bf16_sweep_without_backward_mode(data):
    cases = [c for c in matrix.parse(data).cases("flash", "gpu") if c["timing"] == "graph"]
    assert {c["mode"] for c in cases} == {"forward", "forward-backward"}
    bf16 = {(c["seq_len"], c["head_dim"], c["impl"]) for c in cases if c["dtype"] == "bf16"}
    for n in (2**k for k in range(10, 17)):  # N >= 1024, d 64 and 128, flash-triton vs sdpa-flash
        for d in (64, 128):
            assert {(n, d, "flash-triton"), (n, d, "sdpa-flash")} <= bf16


def test_leaderboard_profile_is_the_leaderboard_shapes(data):
    """The assignment's shape (H 16, d 64) and the d 128 one (H 8), each with every implementation."""
    cases = matrix.parse(data).cases("leaderboard", "gpu")
    shapes = {(c["batch_size"], c["heads"], c["seq_len"], c["head_dim"], c["dtype"], c["causal"]) for c in cases}
    assert shapes == {(1, 16, 16384, 64, "bf16", True), (1, 8, 16384, 128, "bf16", True)}
    for d in (64, 128):
        assert {c["impl"] for c in cases if c["head_dim"] == d} == {"flash-triton", "sdpa-flash", "sdpa-cudnn"}
    assert all(c["flush_l2"] is True for c in cases)
    assert {(c["impl"], c["compile"]) for c in cases} >= {
        ("flash-triton", True), ("sdpa-flash", False), ("sdpa-cudnn", False)}
    assert {c["mode"] for c in cases} == {"forward", "backward", "forward-backward"}


def test_every_gpu_case_belongs_to_a_named_group(data):
    m = matrix.parse(data)
    for suite in m.suites:
        for case in m.cases(suite, "gpu"):
            assert case["group"] != "default", f"{suite}: a gpu case has no group (10-minute runs): {case}"


def test_attention_grid_expands_with_defaults():
    grid = {"impls": ["naive"], "batch_sizes": [2], "seq_lens": [8, 16], "head_dims": [4],
            "dtypes": ["fp32"], "causal": [True], "modes": ["backward"], "warmup": 1, "rounds": 2}
    data = {"suites": {"flash": {"profiles": {"cpu": [grid]}}}}
    cases = matrix.parse(data).cases("flash", "cpu")
    assert cases[0] == {"impl": "naive", "batch_size": 2, "heads": None, "kv_heads": None, "seq_len": 8, "head_dim": 4,
                        "dtype": "fp32", "causal": True, "mode": "backward", "compile": False,
                        "flash_options": "", "flush_l2": False, "timing": "host", "warmup": 1, "rounds": 2, "group": "default"}
    assert [c["seq_len"] for c in cases] == [8, 16]
    grid["heads"] = [None, 4]
    assert [c["heads"] for c in matrix.parse(data).cases("flash", "cpu")] == [None, None, 4, 4]
    grid.update(heads=[8], kv_heads=[None, 2])
    cases = matrix.parse(data).cases("flash", "cpu")
    assert [matrix.case_id(c).split("-n")[0] for c in cases] == ["naive-b2-h8", "naive-b2-h8", "naive-b2-h8-kv2",
                                                                  "naive-b2-h8-kv2"]


def _attention_grid(data, suite="flash"):
    return data["suites"][suite]["profiles"]["gpu"][0]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: _attention_grid(d).update(impls=["flashy"]),
         r"flash\.profiles\.gpu\[0\]\.impls\[0\]: unknown value 'flashy'; valid: naive"),
        (lambda d: _attention_grid(d).update(seq_len=[128]), r"flash\.profiles\.gpu\[0\]: unknown key 'seq_len'"),
        (lambda d: _attention_grid(d).update(heads=[None, 0]), r"gpu\[0\]\.heads\[1\]: expected a positive integer"),
        (lambda d: _attention_grid(d).update(heads=[8], kv_heads=[3]),
         r"gpu\[0\]: kv_heads must divide heads \(grouped-query attention\); heads 8 with kv_heads 3"),
        (lambda d: _attention_grid(d).update(kv_heads=[2]),
         r"gpu\[0\]: kv_heads must divide heads \(grouped-query attention\); heads None with kv_heads 2"),
        (lambda d: _attention_grid(d).update(dtypes=["fp8"]), r"gpu\[0\]\.dtypes\[0\]: unknown value 'fp8'"),
        (lambda d: _attention_grid(d).update(modes=["train-step"]), r"gpu\[0\]\.modes\[0\]: unknown value 'train-step'"),
        (lambda d: _attention_grid(d).update(causal=[1]), r"gpu\[0\]\.causal\[0\]: expected true or false"),
        (lambda d: _attention_grid(d).update(flush_l2=[True]), r"gpu\[0\]\.flush_l2: expected true or false"),
        (lambda d: _attention_grid(d).update(timings=["wall"]), r"gpu\[0\]\.timings\[0\]: unknown value 'wall'"),
        (lambda d: _attention_grid(d).update(timings=["device", "graph"], modes=["forward", "backward"]),
         r"gpu\[0\]: timings 'graph' cannot time mode 'backward'"),
        (lambda d: _attention_grid(d).update(head_dims=[]), r"gpu\[0\]\.head_dims: expected a non-empty list"),
        (lambda d: _attention_grid(d).pop("seq_lens"), r"gpu\[0\]: missing required key 'seq_lens'"),
        (lambda d: _attention_grid(d, "leaderboard").update(compile=["yes"]),
         r"leaderboard\.profiles\.gpu\[0\]\.compile\[0\]: expected true or false"),
        (lambda d: _attention_grid(d, "attention").update(sizes=["small"]),
         r"attention\.profiles\.gpu\[0\]: unknown key 'sizes'"),
    ],
)
def test_malformed_attention_grids_name_the_problem(data, mutate, match):
    mutate(data)
    with pytest.raises(MatrixError, match=match):
        matrix.parse(data)


# --- distributed suites ------------------------------------------------------------------------------

def _dist_grid(d, suite, profile="gpu", index=0):
    return d["suites"][suite]["profiles"][profile][index]


def test_allreduce_profiles_cover_the_size_and_world_size_grid(data):
    m = matrix.parse(data)
    gpu = {(c["backend"], c["size_mb"], c["world_size"]) for c in m.cases("allreduce", "gpu")}
    for backend in ("nccl", "gloo"):
        for size in (1, 10, 100, 1024):
            for world in (2, 4, 6):
                assert (backend, size, world) in gpu
    cpu = m.cases("allreduce", "cpu")
    assert {c["backend"] for c in cpu} == {"gloo"}  # CI has no GPU
    assert max(c["size_mb"] for c in cpu) <= 100 and {c["world_size"] for c in cpu} == {2, 4}


def test_data_parallel_gpu_profile_is_xl_context_512_on_2_ranks(data):
    cases = matrix.parse(data).cases("data_parallel", "gpu")
    assert {(c["size"], c["context"], c["batch_size"], c["world_size"]) for c in cases} == {("xl", 512, 2, 2)}
    assert {c["precision"] for c in cases} == {"fp32", "bf16"}
    buckets = {c["bucket_size_mb"] for c in cases if c["variant"] == "bucketed"}
    assert {1, 10, 100, 1000} <= buckets
    for baseline in ("none", "torch-ddp", "naive", "flat", "individual", "zero1", "fsdp", "torch-zero"):
        assert any(c["variant"] == baseline for c in cases), baseline
    # a bucket size only on the variants that have buckets
    assert all(c["bucket_size_mb"] is None for c in cases if c["variant"] not in ("bucketed", "zero-broadcast"))


def test_scaling_groups_repeat_the_gpu_setup_at_world_4_and_8_in_the_full_profile(data):
    """World 4 and 8 need machines CI does not have, so they live in the full profile only."""
    cases = [c for c in matrix.parse(data).cases("data_parallel", "full") if c["group"].startswith("scaling-")]
    assert {(c["size"], c["context"], c["batch_size"]) for c in cases} == {("xl", 512, 2)}
    assert {c["world_size"] for c in cases} == {4, 8} and {c["precision"] for c in cases} == {"fp32", "bf16"}
    assert {"none", "torch-ddp", "bucketed", "individual", "zero1", "torch-zero"} <= {c["variant"] for c in cases}


def test_data_parallel_cpu_profile_runs_every_variant(data):
    from cs336_systems.bench.workloads.data_parallel import VARIANTS

    cases = matrix.parse(data).cases("data_parallel", "cpu")
    assert {c["variant"] for c in cases} == set(VARIANTS)
    assert {c["backend"] for c in cases} == {"gloo"} and {c["size"] for c in cases} == {"tiny"}


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: _dist_grid(d, "allreduce").update(backends=["mpi"]),
         r"allreduce\.profiles\.gpu\[0\]\.backends\[0\]: unknown value 'mpi'; valid: gloo, nccl"),
        (lambda d: _dist_grid(d, "allreduce").update(sizes_mb=[0]),
         r"allreduce\.profiles\.gpu\[0\]\.sizes_mb\[0\]: expected a positive number"),
        (lambda d: _dist_grid(d, "allreduce").update(world_sizes=[1.5]),
         r"allreduce\.profiles\.gpu\[0\]\.world_sizes\[0\]: expected a positive integer"),
        (lambda d: _dist_grid(d, "data_parallel").update(variants=["deepspeed"]),
         r"data_parallel\.profiles\.gpu\[0\]\.variants\[0\]: unknown value 'deepspeed'; valid: none"),
        (lambda d: _dist_grid(d, "data_parallel", index=1).update(bucket_sizes_mb=[None, -1]),
         r"data_parallel\.profiles\.gpu\[1\]\.bucket_sizes_mb\[1\]: expected a positive number"),
        (lambda d: _dist_grid(d, "data_parallel").pop("world_sizes"),
         r"data_parallel\.profiles\.gpu\[0\]: missing required key 'world_sizes'"),
    ],
)
def test_malformed_distributed_grids_name_the_problem(data, mutate, match):
    mutate(data)
    with pytest.raises(MatrixError, match=match):
        matrix.parse(data)


def test_checkpointing_suite_sweeps_the_policies_on_xl(data):
    cases = matrix.parse(data).cases("checkpointing", "gpu")
    assert {c["checkpoint"] for c in cases} == {"none", "every-1", "every-2", "every-4", "sqrt", "nested"}
    assert {(c["size"], c["context"], c["batch_size"], c["precision"], c["mode"]) for c in cases} == {
        ("xl", 512, 4, "bf16", "train-step")}


def test_bad_checkpoint_policy_names_the_path(data):
    data["suites"]["checkpointing"]["profiles"]["gpu"][0]["checkpoints"] = ["none", "every-0"]
    with pytest.raises(MatrixError, match=r"checkpointing\.profiles\.gpu\[0\]\.checkpoints\[1\]: .*every-0"):
        matrix.parse(data)


# --- values that load must also run: the workloads' own limits, checked at load time -----------------------

@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: _dist_grid(d, "allreduce").update(sizes_mb=[1, float("inf")]),
         r"allreduce\.profiles\.gpu\[0\]\.sizes_mb\[1\]: expected a positive number, got inf"),
        (lambda d: _dist_grid(d, "allreduce").update(sizes_mb=[1e-9]),
         r"allreduce\.profiles\.gpu\[0\]\.sizes_mb\[0\]: 1e-09 MiB is 0\.001048576 bytes; the all-reduce needs a "
         r"positive whole number of float32 elements"),
        (lambda d: _dist_grid(d, "allreduce").update(sizes_mb=[0.1]),
         r"sizes_mb\[0\]: 0\.1 MiB is 104857\.6 bytes; .*a multiple of 4 bytes"),
        (lambda d: _dist_grid(d, "data_parallel", index=1).update(bucket_sizes_mb=[float("inf")]),
         r"data_parallel\.profiles\.gpu\[1\]\.bucket_sizes_mb\[0\]: expected a positive number, got inf"),
        (lambda d: _dist_grid(d, "data_parallel", index=0).update(bucket_sizes_mb=[None, 25]),
         r"data_parallel\.profiles\.gpu\[0\]: bucket_sizes_mb \[25\] apply only to variants bucketed, zero-broadcast, "
         r"but the grid also crosses them with \['none', 'torch-ddp'"),
        (lambda d: _dist_grid(d, "data_parallel", index=2).update(precisions=["fp16"]),
         r"data_parallel\.profiles\.gpu\[2\]: precision 'fp16' \(GradScaler\) is not supported with variants "
         r"\['zero-broadcast', 'zero1', 'fsdp', 'torch-zero', 'torch-fsdp2'\]"),
    ],
)
def test_values_a_rank_would_fail_on_are_refused_at_load_time(data, mutate, match):
    mutate(data)
    with pytest.raises(MatrixError, match=match):
        matrix.parse(data)


def test_the_smallest_all_reduce_that_fits_a_float32_loads():
    data = {"suites": {"allreduce": {"profiles": {"cpu": [
        {"backends": ["gloo"], "sizes_mb": [4 / 2**20, 0.25], "world_sizes": [2], "warmup": 0, "rounds": 1}]}}}}
    assert [c["size_mb"] for c in matrix.parse(data).cases("allreduce", "cpu")] == [4 / 2**20, 0.25]


def test_data_parallel_rules_match_what_the_workload_refuses():
    """BUCKETED_VARIANTS and NO_FP16_VARIANTS restate DistributedTrainStep's checks, which run before any
    process group is needed: the two must agree."""
    from cs336_systems.bench.workloads.data_parallel import VARIANTS, DistributedTrainStep

    def refuses(variant, match, **kwargs):
        try:
            DistributedTrainStep(variant=variant, size="tiny", context=8, batch_size=1, device="cpu", **kwargs)
        except ValueError as exc:
            return match in str(exc)
        except RuntimeError:  # passed the checks, then needed a process group
            return False
        return False

    for variant in VARIANTS:
        assert refuses(variant, "applies only to", precision="fp32", bucket_size_mb=1) == (
            variant not in matrix.BUCKETED_VARIANTS), variant
        assert refuses(variant, "is not supported with variant", precision="fp16") == (
            variant in matrix.NO_FP16_VARIANTS), variant


# --- one id, one case ------------------------------------------------------------------------------------

def _lm_grid(**changes):
    grid = {"sizes": ["tiny"], "contexts": [8, 16], "batch_sizes": [1], "modes": ["forward"], "precisions": ["fp32"],
            "compile": [False], "warmup": 1, "rounds": 2, "group": "a"}
    return {**grid, **changes}


def test_two_grids_giving_one_case_id_with_different_rounds_are_refused_naming_both():
    data = {"suites": {"end_to_end": {"profiles": {"cpu": [_lm_grid(), _lm_grid(contexts=[16], rounds=5, group="b")]}}}}
    with pytest.raises(MatrixError, match=r"suites\.end_to_end\.profiles\.cpu\[0\] and suites\.end_to_end\.profiles"
                                          r"\.cpu\[1\] both give case 'tiny-ctx16-b1-forward-fp32-eager-sdpa-w1', "
                                          r"differing only in rounds: 2 vs 5, which the case id leaves out"):
        matrix.parse(data)


def test_two_all_reduce_grids_differing_only_in_inner_iters_are_refused():
    grid = {"backends": ["gloo"], "sizes_mb": [1], "world_sizes": [2], "warmup": 0, "rounds": 1}
    data = {"suites": {"allreduce": {"profiles": {"gpu": [{**grid, "inner_iters": 5}, {**grid, "inner_iters": 50}]}}}}
    with pytest.raises(MatrixError, match=r"gpu\[0\] and .*gpu\[1\] both give case 'gloo-1MiB-ranks2-w0', differing "
                                          r"only in inner_iters: 5 vs 50"):
        matrix.parse(data)


def test_a_case_listed_by_two_groups_is_one_case_not_a_conflict():
    data = {"suites": {"end_to_end": {"profiles": {"cpu": [_lm_grid(), _lm_grid(contexts=[16], group="b")]}}}}
    assert len(matrix.parse(data).cases("end_to_end", "cpu")) == 2


def test_case_ids_are_unique_in_every_profile_of_the_repository_matrix(data):
    m = matrix.parse(data)
    for suite in m.suites:
        for profile in matrix.PROFILES:
            ids = [matrix.case_id(c) for c in m.cases(suite, profile)]
            assert len(ids) == len(set(ids)), (suite, profile)


# --- the end-to-end implementation axis: our model and the hf-llama baseline -------------------------------

def test_e2e_hf_group_times_own_and_hf_at_xl_and_2_7b_eager_and_compiled_in_one_run(data):
    cases = matrix.parse(data).cases("end_to_end", "gpu", {"e2e-hf"})
    ids = {matrix.case_id(c) for c in cases}
    expected = {f"{prefix}{size}-ctx512-b4-{mode}-bf16-{compiled}-sdpa{suffix}-w5"
                for prefix, suffix in (("", ""), ("hf-llama-", ""), ("", "-adamw-master"))
                for size in ("xl", "2.7B") for mode in ("forward", "train-step")
                for compiled in ("eager", "compiled")}
    # small, launch-bound, also with the compiled blocks replayed as CUDA graphs
    expected |= {f"{prefix}small-ctx512-b4-{mode}-bf16-{compiled}-sdpa{suffix}-w5"
                 for prefix, suffix in (("", ""), ("hf-llama-", ""), ("", "-adamw-master"))
                 for mode in ("forward", "train-step") for compiled in ("eager", "compiled", "compiled-cudagraphs")}
    # the A/B of AdamWMaster's master formats: float32 copies beside the default split masters; HF's Llama with
    # AdamWMaster too, so own / HF reads with either optimizer from one run
    expected |= {f"{prefix}{size}-ctx512-b4-train-step-bf16-{compiled}-sdpa-adamw-master{suffix}-w5"
                 for prefix, suffix in (("", "-fp32"), ("hf-llama-", "")) for size in ("xl", "2.7B")
                 for compiled in ("eager", "compiled")}
    assert ids == expected
    assert all(c["cuda_graphs"] == ("cudagraphs" in matrix.case_id(c)) for c in cases)
    assert {c["impl"] for c in cases if matrix.case_id(c).startswith("hf-llama-")} == {"hf-llama"}


def test_own_case_ids_are_the_ids_saved_before_the_impl_axis(data):
    """Saved runs and baselines pair cases by id: our model's cases keep theirs (no impl in them)."""
    m = matrix.parse(data)
    for profile in matrix.PROFILES:
        own = [c for c in m.cases("end_to_end", profile) if c["impl"] == "own"]
        assert own, profile
        for case in own:
            without = {k: v for k, v in case.items() if k != "impl"}
            assert matrix.case_id(case) == matrix.case_id(without)
            assert "own" not in matrix.case_id(case).split("-")


def test_every_profile_runs_the_baseline_beside_our_model(data):
    m = matrix.parse(data)
    for profile in matrix.PROFILES:
        cases = m.cases("end_to_end", profile)
        hf = [c for c in cases if c["impl"] == "hf-llama"]
        assert hf and all(c["attention"] == "sdpa" for c in hf), profile
        own = {matrix.case_id({**c, "impl": "own"}) for c in cases if c["impl"] == "own"}
        # every baseline case has our twin in the same profile: the report's own / HF needs both
        assert all(matrix.case_id({**c, "impl": "own"}) in own for c in hf), profile


def test_attention_ids_keep_their_impl():
    grid = {"impls": ["sdpa"], "batch_sizes": [1], "seq_lens": [8], "head_dims": [16], "dtypes": ["fp32"],
            "causal": [True], "modes": ["forward"], "warmup": 0, "rounds": 1}
    (case,) = matrix.parse({"suites": {"attention": {"profiles": {"cpu": [grid]}}}}).cases("attention", "cpu")
    assert matrix.case_id(case).startswith("sdpa-b1-n8-d16")


@pytest.mark.parametrize("changes, match", [
    ({"impls": ["own", "hf"]}, r"cpu\[0\]\.impls\[1\]: unknown value 'hf'; valid: own, hf-llama"),
    ({"impls": ["hf-llama"], "attention": ["sdpa", "naive"]},
     (r"cpu\[0\]: impls \['hf-llama'\] run attention 'sdpa' only, but the grid also crosses them with attention "
      r"\['naive'\]")),
    ({"impls": []}, r"cpu\[0\]\.impls: expected a non-empty list"),
])
def test_bad_impls_name_the_problem(changes, match):
    with pytest.raises(MatrixError, match=match):
        matrix.parse({"suites": {"end_to_end": {"profiles": {"cpu": [_lm_grid(**changes)]}}}})


def test_the_impl_axis_belongs_to_the_end_to_end_suite_only():
    grid = {**_lm_grid(impls=["hf-llama"]), "checkpoints": ["none"]}
    with pytest.raises(MatrixError, match=r"checkpointing\.profiles\.cpu\[0\]: unknown key 'impls'"):
        matrix.parse({"suites": {"checkpointing": {"profiles": {"cpu": [grid]}}}})


def test_duplicate_keys_are_refused_naming_the_key_and_its_lines(tmp_path):
    """JSON keeps the last of two equal keys in silence: a second "gates" would drop every gate, a repeated
    "modes" would shrink a grid."""
    text = (ROOT / "benchmarks.json").read_text()
    doubled = text.replace('"gates": [', '"gates": [],\n  "gates": [', 1)
    assert doubled != text
    path = tmp_path / "benchmarks.json"
    path.write_text(doubled)
    with pytest.raises(matrix.MatrixError, match=r"key 'gates' appears twice in one object \(lines \d+, \d+"):
        matrix.load(path)
    with pytest.raises(matrix.MatrixError, match="key 'modes' appears twice"):
        matrix.loads('{"suites": {"flash": {"profiles": {"cpu": [{"modes": ["forward"], "modes": ["backward"]}]}}}}')


def test_group_names_that_perf_group_cannot_select_are_refused():
    grid = {"impls": ["naive"], "batch_sizes": [2], "seq_lens": [8], "head_dims": [4], "dtypes": ["fp32"],
            "causal": [True], "modes": ["forward"], "warmup": 1, "rounds": 2}
    for name in ("flash,cpu", " flash", "flash "):
        data = {"suites": {"flash": {"profiles": {"cpu": [dict(grid, group=name)]}}}}
        with pytest.raises(matrix.MatrixError, match="cannot be selected: --perf-group splits on ','"):
            matrix.parse(data)
    matrix.parse({"suites": {"flash": {"profiles": {"cpu": [dict(grid, group="flash-cpu")]}}}})


def test_packed_documents_need_our_model_flash_triton_and_documents_that_fit():
    base = {"group": "g", "sizes": ["tiny"], "contexts": [64], "batch_sizes": [2], "modes": ["forward"],
            "precisions": ["fp32"], "compile": [False], "attention": ["flash-triton"], "packings": ["packed"],
            "documents": 4, "warmup": 1, "rounds": 1}

    def load(**grid):
        return matrix.parse({"suites": {"end_to_end": {"profiles": {"cpu": [{**base, **grid}]}}}})

    cases = load(packings=["none", "packed", "padded"]).cases("end_to_end", "cpu")
    assert [matrix.case_id(c) for c in cases] == [
        "tiny-ctx64-b2-forward-fp32-eager-flash-triton-w1", "tiny-ctx64-b2-forward-fp32-eager-packed-docs4-flash-triton-w1",
        "tiny-ctx64-b2-forward-fp32-eager-padded-docs4-flash-triton-w1"]
    with pytest.raises(matrix.MatrixError, match="packing 'packed' needs attention"):
        load(attention=["sdpa"])
    load(attention=["sdpa"], packings=["padded"])  # padded rows run any attention
    with pytest.raises(matrix.MatrixError, match=r"run our model only"):
        load(impls=["hf-llama"], attention=["sdpa"], packings=["padded"])
    with pytest.raises(matrix.MatrixError, match="documents 1 must be at least the largest batch size"):
        load(documents=1)
    with pytest.raises(matrix.MatrixError, match=r"at most the smallest batch's tokens \(128\)"):
        load(documents=200)
    with pytest.raises(matrix.MatrixError, match="packings"):
        load(packings=["stacked"])
