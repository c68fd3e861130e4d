"""Where a float8 train step's time would go: each Linear of one block alone, in bf16 and in float8.

    python -m cs336_systems.tools.float8_gemms --sizes xl,2.7B --tokens 2048 --out gemms.json

Count before building: the step's GEMMs are the block Linears' (qkv_proj (3d x d), output_proj (d x d),
ffn.w13 (2 d_ff x d), ffn.w2 (d x d_ff)), each three times a step at M = batch x context tokens::

    forward    Y  = X W^T      (M x out, contracting in)
    backward   dX = dY W       (M x in, contracting out)
               dW = dY^T X     (out x in, contracting M)

For every Linear shape this times, on one device, each with the shared harness (on a GPU the step's kernels
alone: CUDA-graph replays bracketed by CUDA events, warm-up first; on a CPU the host clock):

* ``gemm``: the three GEMMs alone, operands ready: bf16 `torch.mm`, and float8 (e4m3 operands, e5m2 for the
  gradient as torchao's recipes use) `torch._scaled_mm` with one scale per tensor (tensorwise) or one per
  row of each operand (rowwise).  The ceiling of what float8 can save.
* ``layer``: the Linear's forward and backward as the model runs it (bf16 weight, bf16 autocast):
  `nn.Linear` against torchao's `Float8Linear` of each recipe (`float8.convert_linears`), compiled by
  default as the model's blocks are, so the amax reductions and casts run fused as they would in the step.
  ``layer - gemm`` is what the casts cost.

The prediction for a step: ``n_layers x sum over the block's Linears of (layer bf16 - layer float8)``
is the time float8 can take off the bf16 step; the rest of the step (attention, norms, optimizer, the LM
head, which stays bf16) does not change.  ``--step-ms size=ms`` turns that into a predicted step time.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from torch import nn

from cs336_systems import float8, model
from cs336_systems.bench import harness

RECIPES = ("fp8-tensorwise", "fp8-rowwise")


def block_linears(size: str) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one block's Linear layers (module docstring)."""
    cfg = model.config(size)
    d, d_ff = cfg.d_model, cfg.d_ff
    return [("qkv_proj", d, 3 * d), ("output_proj", d, d), ("ffn.w13", d, 2 * d_ff), ("ffn.w2", d_ff, d)]


def gemm_flops(tokens: int, in_features: int, out_features: int) -> int:
    """FLOPs of one Linear's forward and backward: three GEMMs of 2 M in out each."""
    return 3 * 2 * tokens * in_features * out_features


def _gemm_step(tokens: int, fin: int, fout: int, precision: str, device: torch.device):
    """The three GEMMs of one Linear (module docstring), operands already in their layouts and dtypes."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    x, w, gy = rand(tokens, fin), rand(fout, fin), rand(tokens, fout)
    if precision == "bf16":
        return lambda: (x @ w.t(), gy @ w, gy.t() @ x)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    # _scaled_mm takes A row-major and B column-major: each operand is stored in the layout its GEMM reads.
    x8, w8, gy8 = x.to(e4m3), w.to(e4m3), gy.to(e5m2)
    wt8 = w.t().contiguous().to(e4m3)  # (in, out): B of dX = dY W, read column-major as W
    gyt8 = gy.t().contiguous().to(e5m2)  # (out, M): A of dW = dY^T X
    xt8 = x.t().contiguous().to(e4m3)  # (in, M): B of dW, read column-major as X

    def scales(m: int, n: int):
        if precision == "fp8-tensorwise":
            one = torch.ones((), device=device, dtype=torch.float32)
            return one, one
        return (torch.ones(m, 1, device=device, dtype=torch.float32),
                torch.ones(1, n, device=device, dtype=torch.float32))

    fwd, dx, dw = scales(tokens, fout), scales(tokens, fin), scales(fout, fin)

    def mm(a, b, s):
        return torch._scaled_mm(a, b, scale_a=s[0], scale_b=s[1], out_dtype=torch.bfloat16)

    return lambda: (mm(x8, w8.t(), fwd), mm(gy8, wt8.t(), dx), mm(gyt8, xt8.t(), dw))


def _layer_step(tokens: int, fin: int, fout: int, precision: str, device: torch.device, compile: bool):
    """One Linear's forward and backward as the model runs it (bf16 weight, bf16 autocast)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(fin, fout, bias=False, device=device, dtype=torch.bfloat16))
    float8.convert_linears(layer, precision)
    run = torch.compile(layer) if compile else layer
    x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16)
    weight = layer[0].weight

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = run(x)
        # autograd.grad, not backward: nothing accumulates into .grad between rounds
        return torch.autograd.grad(y, (x, weight), gy)

    return step


def time_ms(setup, device: torch.device, warmup: int, rounds: int) -> float | None:
    """Median milliseconds of the step ``setup()`` returns (None on OOM).  On a GPU each round replays the
    step captured in a CUDA graph: a lone compiled Float8Linear's host work (a dozen small kernels to
    launch, autograd) outlasts its kernels, which in the train step run behind the host's lead."""
    timing = "graph" if device.type == "cuda" else "host"
    result = harness.measure(setup, warmup=warmup, rounds=rounds, device=device, timing=timing)
    return result.stats.median * 1e3 if result.ok else None


def count(size: str, *, tokens: int, device: torch.device, precisions: list[str], compile: bool = True,
          warmup: int = 10, rounds: int = 50) -> dict:
    """Per Linear of ``size``'s block: the GEMMs alone and the layer, per precision, in ms (module docstring);
    and per float8 recipe the time the step's Linears would save."""
    cfg = model.config(size)
    rows = []
    for name, fin, fout in block_linears(size):
        row = {"linear": name, "in": fin, "out": fout, "tokens": tokens,
               "gflop": gemm_flops(tokens, fin, fout) / 1e9, "gemm_ms": {}, "layer_ms": {}}
        for precision in precisions:
            row["gemm_ms"][precision] = time_ms(
                lambda p=precision: _gemm_step(tokens, fin, fout, p, device), device, warmup, rounds)
            row["layer_ms"][precision] = time_ms(
                lambda p=precision: _layer_step(tokens, fin, fout, p, device, compile), device, warmup, rounds)
            if compile:
                torch._dynamo.reset()  # a fresh compile per layer, as each block compiles its own
        rows.append(row)
    saving = {}
    for recipe in (p for p in precisions if p != "bf16"):
        if "bf16" not in precisions:
            break
        gemm = layer = 0.0
        for row in rows:
            if None in (row["gemm_ms"]["bf16"], row["gemm_ms"][recipe], row["layer_ms"]["bf16"],
                        row["layer_ms"][recipe]):
                gemm = layer = None
                break
            gemm += row["gemm_ms"]["bf16"] - row["gemm_ms"][recipe]
            layer += row["layer_ms"]["bf16"] - row["layer_ms"][recipe]
        saving[recipe] = {"gemm_ms_per_step": None if gemm is None else gemm * cfg.n_layers,
                          "layer_ms_per_step": None if layer is None else layer * cfg.n_layers}
    return {"size": size, "n_layers": cfg.n_layers, "linears": rows, "saving": saving}


def _parse_steps(text: str | None) -> dict[str, float]:
    steps = {}
    for item in filter(None, (text or "").split(",")):
        size, _, ms = item.partition("=")
        try:
            steps[size.strip()] = float(ms)
        except ValueError:  # no "=" leaves ms empty
            raise ValueError(f"--step-ms: expected size=milliseconds, got {item!r}") from None
    return steps


def table(results: list[dict]) -> str:
    """A Markdown table of the counts: ms per Linear, GEMMs alone / the layer, per precision."""
    precisions = list(results[0]["linears"][0]["gemm_ms"])
    head = ["size", "linear", "in x out", "GFLOP"] + [f"{p} gemm / layer" for p in precisions]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ms(value):
        return "OOM" if value is None else f"{value:.3f}"

    for result in results:
        for row in result["linears"]:
            cells = [result["size"], row["linear"], f"{row['in']} x {row['out']}", f"{row['gflop']:.1f}"]
            cells += [f"{ms(row['gemm_ms'][p])} / {ms(row['layer_ms'][p])}" for p in precisions]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.tools.float8_gemms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="xl,2.7B", help="model sizes (cs336_systems.model.SIZES), comma-separated")
    parser.add_argument("--tokens", type=int, default=2048, help="M: batch x context (default 4 x 512)")
    parser.add_argument("--precisions", default="bf16," + ",".join(RECIPES))
    parser.add_argument("--eager", action="store_true", help="time the layers uncompiled")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--step-ms", help="the measured bf16 step per size (size=ms,...): predicts the float8 step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    precisions = [float8.check_precision(p.strip()) for p in args.precisions.split(",") if p.strip()]
    for size in sizes:
        model.config(size)  # an unknown size fails here, before any timing
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    try:
        steps = _parse_steps(args.step_ms)
    except ValueError as exc:
        parser.error(str(exc))
    device = torch.device(args.device)
    reason = float8.first_unavailable(precisions, device)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    results = [count(size, tokens=args.tokens, device=device, precisions=precisions, compile=not args.eager,
                     warmup=args.warmup, rounds=args.rounds) for size in sizes]
    for result in results:
        if result["size"] in steps:
            step = steps[result["size"]]
            result["bf16_step_ms"] = step
            result["predicted_step_ms"] = {
                recipe: None if s["layer_ms_per_step"] is None else step - s["layer_ms_per_step"]
                for recipe, s in result["saving"].items()}
    out = {"command": "python -m cs336_systems.tools.float8_gemms " + shlex.join(argv or sys.argv[1:]),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (float8 layers emulated)",
           "torch": torch.__version__, "timing": "graph" if device.type == "cuda" else "host",
           "compiled_layers": not args.eager, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(results))
    for result in results:
        print(result["size"], json.dumps(result["saving"]), json.dumps(result.get("predicted_step_ms")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
