"""Report rendering from saved pytest-benchmark JSON (synthetic runs with known numbers)."""

import json

from cs336_systems import report


def _bench(size, context, mode, precision, compile_, median_s, attention="sdpa", test="test_end_to_end"):
    info = {"size": size, "context": context, "batch_size": 4, "mode": mode, "precision": precision,
            "compile": compile_, "attention": attention, "warmup": 5, "rounds": 10, "status": "ok",
            "mfu": 0.25, "tokens_per_s": 4 * context / median_s, "peak_memory_gib": 1.5}
    stats = {"mean": median_s, "stddev": median_s / 100, "median": median_s, "min": median_s, "max": median_s}
    return {"name": f"{test}[x]", "extra_info": info, "stats": stats}


def _run(tmp_path, name, benchmarks, oom=()):
    path = tmp_path / name
    path.write_text(json.dumps({
        "machine_info": {"cs336_systems": {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "torch": "2.11"}},
        "benchmarks": benchmarks, "oom": list(oom),
    }))
    return path


def test_tables_speedups_and_oom_cells(tmp_path):
    oom = {"name": "test_end_to_end[y]", "error": "CUDA out of memory",
           "extra_info": {"size": "2.7B", "context": 1024, "batch_size": 4, "mode": "train-step",
                          "precision": "fp32", "compile": False, "attention": "sdpa", "warmup": 5}}
    run = _run(tmp_path, "a.json", [
        _bench("small", 128, "forward", "fp32", False, 0.010),
        _bench("small", 128, "forward", "bf16", False, 0.004),
        _bench("small", 128, "forward", "bf16", True, 0.002),
        _bench("small", 128, "forward", "bf16", False, 0.008, attention="naive"),
        _bench("2.7B", 1024, "forward", "fp32", False, 0.500),
    ], oom=[oom])
    text = report.render([run])
    assert "| small | 128 | 10.00 ± 0.10 | 25.0% |" in text
    assert "OOM" in text.split("### End-to-end: fp32, eager, attention=sdpa")[1].split("###")[0]
    assert "| 10.00 | 4.00 | 2.50x |" in text  # fp32 -> bf16
    assert "| 4.00 | 2.00 | 2.00x |" in text  # eager -> compiled
    assert "| 8.00 | 4.00 | 2.00x |" in text  # naive -> sdpa
    assert "NVIDIA H100 80GB HBM3" in text


def test_later_runs_override_earlier_and_cli_writes_file(tmp_path):
    first = _run(tmp_path, "a.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])
    second = _run(tmp_path, "b.json", [_bench("small", 128, "forward", "fp32", False, 0.020)])
    out = tmp_path / "report.md"
    assert report.main([str(first), str(second), "-o", str(out)]) == 0
    text = out.read_text()
    assert "20.00 ± 0.20" in text and "10.00 ± 0.10" not in text


def test_warmup_study_table(tmp_path):
    benches = []
    for warmup, median in ((0, 0.5), (5, 0.1)):
        b = _bench("small", 512, "train-step", "bf16", False, median, test="test_warmup_study")
        b["extra_info"]["warmup"] = warmup
        benches.append(b)
    text = report.render([_run(tmp_path, "w.json", benches)])
    assert "### Warm-up study" in text
    assert "| small | 512 | train-step | bf16 | eager | 0 | 500.00 ± 5.00 |" in text


# --- attention suites -------------------------------------------------------------------------------


def _attn(test, impl, n, d, mode, median_s, dtype="fp32", causal=False, batch=8, heads=None, compile_=False,
          flush=False, **extra):
    info = {"impl": impl, "batch_size": batch, "heads": heads, "seq_len": n, "head_dim": d, "dtype": dtype,
            "causal": causal, "mode": mode, "compile": compile_, "flush_l2": flush, "warmup": 5, "rounds": 10,
            "status": "ok", **extra}
    stats = {"mean": median_s, "stddev": 0.0, "median": median_s, "min": median_s, "max": median_s}
    return {"name": f"{test}[{impl}-{n}-{d}-{mode}]", "extra_info": info, "stats": stats}


def _attn_oom(test, impl, n, d, mode, **extra):
    info = {"impl": impl, "batch_size": 8, "heads": None, "seq_len": n, "head_dim": d, "dtype": "fp32",
            "causal": False, "mode": mode, "compile": False, "flush_l2": False, "warmup": 5, **extra}
    return {"name": f"{test}[{impl}-{n}-{d}-{mode}]", "error": "CUDA out of memory", "extra_info": info}


def _section(text, title):
    return text.split(title)[1].split("\n###")[0]


def test_attention_sweep_table_has_forward_backward_memory_and_oom(tmp_path):
    run = _run(tmp_path, "att.json", [
        _attn("test_attention", "naive", 256, 16, "forward", 0.0005),
        _attn("test_attention", "naive", 256, 16, "backward", 0.002, memory_before_backward_gib=0.25),
        _attn("test_attention", "naive-compiled", 256, 16, "forward", 0.00025),
        _attn("test_attention", "naive", 16384, 128, "forward", 0.040),
    ], oom=[
        _attn_oom("test_attention", "naive", 16384, 128, "backward", memory_before_backward_gib=60.5),
        _attn_oom("test_attention", "naive-compiled", 16384, 128, "forward"),
    ])
    text = report.render([run])
    table = _section(text, "### Attention sweep: fp32, not causal, B=8")
    assert ("| d | N | naive forward ms | naive backward ms | naive memory before backward GiB | "
            "naive-compiled forward ms |") in table
    assert "| 16 | 256 | 0.500 | 2.00 | 0.25 | 0.250 | - | - |" in table
    assert "| 128 | 16384 | 40.00 | OOM | 60.50 | OOM | - | - |" in table  # forward held 60.5 GiB, then OOM
    assert table.index("| 16 | 256 |") < table.index("| 128 | 16384 |")


def test_flash_tables_per_dtype_and_mode_with_same_run_speedups(tmp_path):
    benches = []
    for impl, ms in (("flash-triton", 1.0), ("naive", 4.0), ("sdpa-flash", 0.5)):
        benches.append(_attn("test_flash", impl, 1024, 64, "forward", ms / 1e3, dtype="bf16", causal=True,
                             batch=1, tflops=100.0 / ms))
    benches.append(_attn("test_flash", "flash-triton", 128, 64, "forward", 0.00002, dtype="bf16", causal=True,
                         batch=1, tflops=0.5))
    benches.append(_attn("test_flash", "naive", 1024, 64, "backward", 0.010, dtype="bf16", causal=True, batch=1))
    benches.append(_attn("test_flash", "naive", 1024, 64, "forward", 0.003, dtype="fp32", causal=True, batch=1))
    text = report.render([_run(tmp_path, "flash.json", benches)])
    table = _section(text, "### Flash sweep: bf16, forward, causal, B=1")
    assert ("| N | d | naive ms | naive TFLOP/s | flash-triton ms | flash-triton TFLOP/s | sdpa-flash ms | "
            "sdpa-flash TFLOP/s | flash-triton speedup vs naive | flash-triton speedup vs sdpa-flash |") in table
    assert "| 1024 | 64 | 4.00 | 25.0 | 1.00 | 100.0 | 0.500 | 200.0 | 4.00x | 0.50x |" in table
    assert "| 128 | 64 | - | - | 0.020 | 0.5 | - | - | - | - |" in table
    assert table.index("| 128 | 64 |") < table.index("| 1024 | 64 |")
    # modes and dtypes get their own tables; without flash-triton there is no speedup column
    assert "speedup" not in _section(text, "### Flash sweep: bf16, backward, causal, B=1")
    assert "### Flash sweep: fp32, forward, causal, B=1" in text
    assert text.index("bf16, forward, causal") < text.index("bf16, backward, causal") < text.index("fp32, forward")


def test_leaderboard_table_ratios_against_sdpa_in_the_same_run(tmp_path):
    shape = dict(dtype="bf16", causal=True, batch=1, heads=16, flush=True)
    benches = [
        _attn("test_leaderboard", "sdpa-flash", 16384, 64, "forward-backward", 0.004, tflops=480.0, **shape),
        _attn("test_leaderboard", "sdpa-cudnn", 16384, 64, "forward-backward", 0.005, tflops=384.0, **shape),
        _attn("test_leaderboard", "flash-triton", 16384, 64, "forward-backward", 0.006, compile_=True,
              tflops=320.0, accuracy_error=0.0123, **shape),
        _attn("test_leaderboard", "sdpa-flash", 16384, 64, "forward", 0.001, tflops=550.0, **shape),
    ]
    text = report.render([_run(tmp_path, "lb.json", benches)])
    table = _section(text, "### Leaderboard: B=1, H=16, N=16384, d=64, bf16, causal, L2 flushed before every round")
    assert ("| mode | implementation | median ms | TFLOP/s | max rel. error | time ÷ sdpa-flash | "
            "time ÷ sdpa-cudnn |") in table
    assert "| forward-backward | flash-triton (compiled) | 6.00 | 320.0 | 1.2e-02 | 1.50 | 1.20 |" in table
    assert "| forward-backward | sdpa-flash | 4.00 | 480.0 | - | 1.00 | 0.80 |" in table
    assert "| forward | sdpa-flash | 1.00 | 550.0 | - | 1.00 | - |" in table
    assert table.index("| forward |") < table.index("| forward-backward |")


def test_attention_cases_do_not_collide_with_each_other_or_lm_cases(tmp_path):
    run = _run(tmp_path, "mix.json", [
        _bench("small", 128, "forward", "fp32", False, 0.010),
        _attn("test_flash", "naive", 1024, 64, "forward", 0.001, causal=True, batch=1),
        _attn("test_flash", "naive", 1024, 64, "forward", 0.002, causal=True, batch=1, heads=4),
        _attn("test_flash", "naive", 1024, 32, "forward", 0.003, causal=True, batch=1),
    ])
    entries, _ = report.load_runs([run])
    assert len(entries) == 4


def test_speedups_and_ratios_only_within_one_saved_run(tmp_path):
    flash = [_attn("test_flash", "flash-triton", 1024, 64, "forward", 0.001, causal=True, batch=1)]
    naive = [_attn("test_flash", "naive", 1024, 64, "forward", 0.004, causal=True, batch=1)]
    board = dict(dtype="bf16", causal=True, batch=1, heads=16, flush=True)
    flash.append(_attn("test_leaderboard", "flash-triton", 16384, 64, "forward", 0.002, **board))
    naive.append(_attn("test_leaderboard", "sdpa-flash", 16384, 64, "forward", 0.001, **board))
    text = report.render([_run(tmp_path, "a.json", flash), _run(tmp_path, "b.json", naive)])
    assert "| 1024 | 64 | 4.00 | - | 1.00 | - | - |" in text  # both measured, but not in the same run
    assert "| forward | flash-triton | 2.00 | - | - | - | - |" in text
    merged = report.render([_run(tmp_path, "c.json", flash + naive)])
    assert "| 1024 | 64 | 4.00 | - | 1.00 | - | 4.00x |" in merged
    assert "| forward | flash-triton | 2.00 | - | - | 2.00 | - |" in merged
