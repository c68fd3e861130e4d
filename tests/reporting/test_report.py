"""Report rendering from saved pytest-benchmark JSON (synthetic runs with known numbers)."""

import json
import re
import sys
from pathlib import Path

import pytest

from cs336_systems.reporting import compare as run_compare
from cs336_systems.reporting import distributed, plots, tables
from cs336_systems.reporting import lm as lm_tables
from cs336_systems.reporting import readme_block as readme_results
from cs336_systems.reporting import render as report


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


def test_machine_table_names_each_runs_switches(tmp_path):
    """The CS336_* switches a run was made with (an A/B's difference) show in the machine table; a run that
    recorded none, or was saved before switches were recorded, shows "-"."""
    plain = _run(tmp_path, "a.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])
    switched = tmp_path / "b.json"
    data = json.loads(plain.read_text())
    data["machine_info"]["cs336_systems"]["switches"] = {"CS336_FLASH_TMA": "0", "CS336_FLASH_SPLIT_D": "1"}
    switched.write_text(json.dumps(data))
    text = report.render([plain, switched])
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and ".json" in line}
    assert rows[str(plain)].rstrip().endswith("| - |")
    assert rows[str(switched)].rstrip().endswith("| CS336_FLASH_SPLIT_D=1, CS336_FLASH_TMA=0 |")
    assert "| switches |" in text


def test_later_runs_override_earlier_and_cli_writes_file(tmp_path):
    first = _run(tmp_path, "a.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])
    second = _run(tmp_path, "b.json", [_bench("small", 128, "forward", "fp32", False, 0.020)])
    out = tmp_path / "report.md"
    assert report.main([str(first), str(second), "-o", str(out)]) == 0
    text = out.read_text()
    assert "20.00 ± 0.20" in text and "10.00 ± 0.10" not in text


def test_the_newest_run_wins_whatever_order_the_files_are_named_in(tmp_path):
    newer = _run(tmp_path, "a.json", [_bench("small", 128, "forward", "fp32", False, 0.020)])
    older = _run(tmp_path, "b.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])
    for path, when in ((newer, "2026-12-02T10:00:00+00:00"), (older, "2026-11-02T10:00:00+00:00")):
        data = json.loads(path.read_text())
        data["datetime"] = when
        path.write_text(json.dumps(data))
    text = report.render([newer, older])
    assert "20.00 ± 0.20" in text and "10.00 ± 0.10" not in text


def test_float8_and_packed_cases_get_their_own_tables_and_pair_only_like_with_like(tmp_path):
    def case(median_s, impl=None, linear=None, packing=None):
        bench = _bench("xl", 512, "train-step", "bf16", True, median_s)
        bench["extra_info"].update({k: v for k, v in (("impl", impl), ("linear_precision", linear),
                                                      ("packing", packing)) if v})
        return bench

    older = _run(tmp_path, "a.json", [case(0.100)])  # saved before the axes: bf16, not packed
    run = _run(tmp_path, "b.json", [case(0.080, linear="fp8-tensorwise"), case(0.120, "hf-llama", "fp8-tensorwise"),
                                    case(0.090, packing="packed"), case(0.200, packing="padded")])
    text = report.render([older, run])
    own_bf16 = _section(text, "End-to-end: bf16, compiled, attention=sdpa, batch=4")
    assert "| xl | 512 | 100.00 ± 1.00 |" in own_bf16 and "80.00" not in own_bf16
    assert "| xl | 512 | 80.00 ± 0.80 |" in _section(
        text, "End-to-end: bf16, compiled, attention=sdpa, batch=4, linear_precision=fp8-tensorwise")
    assert "| xl | 512 | 90.00 ± 0.90 |" in _section(
        text, "End-to-end: bf16, compiled, attention=sdpa, batch=4, packing=packed")
    versus = _section(text, "Own model vs hf-llama")
    # HF's float8 step pairs with ours in float8 (same run: a ratio), never with our bf16 one
    assert "| fp8-tensorwise | none | adamw | adamw | 80.00 | 120.00 | 0.67 |" in versus
    speedup = _section(text, "bf16 vs float8 (tensorwise) Linear layers")
    assert "| 100.00 | 80.00 | 1.25x† |" in speedup and "different saved runs" in speedup
    assert "| 200.00 | 90.00 | 2.22x |" in _section(text, "documents padded vs packed")


def test_cli_bad_inputs_and_outputs_are_messages_not_tracebacks(tmp_path, capsys):
    good = _run(tmp_path, "good.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])
    bad = {"empty.json": "", "list.json": "[]", "object.json": "{}", "latin1.json": b"\xff\xfe",
           "foreign.json": json.dumps({"benchmarks": [], "machine_info": {"node": "x"}})}
    for name, content in bad.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        assert report.main([str(path)]) == 2, name
        assert report.main(["--compare", str(good), str(path)]) == 2, name
    assert report.main([str(tmp_path)]) == 2  # a directory
    assert report.main([str(good), "-o", str(tmp_path / "no-such-dir" / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "not a readable pytest-benchmark JSON" in err and "not saved by this project's perf suite" in err
    assert "cannot write" in err and "Traceback" not in err


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


def test_flash_tables_keep_host_and_device_timed_cases_of_one_run_apart(tmp_path):
    """`--perf-profile=gpu` saves the host-timed and the device-timed flash groups in one JSON: a cell must
    never show one clock's time beside the other's, nor divide them."""
    common = dict(dtype="bf16", causal=True, batch=1)
    benches = [
        _attn("test_flash", "naive", 1024, 64, "forward", 0.004, timing="host", tflops=1.0, **common),
        _attn("test_flash", "flash-triton", 1024, 64, "forward", 0.002, timing="host", tflops=2.0, **common),
        _attn("test_flash", "flash-triton", 1024, 64, "forward", 0.001, timing="device", flush=True, tflops=4.0,
              **common),
        _attn("test_flash", "sdpa-flash", 1024, 64, "forward", 0.0008, timing="device", flush=True, tflops=5.0,
              **common),
    ]
    text = report.render([_run(tmp_path, "one-session.json", benches)])
    host = _section(text, "### Flash sweep: bf16, forward, causal, B=1 (median ms)")
    device = _section(text, "### Flash sweep: bf16, forward, causal, B=1, L2 flushed before every round, "
                            "device time (CUDA events, as do_bench) (median ms)")
    assert "| 1024 | 64 | 4.00 | 1 | 2.00 | 2 | 2.00x |" in host and "sdpa-flash" not in host
    assert "| 1024 | 64 | 1.00 | 4 | 0.800 | 5 | 0.80x |" in device and "naive" not in device
    # a plot needs two lengths (a single N is left to the tables)
    benches += [_attn("test_flash", "flash-triton", 2048, 64, "forward", 0.004, timing="host", tflops=4.0, **common),
                _attn("test_flash", "flash-triton", 2048, 64, "forward", 0.002, timing="device", flush=True,
                      tflops=8.0, **common)]
    figures = plots.flash_plots(tables.load_runs([_run(tmp_path, "one-session-2.json", benches)])[0])
    names = sorted(p.filename for p in figures)
    assert len(names) == 2 and len(set(names)) == 2 and any("device" in n for n in names), names


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
    entries, _ = tables.load_runs([run])
    assert len(entries) == 4


def test_speedups_and_ratios_only_within_one_saved_run(tmp_path):
    flash = [_attn("test_flash", "flash-triton", 1024, 64, "forward", 0.001, causal=True, batch=1)]
    naive = [_attn("test_flash", "naive", 1024, 64, "forward", 0.004, causal=True, batch=1)]
    board = dict(dtype="bf16", causal=True, batch=1, heads=16, flush=True, timing="device")
    flash.append(_attn("test_leaderboard", "flash-triton", 16384, 64, "forward", 0.002, **board))
    naive.append(_attn("test_leaderboard", "sdpa-flash", 16384, 64, "forward", 0.001, **board))
    text = report.render([_run(tmp_path, "a.json", flash), _run(tmp_path, "b.json", naive)])
    assert "| 1024 | 64 | 4.00 | - | 1.00 | - | - |" in text  # both measured, but not in the same run
    assert "| forward | flash-triton | 2.00 | - | - | - | - |" in text
    merged = report.render([_run(tmp_path, "c.json", flash + naive)])
    assert "| 1024 | 64 | 4.00 | - | 1.00 | - | 4.00x |" in merged
    assert "| forward | flash-triton | 2.00 | - | - | 2.00 | - |" in merged


def test_flash_cell_saved_in_several_runs_prefers_the_run_with_baselines_and_pairs_speedups_by_run(tmp_path):
    """A sweep cut short and completed by a second run: every cell shows a value, the run that measured
    the contender beside the most baselines wins (ties: the later file), and each speedup divides times
    of one run, marked ‡ when those are not the times shown."""
    def flash(impl, n, ms):
        return _attn("test_flash", impl, n, 64, "forward", ms / 1e3, causal=True, batch=1)

    rest = _run(tmp_path, "long-rest.json", [
        flash("flash-triton", 8192, 1.1), flash("sdpa-efficient", 8192, 2.2),
        flash("flash-triton", 2048, 0.6), flash("naive", 2048, 1.8), flash("sdpa-efficient", 2048, 1.2),
    ])
    first = _run(tmp_path, "long.json", [
        flash("flash-triton", 8192, 1.0), flash("naive", 8192, 8.0),
        flash("flash-triton", 2048, 0.5), flash("naive", 2048, 1.0),
        flash("flash-triton", 65536, 10.0),
    ])
    title = "### Flash sweep: fp32, forward, causal, B=1"
    table = _section(report.render([rest, first]), title)
    assert ("| N | d | naive ms | naive TFLOP/s | flash-triton ms | flash-triton TFLOP/s | sdpa-efficient ms | "
            "sdpa-efficient TFLOP/s | flash-triton speedup vs naive | flash-triton speedup vs sdpa-efficient |"
            ) in table
    # two baselines beside flash-triton in long-rest.json beat one in the later long.json: all from rest
    assert "| 2048 | 64 | 1.80 | - | 0.600 | - | 1.20 | - | 3.00x | 2.00x |" in table
    # one baseline each: the later file's flash-triton is shown; vs sdpa-efficient pairs rest's own times
    assert "| 8192 | 64 | 8.00 | - | 1.00 | - | 2.20 | - | 8.00x | 2.00x‡ |" in table
    assert "| 65536 | 64 | - | - | 10.00 | - | - | - | - | - |" in table
    assert "‡: the case was saved in more than one run" in table
    # the same runs in the other order: the tie goes to long-rest.json now; the rest does not change
    swapped = _section(report.render([first, rest]), title)
    assert "| 8192 | 64 | 8.00 | - | 1.10 | - | 2.20 | - | 8.00x‡ | 2.00x |" in swapped
    assert "| 2048 | 64 | 1.80 | - | 0.600 | - | 1.20 | - | 3.00x | 2.00x |" in swapped
    # other tables keep "later runs override earlier", and one run alone needs no mark
    entries, _ = tables.load_runs([rest, first])
    assert sorted(round(tables.stat_ms(e), 6) for e in entries if e["impl"] == "flash-triton") == [0.5, 1.0, 10.0]
    assert "‡" not in report.render([first])


def test_flash_cell_ties_go_to_the_later_file_whatever_impl_came_first(tmp_path):
    """Ties between runs are broken by the order of the files, not by which impl a file measured first."""
    def flash(impl, ms):
        return _attn("test_flash", impl, 1024, 64, "forward", ms / 1e3, causal=True, batch=1)

    runs = [_run(tmp_path, "a.json", [flash("naive", 9.0)]),
            _run(tmp_path, "b.json", [flash("flash-triton", 1.0), flash("sdpa-efficient", 3.0)]),
            _run(tmp_path, "c.json", [flash("flash-triton", 2.0), flash("naive", 4.0)])]
    table = _section(report.render(runs), "### Flash sweep: fp32, forward, causal, B=1")
    # b and c each measured flash-triton beside one baseline: c, the later file, is shown
    assert "| 1024 | 64 | 4.00 | - | 2.00 | - | 3.00 | - | 2.00x | 3.00x‡ |" in table


# --- distributed suites (allreduce, data_parallel) ---------------------------------------------------

H200 = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "cuda": "13.0", "torch": "2.11", "triton": "3.6",
        "driver": "580"}


def _dist_run(tmp_path, name, benchmarks, oom=(), machine=H200):
    path = tmp_path / name
    path.write_text(json.dumps({"machine_info": {"cs336_systems": machine}, "benchmarks": benchmarks,
                                "oom": list(oom)}))
    return path


def _stats(median_s):
    return {"mean": median_s, "stddev": 0.0, "median": median_s, "min": median_s, "max": median_s}


def _allreduce(backend, size_mb, world, median_s):
    """A case as comm.allreduce_case records it: algbw = bytes / median, busbw = algbw * 2 (n - 1) / n."""
    nbytes = int(size_mb * 2**20)
    algbw = nbytes / median_s
    info = {"suite": "allreduce", "backend": backend, "size_mb": size_mb, "world_size": world, "inner_iters": 5,
            "warmup": 3, "rounds": 10, "status": "ok", "bytes": nbytes, "algbw_gbps": algbw / 1e9,
            "busbw_gbps": algbw * 2 * (world - 1) / world / 1e9}
    return {"name": f"test_allreduce[{backend}-{size_mb}MiB-ranks{world}]", "extra_info": info,
            "stats": _stats(median_s)}


def _dp(variant, median_ms, *, precision="bf16", bucket=None, sync_ms=None, num_buckets=None, size="tiny",
        world=2, memory=None):
    info = {"suite": "data_parallel", "variant": variant, "bucket_size_mb": bucket, "size": size, "context": 32,
            "batch_size": 2, "precision": precision, "world_size": world, "backend": "nccl", "warmup": 3,
            "rounds": 10, "status": "ok"}
    if sync_ms is not None:
        info |= {"sync_ms": sync_ms, "sync_share": sync_ms / median_ms}
    if num_buckets is not None:
        info["num_buckets"] = num_buckets
    if memory is not None:
        info["memory_gib"] = memory
    return {"name": f"test_data_parallel[{variant}-{bucket}-{precision}]", "extra_info": info,
            "stats": _stats(median_ms / 1e3)}


def test_allreduce_tables_bandwidths_and_reference_ratios(tmp_path):
    mib = 2**20
    run = _dist_run(tmp_path, "ar.json", [
        _allreduce("nccl", 1, 2, mib / 64e9),  # busbw 64 GB/s = 2x the reference 32
        _allreduce("nccl", 10, 2, 10 * mib / 75e9),  # 75 GB/s = 0.5x the reference 150
        _allreduce("nccl", 10, 4, 0.002),  # no reference at 4 ranks
        _allreduce("nccl", 3, 2, 0.001),  # no reference for 3 MiB
        _allreduce("gloo", 1, 2, mib / 2e9),  # 2 GB/s: inside 1-2.7
        _allreduce("gloo", 100, 2, 100 * mib / 0.5e9),  # 0.5 GB/s: below
    ])
    text = report.render([run])
    nccl = _section(text, "### All-reduce: nccl")
    assert ("| size MiB | ranks | median time per all-reduce | algbw GB/s | busbw GB/s | reference busbw GB/s | "
            "busbw ÷ reference |") in nccl
    assert "| 1 | 2 | 16.4 µs | 64.0 | 64.0 | 32 | 2.00x |" in nccl
    assert "| 10 | 2 | 139.8 µs | 75.0 | 75.0 | 150 | 0.50x |" in nccl
    # 4 ranks: algbw = 10 MiB / 2 ms = 5.24 GB/s, busbw = algbw * 2 * 3 / 4 = 7.86 GB/s
    assert "| 10 | 4 | 2.00 ms | 5.2 | 7.9 | - | - |" in nccl
    assert "| 3 | 2 | 1.00 ms | 3.1 | 3.1 | - | - |" in nccl
    assert nccl.index("| 1 | 2 |") < nccl.index("| 3 | 2 |") < nccl.index("| 10 | 2 |") < nccl.index("| 10 | 4 |")
    gloo = _section(text, "### All-reduce: gloo")
    assert "| 1 | 2 | 524.3 µs | 2.0 | 2.0 | 1–2.7 | in range |" in gloo
    assert "| 100 | 2 | 209.72 ms | 0.5 | 0.5 | 1–2.7 | below range |" in gloo
    # the reference was measured on 2xH200: another GPU gets none
    other = _dist_run(tmp_path, "h100.json", [_allreduce("nccl", 1, 2, mib / 64e9)],
                      machine=H200 | {"gpu_name": "NVIDIA H100 80GB HBM3"})
    assert "| 1 | 2 | 16.4 µs | 64.0 | 64.0 | - | - |" in report.render([other])


def _ddp_group(precision, *, torch_ddp, best_bucket, naive_sync, individual_sync):
    return [
        _dp("none", 80.0, precision=precision),
        _dp("torch-ddp", torch_ddp, precision=precision),
        _dp("naive", 125.0, precision=precision, sync_ms=naive_sync),
        _dp("individual", 110.0, precision=precision, sync_ms=individual_sync, num_buckets=30),
        _dp("bucketed", best_bucket, precision=precision, bucket=10, sync_ms=5.0, num_buckets=4),
        _dp("bucketed", 120.0, precision=precision, bucket=1, sync_ms=8.0, num_buckets=12),
        _dp("bucketed", 115.0, precision=precision, bucket=None, sync_ms=10.0, num_buckets=1),
    ]


def test_data_parallel_table_ratios_hidden_fraction_and_targets_both_ways(tmp_path):
    # bf16 meets both targets: 98 / 100 = 0.98 <= 0.98 and 1 - 8 / 40 = 80% >= 80%;
    # fp32 misses both: 99 / 100 = 0.99 and 1 - 9 / 40 = 77.5%.
    benches = (_ddp_group("bf16", torch_ddp=100.0, best_bucket=98.0, naive_sync=40.0, individual_sync=8.0)
               + _ddp_group("fp32", torch_ddp=100.0, best_bucket=99.0, naive_sync=40.0, individual_sync=9.0))
    text = report.render([_dist_run(tmp_path, "dp.json", benches)])
    bf16 = _section(text, "### Data parallel: tiny, context 32, per-rank batch 2, bf16, 2 ranks (nccl)")
    assert ("| variant | median step ms | ÷ torch-ddp | ÷ none | sync ms | sync % of step | naive comm hidden | "
            "buckets |") in bf16
    assert "| none | 80.00 | 0.800x | 1.000x | - | - | - | - |" in bf16
    assert "| naive | 125.00 | 1.250x | 1.562x | 40.00 | 32.0 | - | - |" in bf16  # 125 / 80 = 1.5625
    assert "| individual | 110.00 | 1.100x | 1.375x | 8.00 | 7.3 | 80.0% | 30 |" in bf16
    assert "| bucketed 1 MiB | 120.00 | 1.200x | 1.500x | 8.00 | 6.7 | 80.0% | 12 |" in bf16
    assert "| bucketed 10 MiB | 98.00 | 0.980x | 1.225x | 5.00 | 5.1 | 87.5% | 4 |" in bf16
    assert "| bucketed (one bucket) | 115.00 | 1.150x | 1.438x | 10.00 | 8.7 | 75.0% | 1 |" in bf16
    order = [bf16.index(f"| {v} |") for v in ("none", "torch-ddp", "naive", "individual", "bucketed 1 MiB",
                                               "bucketed 10 MiB", "bucketed (one bucket)")]
    assert order == sorted(order)
    assert "best is bucketed 10 MiB at 98.00 ms = 0.980x torch DDP -> **met**" in bf16
    assert "(1 − sync ms ÷ naive sync ms): 80.0% -> **met**" in bf16
    fp32 = _section(text, "### Data parallel: tiny, context 32, per-rank batch 2, fp32, 2 ranks (nccl)")
    assert "best is bucketed 10 MiB at 99.00 ms = 0.990x torch DDP -> **not met**" in fp32
    assert "(1 − sync ms ÷ naive sync ms): 77.5% -> **not met**" in fp32
    targets = distributed.ddp_targets(tables.load_runs([_dist_run(tmp_path, "t.json", benches[:7])])[0])
    assert targets["bucketed"][1] == 0.98 and targets["bucketed"][2] is True
    assert targets["individual"] == (0.8, True)


def test_data_parallel_rerun_with_another_warmup_replaces_and_zero_sync_is_fully_hidden(tmp_path):
    old = _dist_run(tmp_path, "old.json", _ddp_group("bf16", torch_ddp=100.0, best_bucket=98.0, naive_sync=40.0,
                                                     individual_sync=8.0))
    rerun = _ddp_group("bf16", torch_ddp=50.0, best_bucket=45.0, naive_sync=20.0, individual_sync=0.0)
    for bench in rerun:
        bench["extra_info"]["warmup"] = 5  # measured differently, same cases
    text = report.render([old, _dist_run(tmp_path, "new.json", rerun)])
    table = _section(text, "### Data parallel: tiny, context 32, per-rank batch 2, bf16, 2 ranks (nccl)")
    assert table.count("| torch-ddp |") == 1 and "| torch-ddp | 50.00 | 1.000x |" in table
    assert "| individual | 110.00 | 2.200x | 1.375x | 0.00 | 0.0 | 100.0% | 30 |" in table
    assert "(1 − sync ms ÷ naive sync ms): 100.0% -> **met**" in table


def test_data_parallel_targets_and_ratios_across_runs(tmp_path):
    ddp = _dist_run(tmp_path, "ddp.json", [_dp("none", 80.0), _dp("torch-ddp", 100.0)])
    bucketed = _dist_run(tmp_path, "b.json", [_dp("bucketed", 90.0, bucket=25, sync_ms=1.0),
                                               _dp("naive", 120.0, sync_ms=10.0)])
    other = _dist_run(tmp_path, "o.json", [_dp("zero1", 110.0), _dp("individual", 105.0, sync_ms=5.0)],
                      machine=H200 | {"torch": "2.12"})
    text = report.render([ddp, bucketed, other], any_machine=True)  # another torch: marked, not refused
    table = _section(text, "### Data parallel: tiny, context 32")
    # another run of the same machine facts: the ratio is shown, marked; another torch version: none
    assert "| bucketed 25 MiB | 90.00 | 0.900x† | 1.125x† | 1.00 | 1.1 | 90.0% | - |" in table
    assert "| zero1 | 110.00 | - | - | - | - | - | - |" in table
    assert "| individual | 105.00 | - | - | 5.00 | 4.8 | - | - |" in table
    # targets use same-run numbers only
    assert "torch DDP's step: not measured in one run." in table
    assert "naive sync ms): not measured in one run." in table


def test_data_parallel_summary_and_memory_tables(tmp_path):
    memory = {"after_construction": 1.5, "peak_before_step": 6.25, "parameters": 1.5, "gradients": 1.5,
              "optimizer_state": 3.0, "activations_other": 0.25, "peak_step": 7.0, "allocated_after_step": 6.0}
    benches = [
        _dp("none", 80.0, memory=memory), _dp("torch-ddp", 100.0, memory=memory | {"after_construction": 3.0}),
        _dp("bucketed", 105.0, bucket=1), _dp("bucketed", 95.0, bucket=100),
        _dp("none", 40.0, precision="fp32"), _dp("torch-ddp", 50.0, precision="fp32"),
        _dp("bucketed", 60.0, precision="fp32", bucket=None),
    ]
    oom = {"name": "test_data_parallel[fsdp]", "error": "CUDA out of memory",
           "extra_info": {**_dp("fsdp", 1.0)["extra_info"], "status": "oom"}}
    text = report.render([_dist_run(tmp_path, "dp.json", benches, oom=[oom])])
    summary = _section(text, "### Data parallel summary: tiny, context 32, per-rank batch 2, 2 ranks (nccl)")
    assert "| variant | bf16 step ms | bf16 ÷ torch-ddp | fp32 step ms | fp32 ÷ torch-ddp |" in summary
    assert "| none | 80.00 | 0.80x | 40.00 | 0.80x |" in summary
    assert "| bucketed (best) | 95.00 (100 MiB) | 0.95x | 60.00 (one bucket) | 1.20x |" in summary
    assert "| fsdp | OOM | - | - | - |" in summary
    mem = _section(text, "### Data parallel memory per rank: tiny, context 32, per-rank batch 2, bf16")
    assert ("| variant | after construction GiB | peak before step GiB | peak during step GiB | parameters GiB | "
            "gradients GiB | optimizer state GiB | activations + other GiB |") in mem
    assert "| none | 1.50 | 6.25 | 7.00 | 1.50 | 1.50 | 3.00 | 0.25 |" in mem
    assert "| torch-ddp | 3.00 | 6.25 | 7.00 |" in mem
    assert "| bucketed 1 MiB | - | - | - | - | - | - | - |" in mem
    assert "| fsdp | OOM | OOM |" in mem
    # fp32 cases recorded no memory (as on a CPU run): no memory table for them
    assert "### Data parallel memory per rank: tiny, context 32, per-rank batch 2, fp32" not in text


def test_bucket_model_matches_hand_computation(tmp_path):
    o, w = 50e-6, 100e9  # all-reduce times exactly o + bytes / w
    mib = 2**20
    allreduce = [_allreduce("nccl", m, 2, o + m * mib / w) for m in (1, 10, 100)]
    allreduce.append(_allreduce("nccl", 10, 4, 1.0))  # another world size: not part of the fit
    dp = [_dp("none", 80.0), _dp("bucketed", 90.0, bucket=1, sync_ms=3.0, num_buckets=5),
          _dp("bucketed", 85.0, bucket=0.5, sync_ms=2.0, num_buckets=8)]
    text = report.render([_dist_run(tmp_path, "ar.json", allreduce), _dist_run(tmp_path, "dp.json", dp)])
    section = _section(text, "### DDP bucket model: tiny, context 32, per-rank batch 2, bf16, 2 ranks (nccl)")
    # tiny: d=64, d_ff=256, 2 layers, vocab 10000: embedding + LM head 2*10000*64, per layer
    # qkv + out 4*64*64, SwiGLU 3*64*256, two norms 2*64, final norm 64
    params = 2 * 10_000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
    s = 4 * params
    assert f"s = gradient bytes = {params:,} parameters × 4 B (fp32 gradients) = {s / 2**30:.3f} GiB" in section
    assert "o = 50.0 µs per call, w = 100.0 GB/s" in section
    optimum = (s * o * w) ** 0.5
    assert f"sqrt(s·o·w) = {optimum / mib:.1f} MiB (n_b* = {s / optimum:.1f} buckets)" in section
    assert f"2·sqrt(s·o÷w) = {2 * (s * o / w) ** 0.5 * 1e3:.2f} ms" in section

    def overhead_ms(n):
        return (n * o + s / (n * w)) * 1e3

    n1, n05 = s / mib, s / (0.5 * mib)
    assert (f"| 1 | {n1:.1f} | 5 | {overhead_ms(n1):.2f} | {overhead_ms(5):.2f} | 90.00 | 10.00 | 3.00 |"
            in section)
    assert (f"| 0.5 | {n05:.1f} | 8 | {overhead_ms(n05):.2f} | {overhead_ms(8):.2f} | 85.00 | 5.00 | 2.00 |"
            in section)
    assert "measured best bucket size: bucketed 0.5 MiB (85.00 ms per step)" in section
    best_formed = "bucketed 0.5 MiB" if overhead_ms(8) < overhead_ms(5) else "bucketed 1 MiB"
    assert f"model predicts the least overhead for {best_formed}" in section


def test_missing_suites_do_not_break_rendering(tmp_path):
    only_dp = report.render([_dist_run(tmp_path, "dp.json", [_dp("bucketed", 90.0, bucket=1)])])
    assert "### Data parallel: tiny" in only_dp
    assert "All-reduce" not in only_dp and "DDP bucket model" not in only_dp
    assert "not measured in one run" in only_dp  # no torch-ddp, no naive
    only_ar = report.render([_dist_run(tmp_path, "ar.json", [_allreduce("gloo", 1, 2, 0.001)])])
    assert "### All-reduce: gloo" in only_ar
    assert "Data parallel" not in only_ar and "DDP bucket model" not in only_ar
    # all-reduce results of another world size only: nothing to fit, no bucket-model section
    mixed = report.render([_dist_run(tmp_path, "m.json", [_allreduce("nccl", 1, 4, 0.001),
                                                          _allreduce("nccl", 10, 4, 0.002),
                                                          _dp("bucketed", 90.0, bucket=1)])])
    assert "DDP bucket model" not in mixed
    # a fit with no bandwidth (times falling with size) says so instead of failing
    falling = report.render([_dist_run(tmp_path, "f.json", [_allreduce("nccl", 1, 2, 0.002),
                                                            _allreduce("nccl", 10, 2, 0.001),
                                                            _dp("bucketed", 90.0, bucket=1)])])
    assert "No fit from the nccl all-reduce times (1, 10 MiB, 2 ranks): times_s do not grow" in falling
    # end-to-end runs render as before, with no distributed sections
    lm = report.render([_run(tmp_path, "lm.json", [_bench("small", 128, "forward", "fp32", False, 0.010)])])
    assert "All-reduce" not in lm and "Data parallel" not in lm


def test_distributed_cases_do_not_collide(tmp_path):
    run = _dist_run(tmp_path, "mix.json", [
        _allreduce("nccl", 1, 2, 0.001), _allreduce("nccl", 1, 4, 0.001), _allreduce("gloo", 1, 2, 0.001),
        _allreduce("nccl", 10, 2, 0.001),
        _dp("bucketed", 90.0, bucket=1), _dp("bucketed", 90.0, bucket=10), _dp("bucketed", 90.0),
        _dp("naive", 90.0), _dp("naive", 90.0, world=4), _dp("naive", 90.0, precision="fp32"),
    ])
    entries, _ = tables.load_runs([run])
    assert len(entries) == 10


# --- comparison of two saved runs (--compare) ----------------------------------------------------------


def _case(fullname, median_s, status="ok"):
    name = fullname.split("::")[-1]
    return {"name": name, "fullname": fullname, "extra_info": {"status": status}, "stats": _stats(median_s)}


def _compare_run(tmp_path, name, cases, oom=(), machine=H200):
    path = tmp_path / name
    path.write_text(json.dumps({
        "machine_info": {"cs336_systems": machine}, "datetime": "2026-11-21T14:00:00+00:00",
        "benchmarks": cases,
        "oom": [{"name": f.split("::")[-1], "fullname": f, "error": "CUDA out of memory", "extra_info": {}}
                for f in oom],
    }))
    return path


def _compare_pair(tmp_path, new_machine=H200):
    old = _compare_run(tmp_path, "old.json", [
        _case("perf/test_a.py::test_x[a]", 0.010),  # -> 0.0125: +25%, slower
        _case("perf/test_a.py::test_x[b]", 0.020),  # -> 0.021: +5%, within 10%
        _case("perf/test_a.py::test_x[c]", 0.004),  # -> 0.003: -25%, faster
        _case("perf/test_b.py::test_x[a]", 0.001),  # same name, another file: a different case
        _case("perf/test_a.py::test_x[gone]", 0.5),
        _case("perf/test_a.py::test_x[d]", 0.1),  # -> OOM
    ])
    new = _compare_run(tmp_path, "new.json", [
        _case("perf/test_a.py::test_x[a]", 0.0125),
        _case("perf/test_a.py::test_x[b]", 0.021),
        _case("perf/test_a.py::test_x[c]", 0.003),
        _case("perf/test_b.py::test_x[a]", 0.00089),  # -11%: faster
        _case("perf/test_a.py::test_x[added]", 0.5),
    ], oom=["perf/test_a.py::test_x[d]"], machine=new_machine)
    return old, new


def test_compare_pairs_by_fullname_with_deltas_flags_and_one_sided_cases(tmp_path):
    old, new = _compare_pair(tmp_path)
    out = tmp_path / "diff.md"
    assert report.main(["--compare", str(old), str(new), "-o", str(out)]) == 0
    text = out.read_text()
    assert "| case | old median | new median | delta | beyond ±10% |" in text
    # paired by node id: the two test_x[a] (two files) are two cases, named in full to tell them apart
    assert "| perf/test_a.py::test_x[a] | 10.00 ms | 12.50 ms | +25.0% | slower |" in text
    assert "| test_x[b] | 20.00 ms | 21.00 ms | +5.0% |  |" in text
    assert "| test_x[c] | 4.00 ms | 3.00 ms | -25.0% | faster |" in text
    assert "| perf/test_b.py::test_x[a] | 1.00 ms | 890.0 µs | -11.0% | faster |" in text
    assert "| test_x[d] | 100.00 ms | OOM | - | ok -> oom |" in text
    assert "5 cases in both runs; beyond ±10%: 1 slower, 2 faster." in text
    assert "## Only in the old run\n\n- `perf/test_a.py::test_x[gone]`" in text
    assert "## Only in the new run\n\n- `perf/test_a.py::test_x[added]`" in text
    # a wider threshold flags less
    wide = run_compare.compare_runs(old, new, threshold=30)
    assert "| perf/test_a.py::test_x[a] | 10.00 ms | 12.50 ms | +25.0% |  |" in wide
    assert "0 slower, 0 faster" in wide


def test_compare_refuses_runs_from_different_machines_unless_asked(tmp_path, capsys):
    old, new = _compare_pair(tmp_path, new_machine=H200 | {"torch": "2.12", "driver": "999"})
    out = tmp_path / "diff.md"
    assert report.main(["--compare", str(old), str(new), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "different machines" in err and "torch: '2.11' vs '2.12'" in err and "--any-machine" in err
    assert "driver" not in err  # not one of the comparable fields
    assert not out.exists()
    assert report.main(["--compare", str(old), str(new), "-o", str(out), "--any-machine"]) == 0
    text = out.read_text()
    assert "**Warning: different machines (torch: '2.11' vs '2.12')" in text
    assert "| perf/test_a.py::test_x[a] | 10.00 ms | 12.50 ms | +25.0% | slower |" in text


def test_compare_rejects_bad_threshold_and_argument_mixes(tmp_path, capsys):
    old, new = _compare_pair(tmp_path)
    for bad in (0, -5, float("nan")):
        try:
            run_compare.compare_runs(old, new, threshold=bad)
        except ValueError as err:
            assert "threshold" in str(err)
        else:
            raise AssertionError(f"threshold {bad} accepted")
    for argv in (["--compare", str(old), str(new), "--threshold", "0"],
                 [str(old), "--compare", str(old), str(new)],
                 ["--compare", str(old), str(new), "--plots", str(tmp_path)],
                 []):
        try:
            report.main(argv)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{argv} accepted")


def _with_commit(path, commit, dirty):
    data = json.loads(path.read_text())
    data["commit_info"] = {"id": commit, "dirty": dirty}
    path.write_text(json.dumps(data))
    return path


def test_compare_names_each_runs_commit_and_warns_about_a_dirty_one(tmp_path):
    old, new = _compare_pair(tmp_path, new_machine=H200)
    _with_commit(old, "15751cf0123456789abcdef0123456789abcdef0", False)
    _with_commit(new, "a8b43aa0123456789abcdef0123456789abcdef0", True)
    text = run_compare.compare_runs(old, new)
    assert f"| old | {old} | 15751cf012 |" in text and f"| new | {new} | a8b43aa012 (dirty) |" in text
    assert f"**Warning: new ({new}) saved from a work tree with uncommitted changes" in text
    _with_commit(new, "a8b43aa0123456789abcdef0123456789abcdef0", False)
    assert "Warning" not in run_compare.compare_runs(old, new)


def test_report_names_each_runs_commit_and_marks_a_dirty_one(tmp_path):
    clean = _with_commit(_run(tmp_path, "clean.json", [_bench("small", 128, "forward", "fp32", False, 0.01)]),
                         "15751cf0123456789abcdef0123456789abcdef0", False)
    dirty = _with_commit(_run(tmp_path, "dirty.json", [_bench("small", 256, "forward", "fp32", False, 0.02)]),
                         "a8b43aa0123456789abcdef0123456789abcdef0", True)
    out = tmp_path / "report.md"
    assert report.main([str(clean), str(dirty), "-o", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if "clean.json" in line or "dirty.json" in line]
    assert any("| 15751cf012 |" in r for r in rows if "clean.json" in r)
    assert any("| a8b43aa012 (dirty) |" in r for r in rows if "dirty.json" in r)


# --- the README's generated Results block (--readme) ---------------------------------------------------

README = """# Project

Intro prose with a number: 1.23 ms.

## Results

Hand-written lead-in.

<!-- results:start -->
stale generated text
<!-- results:end -->

Hand-written tail.

## Layout

Untouched <!-- results:start --> mention outside the section.
"""


def _readme_runs(tmp_path):
    """A small 'repository': the end-to-end headline in two runs and a leaderboard run."""
    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "cuda": "13.0", "torch": "2.11.0",
            "triton": "3.6.0", "driver": "580", "cudnn": 91900}
    runs = tmp_path / "results" / "gpu"
    runs.mkdir(parents=True)

    def save(name, benchmarks, stamp):
        (runs / name).write_text(json.dumps({"machine_info": {"cs336_systems": h100}, "datetime": stamp,
                                             "commit_info": {"id": "15751cf5d3" + "0" * 30, "dirty": False},
                                             "benchmarks": benchmarks, "oom": []}))

    def e2e(mode, compiled, median_s, mfu, tflops, context=512):
        bench = _bench("2.7B", context, mode, "bf16", compiled, median_s)
        bench["extra_info"] |= {"mfu": mfu, "tflops": tflops, "peak_tflops": 989.4}
        return bench

    save("eager.json", [e2e("forward", False, 0.040, 0.35, 345.0), e2e("train-step", False, 0.150, 0.275, 272.0),
                        e2e("forward", False, 0.001, 0.1, 1.0, context=128)],
         "2026-11-21T12:42:34+00:00")
    save("compiled.json", [e2e("train-step", True, 0.120, 0.336, 333.0)], "2026-11-21T12:43:37+00:00")
    board = dict(dtype="bf16", causal=True, batch=1, heads=16, flush=True, timing="device")
    save("board.json", [
        _attn("test_leaderboard", "flash-triton", 16384, 64, "forward", 0.0015, compile_=True, tflops=360.0, **board),
        _attn("test_leaderboard", "flash-triton", 16384, 64, "forward", 0.0016, tflops=350.0, **board),
        _attn("test_leaderboard", "sdpa-flash", 16384, 64, "forward", 0.002, tflops=270.0, **board),
        _attn("test_leaderboard", "sdpa-cudnn", 16384, 64, "forward", 0.001, tflops=540.0, **board),
    ], "2026-11-21T14:12:06+00:00")
    sections = (
        readme_results.ResultsSection("Headline", ("results/gpu/eager.json", "results/gpu/compiled.json"),
                              readme_results.headline_table),
        readme_results.ResultsSection("Leaderboard", ("results/gpu/board.json",), readme_results.leaderboard_summary),
    )
    return sections


def _block(text):
    return text.split("<!-- results:start -->")[1].split("<!-- results:end -->")[0]


def test_readme_block_replaced_in_place_and_idempotent(tmp_path):
    sections = _readme_runs(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert readme_results.update_readme(readme, sections) is True
    text = readme.read_text()
    before, after = README.split("<!-- results:start -->", 1)[0], README.split("<!-- results:end -->")[1]
    assert text.startswith(before + "<!-- results:start -->\n") and text.endswith("<!-- results:end -->" + after)
    block = _block(text)
    assert "stale" not in block
    assert ("Device: NVIDIA H100 80GB HBM3 ×1, driver 580; CUDA 13.0, torch 2.11.0, triton 3.6.0, cuDNN 91900. "
            "Date: 2026-11-21 (12:42–12:43 UTC). Runs: [`results/gpu/eager.json`](results/gpu/eager.json) (commit "
            "15751cf5d3), [`results/gpu/compiled.json`](results/gpu/compiled.json) (commit 15751cf5d3).") in block
    # headline: the 2.7B ctx-512 case only (the ctx-128 one is not it); 120 / 150 = 0.80 across two runs
    assert "| forward | 40.00 | 345 | 35.0% | - | - | - | - |" in block
    assert "| train-step | 150.00 | 272 | 27.5% | 120.00 | 333 | 33.6% | 0.80† |" in block
    assert "MFU against the dense datasheet peak (989.4 TFLOP/s)" in block
    # leaderboard: compiled flash-triton (not the eager one) over each SDPA kernel, same run
    assert "| forward | 1.50 | 360.0 | 2.00 | 270.0 | 1.00 | 540.0 | 0.75 | 1.50 |" in block
    assert "Date: 2026-11-21 (14:12 UTC)" in block
    assert readme_results.update_readme(readme, sections) is False
    assert readme.read_text() == text
    assert report.main(["--readme", str(tmp_path / "no-such-readme.md")]) == 2


@pytest.mark.parametrize("commit_info, why", [({"id": "15751cf5d3" + "0" * 30, "dirty": True}, "uncommitted changes"),
                                              (None, "without a commit")])
def test_readme_refuses_runs_that_cannot_be_traced_to_code(tmp_path, commit_info, why):
    sections = _readme_runs(tmp_path)
    board = tmp_path / "results" / "gpu" / "board.json"
    data = json.loads(board.read_text())
    data["commit_info"] = commit_info
    board.write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    with pytest.raises(readme_results.UntraceableRun, match=f"'Leaderboard'.*board.json was saved .*{why}"):
        readme_results.update_readme(readme, sections)
    assert readme.read_text() == README


def test_the_committed_readme_block_comes_from_clean_commits():
    root = Path(__file__).resolve().parents[2]
    for section in readme_results.README_RESULTS:
        for run in section.runs:
            info = json.loads((root / run).read_text()).get("commit_info") or {}
            assert info.get("id") and not info.get("dirty"), (section.title, run)


def test_readme_markers_missing_misplaced_or_duplicated_fail_clearly(tmp_path, capsys):
    sections = _readme_runs(tmp_path)
    cases = {
        "no heading": README.replace("## Results", "## Outcomes"),
        "no start": README.replace("<!-- results:start -->\nstale", "stale"),
        "no end": README.replace("<!-- results:end -->", ""),
        "twice": README.replace("Hand-written tail.", "<!-- results:start -->\n<!-- results:end -->"),
        "outside": README.replace("<!-- results:start -->\nstale generated text\n<!-- results:end -->", "")
        + "\n<!-- results:start -->\n<!-- results:end -->\n",
        "reversed": README.replace("<!-- results:start -->\nstale generated text\n<!-- results:end -->",
                                   "<!-- results:end -->\n<!-- results:start -->"),
    }
    for label, text in cases.items():
        readme = tmp_path / f"{label}.md"
        readme.write_text(text)
        try:
            readme_results.update_readme(readme, sections)
        except readme_results.ReadmeMarkersError as err:
            assert str(readme) in str(err), label
        else:
            raise AssertionError(f"{label}: accepted")
        assert readme.read_text() == text, label  # untouched
        assert report.main(["--readme", str(readme)]) == 2
        assert "error:" in capsys.readouterr().err


def test_committed_readme_results_block_is_generated_from_the_committed_runs():
    """The README's block is what `--readme` produces from results/ (regenerate it after changing either)."""
    root = Path(report.__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    start, end = readme_results.results_span(text, root / "README.md")
    expected = readme_results.readme_block(root, write_plots=False)
    assert text[start:end] == "\n" + expected + "\n"
    for link in re.findall(r"\]\((results/[^)]+)\)", expected):
        assert (root / link).is_file(), link
    for section in readme_results.README_RESULTS:  # every section rendered a table or a plot
        assert f"### {section.title}\n" in expected


def test_plots_without_matplotlib_fail_naming_the_extra(tmp_path, monkeypatch, capsys):
    from cs336_systems.reporting import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    run = _dist_run(tmp_path, "ar.json", [_allreduce("gloo", 1, 2, 0.001)])
    assert report.main([str(run), "-o", str(tmp_path / "r.md"), "--plots", str(tmp_path / "plots")]) == 2
    assert "`plot` extra" in capsys.readouterr().err
    try:
        plots.write_plots(plots.all_plots(*tables.load_runs([run])), tmp_path / "plots")
    except plots.MissingPlotExtra as err:
        assert "pip install -e '.[plot]'" in str(err)
    else:
        raise AssertionError("no error without matplotlib")
    # the report itself needs no matplotlib
    assert report.main([str(run), "-o", str(tmp_path / "r.md")]) == 0


def test_readme_allreduce_and_data_parallel_summaries(tmp_path):
    mib = 2**20
    runs = [_dist_run(tmp_path, "ar.json", [
        _allreduce("nccl", 1, 2, mib / 64e9), _allreduce("nccl", 10, 2, 10 * mib / 75e9),
        _allreduce("gloo", 1, 2, mib / 2e9), _allreduce("gloo", 1, 4, 0.001)])]
    runs.append(_dist_run(tmp_path, "dp.json", _ddp_group("bf16", torch_ddp=100.0, best_bucket=98.0,
                                                          naive_sync=40.0, individual_sync=8.0)))
    entries, machines = tables.load_runs(runs)
    table = readme_results.allreduce_summary(entries, machines)
    assert ("| size MiB | nccl 2 ranks busbw GB/s | gloo 2 ranks busbw GB/s | gloo 4 ranks busbw GB/s | "
            "reference GB/s |") in table
    # gloo at 4 ranks: busbw = 1 MiB / 1 ms * 2 * 3 / 4 = 1.57 GB/s; the reference is for 2 ranks only
    assert "| 1 | 64.0 | 2.0 | 1.6 | nccl 32, gloo 1–2.7 |" in table
    assert "| 10 | 75.0 | - | - | nccl 150 |" in table
    dp = readme_results.data_parallel_readme(entries, machines)
    assert dp.startswith("#### Data parallel summary: tiny, context 32, per-rank batch 2, 2 ranks (nccl)")
    assert "| bucketed (best) | 98.00 (10 MiB) | 0.98x |" in dp
    assert ("- tiny, context 32, per-rank batch 2, bf16, 2 ranks (nccl): Targets: DDPBucketed's best "
            "bucket size ≤ 0.98x torch DDP's step: best is bucketed 10 MiB at 98.00 ms = 0.980x torch DDP -> "
            "**met**.") in dp
    for bad in (dict(runs=()), dict(runs=("a.json",), plots_dir="x"),
                dict(runs=("a.json",), plots=readme_results.allreduce_summary)):
        try:
            readme_results.ResultsSection("bad", **bad)
        except ValueError as err:
            assert "'bad'" in str(err)
        else:
            raise AssertionError(f"{bad} accepted")


def test_checkpointing_table_relates_every_policy_to_none(tmp_path):
    def ckpt(policy, median_s, peak):
        entry = _bench("xl", 512, "train-step", "bf16", False, median_s, test="test_checkpointing")
        entry["extra_info"].update(checkpoint=policy, peak_memory_gib=peak)
        return entry

    run = _run(tmp_path, "ckpt.json", [ckpt("sqrt", 0.150, 12.0), ckpt("none", 0.100, 40.0), ckpt("every-1", 0.130, 20.0)])
    text = lm_tables.checkpointing_tables(tables.load_runs([run])[0])
    assert "### Activation checkpointing: xl, context 512, batch 4, train-step, bf16, eager" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "policy" not in line]
    assert lines[0].startswith("| none | 100.00 ± 1.00 | 1.00x | 40.00 | 1.00x |")  # none first
    assert "| every-1 | 130.00 ± 1.30 | 1.30x | 20.00 | 0.50x |" in text
    assert "| sqrt | 150.00 ± 1.50 | 1.50x | 12.00 | 0.30x |" in text
    assert lm_tables.checkpointing_tables(tables.load_runs([_run(tmp_path, "e.json", [])])[0]) == ""


def test_peak_memory_table_per_mode_and_precision(tmp_path):
    entries = []
    for mode, precision, peak in [("forward", "fp32", 12.9), ("forward", "bf16", 19.1), ("train-step", "fp32", 51.0)]:
        bench = _bench("2.7B", 128, mode, precision, False, 0.1)
        bench["extra_info"]["peak_memory_gib"] = peak
        entries.append(bench)
    compiled = _bench("2.7B", 128, "forward", "fp32", True, 0.1)  # compiled cases are not in this table
    compiled["extra_info"]["peak_memory_gib"] = 99.0
    text = lm_tables.peak_memory_tables(tables.load_runs([_run(tmp_path, "m.json", entries + [compiled])])[0])
    assert "| size | context | batch | forward fp32 GiB | forward bf16 GiB | train-step fp32 GiB |" in text
    assert "| 2.7B | 128 | 4 | 12.90 | 19.10 | 51.00 |" in text and "99.00" not in text


# --- our model against the hf-llama baseline ------------------------------------------------------------------

def _impl(bench, impl):
    bench["extra_info"]["impl"] = impl
    return bench


def test_end_to_end_report_shows_baseline_rows_and_own_over_hf_where_both_ran_in_one_run(tmp_path):
    first = _run(tmp_path, "a.json", [
        _bench("xl", 512, "train-step", "bf16", False, 0.080),  # saved before the impl axis: our model
        _impl(_bench("xl", 512, "train-step", "bf16", False, 0.100), "hf-llama"),
        _impl(_bench("xl", 512, "train-step", "bf16", True, 0.070), "own"),
    ])
    second = _run(tmp_path, "b.json", [_impl(_bench("xl", 512, "train-step", "bf16", True, 0.090), "hf-llama")])
    text = report.render([first, second])
    own = _section(text, "### End-to-end: bf16, eager, attention=sdpa, batch=4")
    assert "| xl | 512 | 80.00 ± 0.80 |" in own and "100.00" not in own
    hf = _section(text, "### End-to-end, hf-llama baseline (Hugging Face LlamaForCausalLM): bf16, eager, "
                        "attention=sdpa, batch=4")
    assert "| xl | 512 | 100.00 ± 1.00 |" in hf and "80.00" not in hf
    assert text.index("### End-to-end: bf16, eager") < text.index("### End-to-end, hf-llama baseline")
    versus = _section(text, "### Own model vs hf-llama (Hugging Face LlamaForCausalLM)")
    assert "| size | context | batch | mode | precision | compile | attention | own optimizer | HF optimizer | " \
           "own median ms | HF median ms | own / HF |" in versus
    assert "| xl | 512 | 4 | train-step | bf16 | eager | sdpa | adamw | adamw | 80.00 | 100.00 | 0.80 | 25.0% | " \
           "25.0% |" in versus
    # compiled: both measured, but in two saved runs: no ratio
    assert "| xl | 512 | 4 | train-step | bf16 | compiled | sdpa | adamw | adamw | 70.00 | 90.00 | - |" in versus
    # eager vs compiled pairs within one implementation, never ours with the baseline
    speedups = _section(text, "### eager vs torch.compile")
    assert "| own | xl | 512 | 4 | train-step | bf16 | sdpa | 80.00 | 70.00 | 1.14x |" in speedups
    # eager and compiled HF come from two saved runs: the speedup says so
    assert "| hf-llama | xl | 512 | 4 | train-step | bf16 | sdpa | 100.00 | 90.00 | 1.11x† |" in speedups
    assert "†: the two cases come from different saved runs" in speedups
    assert "hf-llama" not in _section(text, "### Peak memory (eager, SDPA attention)")


def test_end_to_end_report_splits_our_optimizers_and_pairs_each_with_the_baseline(tmp_path):
    def master(bench):
        bench["extra_info"]["optimizer"] = "adamw-master"
        return bench

    run = _run(tmp_path, "a.json", [
        _impl(_bench("2.7B", 512, "train-step", "bf16", True, 0.128), "own"),  # no optimizer recorded: adamw
        master(_impl(_bench("2.7B", 512, "train-step", "bf16", True, 0.112), "own")),
        master(_impl(_bench("2.7B", 512, "train-step", "bf16", False, 0.140), "own")),
        _impl(_bench("2.7B", 512, "train-step", "bf16", True, 0.132), "hf-llama"),
    ])
    text = report.render([run])
    adamw = _section(text, "### End-to-end: bf16, compiled, attention=sdpa, batch=4\n")
    assert "128.00" in adamw and "112.00" not in adamw
    assert "112.00" in _section(text, "### End-to-end: bf16, compiled, attention=sdpa, batch=4, optimizer=adamw-master")
    versus = _section(text, "### Own model vs hf-llama (Hugging Face LlamaForCausalLM)")
    assert "| 2.7B | 512 | 4 | train-step | bf16 | compiled | sdpa | adamw | adamw | 128.00 | 132.00 | 0.97 |" in versus
    assert "| 2.7B | 512 | 4 | train-step | bf16 | compiled | sdpa | adamw-master | adamw | 112.00 | 132.00 | 0.85 |" \
        in versus
    speedups = _section(text, "### eager vs torch.compile")  # within one optimizer: only the master pair
    assert "| own | adamw-master | 2.7B | 512 | 4 | train-step | bf16 | sdpa | 140.00 | 112.00 | 1.25x |" in speedups
    assert speedups.count("| own |") == 1


def test_without_a_baseline_there_is_no_baseline_table_or_impl_column(tmp_path):
    text = report.render([_run(tmp_path, "a.json", [_bench("xl", 512, "forward", "bf16", False, 0.01),
                                                    _bench("xl", 512, "forward", "bf16", True, 0.005)])])
    assert "Own model vs" not in text and "hf-llama" not in text
    assert "| size | context | batch_size | mode | precision | attention | False median ms |" in text


def test_readme_headline_adds_hf_rows_and_own_over_hf_columns_when_the_runs_have_the_baseline(tmp_path):
    def e2e(mode, compiled, median_s, impl):
        bench = _impl(_bench("2.7B", 512, mode, "bf16", compiled, median_s), impl)
        bench["extra_info"] |= {"tflops": 300.0, "peak_tflops": 989.4}
        return bench

    run = _run(tmp_path, "hf.json", [
        e2e("forward", False, 0.040, "own"),
        e2e("train-step", False, 0.150, "own"), e2e("train-step", False, 0.200, "hf-llama"),
        e2e("train-step", True, 0.120, "own"), e2e("train-step", True, 0.150, "hf-llama"),
    ])
    entries, machines = tables.load_runs([run])
    table = readme_results.headline_table(entries, machines)
    assert ("| mode | impl | eager median ms | eager TFLOP/s | eager MFU | compiled median ms | compiled TFLOP/s | "
            "compiled MFU | compiled ÷ eager | own / HF eager | own / HF compiled |") in table
    assert "| forward | own | 40.00 | 300 | 25.0% | - | - | - | - | - | - |" in table
    assert "| train-step | own | 150.00 | 300 | 25.0% | 120.00 | 300 | 25.0% | 0.80 | 0.75 | 0.80 |" in table
    assert "| train-step | hf-llama | 200.00 | 300 | 25.0% | 150.00 | 300 | 25.0% | 0.75 | - | - |" in table
    assert "| forward | hf-llama |" not in table  # the baseline's forward did not run
    assert "hf-llama: Hugging Face LlamaForCausalLM of the same size" in table


def test_readme_optimizer_table_pairs_models_per_optimizer_from_one_run(tmp_path):
    def step(impl, optimizer, median_s, compiled=True):
        bench = _impl(_bench("2.7B", 512, "train-step", "bf16", compiled, median_s), impl)
        bench["extra_info"] |= {"peak_tflops": 989.4} | ({"optimizer": optimizer} if optimizer else {})
        return bench

    run = _run(tmp_path, "four.json", [
        step("own", None, 0.116), step("hf-llama", "adamw", 0.120), step("own", "adamw-master", 0.100),
        step("hf-llama", "adamw-master", 0.110), step("own", "adamw-master-fp32", 0.104),
        step("own", "adamw-master", 0.300, compiled=False),  # eager: not in the table
    ])
    entries, machines = tables.load_runs([run])
    table = readme_results.optimizer_table(entries, machines)
    assert "| torch AdamW, float32 weights | 116.00 | 25.0% | 1.5 | 120.00 | 25.0% | 1.5 | 0.97 |" in table
    assert "| AdamWMaster (bf16 compute weights) | 100.00 | 25.0% | 1.5 | 110.00 | 25.0% | 1.5 | 0.91 |" in table
    assert "| AdamWMaster, float32 master copies | 104.00 | 25.0% | 1.5 | - | - | - | - |" in table
    assert "| each one's fastest (adamw-master / adamw-master) | 100.00 |" in table and "300.00" not in table
    other = _run(tmp_path, "other.json", [step("hf-llama", "adamw", 0.2)])
    with pytest.raises(ValueError, match="one saved run"):
        readme_results.optimizer_table(*tables.load_entries([run, other]))


def test_gpu_clock_table_lists_end_to_end_cases_that_recorded_telemetry(tmp_path):
    hot = _impl(_bench("2.7B", 512, "train-step", "bf16", True, 0.1204), "own")
    hot["extra_info"].update(gpu_samples=120, gpu_sm_clock_mhz_median=1935, gpu_sm_clock_mhz_min=1785,
                             gpu_power_w_median=640.2, gpu_power_w_max=690.0, gpu_temperature_c_start=56,
                             gpu_temperature_c_max=61, gpu_slowdown_fraction=0.42,
                             gpu_slowdown_reasons=["sw_power_cap"], cooldown_s=7.5, host_share=0.2712)
    untracked = _impl(_bench("2.7B", 512, "train-step", "bf16", False, 0.130), "hf-llama")
    text = report.render([_run(tmp_path, "a.json", [hot, untracked])])
    table = _section(text, "### GPU clocks during the measured rounds (end-to-end)")
    assert "| 2.7B | 512 | 4 | train-step | bf16 | compiled | own | sdpa | adamw | 120.40 | 0.27 | 1935 / 1785 | 640 / 690 | " \
           "56 / 61 | 42% (sw_power_cap) | 7.5 |" in table
    assert "hf-llama" not in table  # no telemetry recorded for it
    assert "GPU clocks" not in report.render([_run(tmp_path, "b.json", [untracked])])


def test_cuda_graph_cases_are_their_own_compile_mode_in_the_tables(tmp_path):
    compiled = _bench("small", 512, "train-step", "bf16", True, 0.0180)
    graphs = _bench("small", 512, "train-step", "bf16", True, 0.0093)
    graphs["extra_info"]["cuda_graphs"] = True
    hf_graphs = _impl(_bench("small", 512, "train-step", "bf16", True, 0.0124), "hf-llama")
    hf_graphs["extra_info"]["cuda_graphs"] = True
    text = report.render([_run(tmp_path, "a.json", [compiled, graphs, hf_graphs])])
    assert "18.00 ± 0.18" in _section(text, "### End-to-end: bf16, compiled, attention=sdpa, batch=4")
    assert "9.30 ± 0.09" in _section(text, "### End-to-end: bf16, compiled + CUDA graphs, attention=sdpa, batch=4")
    versus = _section(text, "### Own model vs hf-llama (Hugging Face LlamaForCausalLM)")
    assert "| small | 512 | 4 | train-step | bf16 | compiled + CUDA graphs | sdpa | adamw | adamw | 9.30 | 12.40 | 0.75 |" \
        in versus


def test_report_refuses_runs_of_different_machines_unless_any_machine(tmp_path, capsys):
    """One table of an H100 run and another GPU's run would read as one comparison: refused (exit 2) unless
    --any-machine, which renders them under a warning naming the run that differs."""
    from cs336_systems.reporting import render

    h100 = _cpu_run_for_report_tests(tmp_path, "a.json", gpu_name="NVIDIA H100 80GB HBM3")
    h200 = _cpu_run_for_report_tests(tmp_path, "b.json", gpu_name="NVIDIA H200")
    assert render.main([str(h100), str(h200)]) == 2
    err = capsys.readouterr().err
    assert "different machines or software" in err and "gpu_name 'NVIDIA H200'" in err and "--any-machine" in err
    assert render.main([str(h100), str(h200), "--any-machine"]) == 0
    out = capsys.readouterr().out
    assert "mixes runs from different machines" in out and str(h200) in out
    assert render.main([str(h100), str(_cpu_run_for_report_tests(tmp_path, "c.json",
                                                                  gpu_name="NVIDIA H100 80GB HBM3"))]) == 0


@pytest.mark.parametrize("median", ["12.5", float("nan"), float("inf"), -1.0, None])
def test_report_refuses_corrupt_statistics_naming_the_file_and_case(tmp_path, capsys, median):
    from cs336_systems.reporting import render

    path = _cpu_run_for_report_tests(tmp_path, "run.json", gpu_name="NVIDIA H100 80GB HBM3")
    data = json.loads(path.read_text())
    data["benchmarks"][0]["stats"]["median"] = median
    path.write_text(json.dumps(data))
    assert render.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and data["benchmarks"][0]["name"] in err and "stats.median" in err
    assert "Traceback" not in err


def _cpu_run_for_report_tests(tmp_path, name, gpu_name):
    path = _run(tmp_path, name, [_bench("small", 128, "forward", "fp32", False, 0.01)])
    data = json.loads(path.read_text())
    data["machine_info"]["cs336_systems"]["gpu_name"] = gpu_name
    path.write_text(json.dumps(data))
    return path
