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
