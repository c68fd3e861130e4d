"""PNG plots from saved runs (cs336_systems.reporting.plots), built from synthetic cpu-profile-like JSON.

These tests need matplotlib (the ``plot`` extra: ``pip install -e '.[dev,plot]'``); without it they are
reported as skipped with that reason.  The report's behaviour without matplotlib is tested in
test_report.py.
"""

import json

import pytest

matplotlib = pytest.importorskip("matplotlib", reason="plot tests need matplotlib: pip install -e '.[dev,plot]'")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import imread  # noqa: E402

from cs336_systems.reporting import (
    plots,  # noqa: E402
    tables,
)
from cs336_systems.reporting import readme_block as readme_results
from cs336_systems.reporting import render as report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = {"gpu_name": None, "gpu_count": 0, "cuda": None, "torch": "2.13.0+cpu", "triton": "3.6.0", "driver": None,
       "cudnn": None, "python": "3.12.3"}
H200 = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "cuda": "13.0", "torch": "2.11.0", "triton": "3.6.0",
        "driver": "580", "cudnn": 91900}
MIB = 2**20


def _stats(median_s):
    return {"mean": median_s, "stddev": 0.0, "median": median_s, "min": median_s, "max": median_s}


def _bench(test, name, info, median_s):
    return {"name": f"{test}[{name}]", "fullname": f"perf/x.py::{test}[{name}]",
            "extra_info": {"status": "ok", "device": "cpu", **info}, "stats": _stats(median_s)}


def _oom(test, name, info):
    return {"name": f"{test}[{name}]", "fullname": f"perf/x.py::{test}[{name}]", "error": "out of memory",
            "extra_info": {"device": "cpu", **info}}


def _attention(impl, n, d, mode, **extra):
    return {"impl": impl, "batch_size": 8, "heads": None, "seq_len": n, "head_dim": d, "dtype": "fp32",
            "causal": False, "mode": mode, "compile": False, "flush_l2": False, "warmup": 1, "rounds": 3, **extra}


def _flash(impl, n, d, mode, tflops):
    return {"impl": impl, "batch_size": 1, "heads": None, "seq_len": n, "head_dim": d, "dtype": "bf16",
            "causal": True, "mode": mode, "compile": False, "flush_l2": False, "suite": "flash", "tflops": tflops}


def _allreduce(backend, size_mb, world, median_s):
    algbw = size_mb * MIB / median_s
    return {"suite": "allreduce", "backend": backend, "size_mb": size_mb, "world_size": world,
            "bytes": size_mb * MIB, "algbw_gbps": algbw / 1e9, "busbw_gbps": algbw * 2 * (world - 1) / world / 1e9}


def _dp(variant, bucket=None, memory=None, precision="fp32"):
    info = {"suite": "data_parallel", "variant": variant, "bucket_size_mb": bucket, "size": "tiny", "context": 32,
            "batch_size": 2, "precision": precision, "world_size": 2, "backend": "gloo"}
    return info | ({"memory_gib": memory} if memory else {})


def _memory(parameters, gradients, optimizer, other):
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer,
            "activations_other": other, "peak_before_step": parameters + gradients + optimizer + other}


# Known numbers: medians in seconds, and the values each plot must show.
ATTENTION = {  # (impl, N, d, mode): median s
    ("naive", 256, 16, "forward"): 0.001, ("naive", 512, 16, "forward"): 0.004,
    ("flash-pytorch", 256, 16, "forward"): 0.002, ("flash-pytorch", 512, 16, "forward"): 0.003,
    ("flash-pytorch", 1024, 16, "forward"): 0.006,
    ("naive", 256, 64, "forward"): 0.002, ("naive", 256, 16, "backward"): 0.003,
    ("naive", 512, 16, "backward"): 0.009,
}
ATTENTION_MEMORY = {("naive", 256, 16): 0.25, ("naive", 512, 16): 1.0}
FLASH = {("flash-triton", 128, 32): 0.5, ("flash-triton", 256, 32): 2.0, ("naive", 128, 32): 0.25,
         ("naive", 256, 32): 0.5, ("flash-triton", 128, 64): 1.0}
ALLREDUCE = {(1, 2): 0.002, (10, 2): 0.010, (10, 4): 0.030}
DDP = {("none", None): 0.080, ("torch-ddp", None): 0.100, ("bucketed", 1): 0.120, ("bucketed", 10): 0.095,
       ("bucketed", 100): 0.105, ("bucketed", None): 0.110}
MEMORY = {"none": _memory(1.0, 1.0, 2.0, 0.5), "torch-ddp": _memory(1.0, 1.0, 2.0, 1.5)}


def _cpu_run(tmp_path):
    benchmarks = []
    for (impl, n, d, mode), median in ATTENTION.items():
        memory = ATTENTION_MEMORY.get((impl, n, d)) if mode == "backward" else None
        extra = {"memory_before_backward_gib": memory} if memory is not None else {}
        benchmarks.append(_bench("test_attention", f"{impl}-{n}-{d}-{mode}", _attention(impl, n, d, mode, **extra),
                                 median))
    for (impl, n, d), tflops in FLASH.items():
        benchmarks.append(_bench("test_flash", f"{impl}-{n}-{d}", _flash(impl, n, d, "forward", tflops), 0.001))
    for (size, world), median in ALLREDUCE.items():
        benchmarks.append(_bench("test_allreduce", f"gloo-{size}-{world}", _allreduce("gloo", size, world, median),
                                 median))
    for (variant, bucket), median in DDP.items():
        benchmarks.append(_bench("test_data_parallel", f"{variant}-{bucket}",
                                 _dp(variant, bucket, MEMORY.get(variant) if bucket is None else None), median))
    oom = [_oom("test_attention", "naive-1024-16-forward", _attention("naive", 1024, 16, "forward")),
           _oom("test_attention", "naive-1024-16-backward",
                _attention("naive", 1024, 16, "backward", memory_before_backward_gib=4.0))]
    path = tmp_path / "perf-cpu.json"
    path.write_text(json.dumps({"machine_info": {"cs336_systems": CPU}, "datetime": "2026-11-21T10:00:00+00:00",
                                "commit_info": {"id": "15751cf5d3" + "0" * 30, "dirty": False},
                                "benchmarks": benchmarks, "oom": oom}))
    return path


EXPECTED_FILES = {
    "attention-latency-fp32-noncausal-b8-forward.png",
    "attention-latency-fp32-noncausal-b8-backward.png",
    "attention-memory-fp32-noncausal-b8.png",
    "flash-tflops-bf16-causal-b1-forward.png",
    "allreduce-busbw-gloo.png",
    "ddp-buckets-tiny-ctx32-b2-fp32-2ranks-gloo.png",
    "memory-tiny-ctx32-b2-fp32-2ranks-gloo.png",
}


def _drawn(plot):
    fig = Figure(layout="constrained")
    plot.draw(fig)
    return fig


def _specs(tmp_path):
    entries, machines = tables.load_runs([_cpu_run(tmp_path)])
    return {p.filename: p for p in plots.all_plots(entries, machines)}


def _lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_report_cli_writes_every_plot_as_a_valid_png_and_links_it(tmp_path):
    run = _cpu_run(tmp_path)
    out = tmp_path / "out" / "report.md"
    out.parent.mkdir()
    assert report.main([str(run), "-o", str(out), "--plots", str(tmp_path / "out" / "plots")]) == 0
    written = {p.name for p in (tmp_path / "out" / "plots").iterdir()}
    assert written == EXPECTED_FILES
    text = out.read_text()
    assert "## Plots" in text
    for name in EXPECTED_FILES:
        path = tmp_path / "out" / "plots" / name
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name
        height, width, channels = imread(path).shape
        assert height >= 300 and width >= 400 and channels in (3, 4), name
        assert f"](plots/{name})" in text, name  # linked relative to the report's directory
    # the tables are still there
    assert "### Attention sweep: fp32, not causal, B=8" in text and "### All-reduce: gloo" in text


def test_attention_plots_show_the_medians_and_memory_per_head_dim(tmp_path):
    specs = _specs(tmp_path)
    fig = _drawn(specs["attention-latency-fp32-noncausal-b8-forward.png"])
    d16, d64 = fig.axes
    assert (d16.get_title(), d64.get_title()) == ("d = 16", "d = 64")
    assert d16.get_xscale() == "log" and d16.get_yscale() == "log"
    assert _lines(d16) == {
        "naive (OOM from N=1024)": ([256, 512], [1.0, 4.0]),
        "flash-pytorch": ([256, 512, 1024], [2.0, 3.0, 6.0]),
    }
    assert _lines(d64) == {"naive": ([256], [2.0])}
    backward = _drawn(specs["attention-latency-fp32-noncausal-b8-backward.png"])
    assert _lines(backward.axes[0]) == {"naive (OOM from N=1024)": ([256, 512], [3.0, 9.0])}
    memory = _drawn(specs["attention-memory-fp32-noncausal-b8.png"])
    # memory in use before backward, including the case whose backward then ran out of memory
    assert _lines(memory.axes[0]) == {"naive (OOM from N=1024)": ([256, 512, 1024], [0.25, 1.0, 4.0])}
    assert "CPU" in specs["attention-memory-fp32-noncausal-b8.png"].title


def test_flash_plot_shows_tflops_per_implementation(tmp_path):
    fig = _drawn(_specs(tmp_path)["flash-tflops-bf16-causal-b1-forward.png"])
    d32, d64 = fig.axes
    assert d32.get_xscale() == "log" and d32.get_yscale() == "linear"
    assert _lines(d32) == {"naive": ([128, 256], [0.25, 0.5]), "flash-triton": ([128, 256], [0.5, 2.0])}
    assert _lines(d64) == {"flash-triton": ([128], [1.0])}


def test_allreduce_plot_one_line_per_world_size_and_reference_on_h200(tmp_path):
    fig = _drawn(_specs(tmp_path)["allreduce-busbw-gloo.png"])
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    lines = _lines(ax)
    # busbw = bytes / time * 2 (n - 1) / n
    assert lines["2 ranks"][0] == [1, 10]
    assert lines["2 ranks"][1] == pytest.approx([MIB / 0.002 / 1e9, 10 * MIB / 0.010 / 1e9])
    assert lines["4 ranks"][1] == pytest.approx([10 * MIB / 0.030 * 1.5 / 1e9])
    assert "tensors on the CPU" in ax.get_title()
    # on 2xH200 the NVLink reference is drawn: NCCL points at 1 and 10 MiB (2 ranks only), gloo a band
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"machine_info": {"cs336_systems": H200}, "benchmarks": [
        _bench("test_allreduce", f"{b}-{s}-{w}", _allreduce(b, s, w, 0.001), 0.001)
        for b, s, w in (("nccl", 1, 2), ("nccl", 10, 2), ("nccl", 10, 4), ("gloo", 1, 2))]}))
    by_name = {p.filename: p for p in plots.all_plots(*tables.load_runs([path]))}
    nccl = _lines(_drawn(by_name["allreduce-busbw-nccl.png"]).axes[0])
    assert nccl["reference (2xH200 NVLink)"] == ([1, 10], [32.0, 150.0])
    gloo_ax = _drawn(by_name["allreduce-busbw-gloo.png"]).axes[0]
    (band,) = gloo_ax.patches
    assert band.get_label() == "reference (2xH200 NVLink)"
    corners = band.get_patch_transform().transform(band.get_path().vertices)  # y in data units
    low, high = sorted({round(float(y), 9) for y in corners[:, 1]})
    assert (low, high) == pytest.approx((1.0, 2.7))


def test_ddp_plot_bucket_line_and_horizontal_baselines(tmp_path):
    fig = _drawn(_specs(tmp_path)["ddp-buckets-tiny-ctx32-b2-fp32-2ranks-gloo.png"])
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    lines = _lines(ax)
    assert lines["bucketed"] == ([1, 10, 100], pytest.approx([120.0, 95.0, 105.0]))
    for label, ms in (("none (no communication)", 80.0), ("torch-ddp", 100.0), ("bucketed (one bucket)", 110.0)):
        assert lines[label][1] == pytest.approx([ms, ms]), label  # a horizontal line


def test_memory_plot_stacks_the_breakdown_per_variant(tmp_path):
    fig = _drawn(_specs(tmp_path)["memory-tiny-ctx32-b2-fp32-2ranks-gloo.png"])
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "torch-ddp"]  # variants without memory left out
    parts = [c.get_label() for c in ax.containers]
    assert parts == ["parameters", "gradients", "optimizer state", "activations + other"]
    for index, variant in enumerate(("none", "torch-ddp")):
        memory = MEMORY[variant]
        heights = [c.patches[index].get_height() for c in ax.containers]
        bottoms = [c.patches[index].get_y() for c in ax.containers]
        expected = [memory[f] for f in ("parameters", "gradients", "optimizer_state", "activations_other")]
        assert heights == pytest.approx(expected)
        assert bottoms == pytest.approx([0.0, expected[0], sum(expected[:2]), sum(expected[:3])])
        assert sum(heights) == pytest.approx(memory["peak_before_step"])


def test_no_plots_without_their_data(tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"machine_info": {"cs336_systems": CPU}, "benchmarks": [
        _bench("test_end_to_end", "tiny", {"size": "tiny", "context": 32, "batch_size": 2, "mode": "forward",
                                           "precision": "fp32", "compile": False, "attention": "sdpa"}, 0.01),
        _bench("test_data_parallel", "none", _dp("none"), 0.08)]}))  # no buckets, no memory
    entries, machines = tables.load_runs([path])
    assert plots.all_plots(entries, machines) == []
    out = tmp_path / "report.md"
    assert report.main([str(path), "-o", str(out), "--plots", str(tmp_path / "plots")]) == 0
    assert "## Plots" not in out.read_text()
    with pytest.raises(ValueError, match="duplicate"):
        spec = plots.all_plots(*tables.load_runs([_cpu_run(tmp_path)]))[0]
        plots.write_plots([spec, spec], tmp_path / "dup")


def test_readme_sections_write_their_plots_and_regenerate_identically(tmp_path):
    runs = tmp_path / "results" / "cpu"
    runs.mkdir(parents=True)
    run = _cpu_run(runs)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Results\n\n<!-- results:start -->\n<!-- results:end -->\n\n## Next\n")

    def dp_plots(entries, machines):
        return plots.ddp_bucket_plots(entries, machines) + plots.memory_plots(entries, machines)

    sections = (readme_results.ResultsSection("CPU data parallel", (f"results/cpu/{run.name}",), None, "results/cpu/plots",
                                      dp_plots),)
    assert readme_results.update_readme(readme, sections) is True
    text = readme.read_text()
    pngs = sorted((runs / "plots").iterdir())
    assert [p.name for p in pngs] == ["ddp-buckets-tiny-ctx32-b2-fp32-2ranks-gloo.png",
                                      "memory-tiny-ctx32-b2-fp32-2ranks-gloo.png"]
    for png in pngs:
        assert png.read_bytes().startswith(PNG_MAGIC)
        assert f"](results/cpu/plots/{png.name})" in text
    assert "Device: CPU, driver None; CUDA None, torch 2.13.0+cpu" in text and "2026-11-21 (10:00 UTC)" in text
    first = {p.name: p.read_bytes() for p in pngs}
    assert readme_results.update_readme(readme, sections) is False
    assert readme.read_text() == text
    assert {p.name: p.read_bytes() for p in (runs / "plots").iterdir()} == first  # same bytes: no timestamps


def test_flash_variants_measured_at_one_length_get_no_plot():
    """A TFLOP/s-vs-N plot of one N is a dot per implementation: model shapes and single GQA points stay in the
    report's tables; a grouped-query variant of several N gets a plot of its own, named with its K/V heads."""
    one_n = [_bench("test_flash", f"{impl}-gqa", _flash(impl, 512, 64, "forward", 1.0) | {"heads": 32, "kv_heads": 8}, 1e-3)
             for impl in ("flash-triton", "sdpa-flash")]
    several = [_bench("test_flash", f"{impl}-{n}", _flash(impl, n, 64, "forward", 1.0) | {"heads": 32, "kv_heads": 1},
                      1e-3) for impl in ("flash-triton", "sdpa-flash") for n in (1024, 4096)]
    entries = [{"test": "test_flash", **b["extra_info"], "median_ms": 1.0} for b in one_n + several]
    names = [p.filename for p in plots.flash_plots(entries)]
    assert names == ["flash-tflops-bf16-causal-b1-h32-kv1-forward.png"], names
