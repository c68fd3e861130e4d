"""Does float8 train the same model?  Loss curves of one LM trained with bf16 and float8 Linear layers.

    python -m cs336_systems.tools.float8_loss --steps 300 --device cuda --out loss.json [--plot loss.png]

Data every machine has without a download: the Python standard library's own source files (`*.py` under
``sysconfig.get_paths()["stdlib"]``, sorted, concatenated as bytes; a byte-level vocabulary of 256), batches
of random windows drawn by one generator (``--data-seed``), so every run sees the same batches in the same
order.  Each (linear precision, seed) run builds the model with that seed (`model.build`, SDPA attention,
bf16 autocast), converts its Linear layers (`float8.convert_linears`) and trains with `AdamWMaster`.

The verdict compares curves smoothed over ``--window`` steps, over the second half of training: the
tolerance is the spread between the bf16 runs of two seeds (what a different seed alone moves the loss),
and a float8 recipe agrees when its curve stays within that of the bf16 run of the same seed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

from cs336_systems import float8, model
from cs336_systems.optim.adamw_master import AdamWMaster, linear_weights

VOCAB = 256


def stdlib_bytes(limit: int | None = None) -> tuple[torch.Tensor, dict]:
    """The standard library's .py sources as one uint8 tensor (at most ``limit`` bytes), and where they came
    from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, size = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if limit is not None and size >= limit:
            break
    data = b"".join(chunks)[:limit]
    source = {"source": "the Python standard library's .py files", "root": str(root), "files": len(chunks),
              "bytes": len(data), "python": sys.version.split()[0]}
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), source


def train(data: torch.Tensor, *, precision: str, seed: int, steps: int, size: str, context: int, batch: int,
          lr: float, data_seed: int, device: torch.device) -> list[float]:
    """The loss at every step of one run (module docstring)."""
    torch.manual_seed(seed)
    lm = model.build(size, vocab_size=VOCAB, context_length=context, attention="sdpa", device=device)
    float8.convert_linears(lm, precision)
    opt = AdamWMaster(lm.parameters(), lr=lr, compute_params=linear_weights(lm))
    batches = torch.Generator().manual_seed(data_seed)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=batches)
        window = torch.stack([data[s: s + context + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(lm(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing means over ``window`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def verdict(runs: list[dict], window: int) -> dict:
    """The tolerance (bf16 seed spread) and each float8 recipe's largest gap to bf16 of its seed, over the
    second half of the smoothed curves."""
    curves = {(r["precision"], r["seed"]): smoothed(r["losses"], window) for r in runs}
    steps = len(runs[0]["losses"])
    half = slice(steps // 2, steps)

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(a[half], b[half]))

    seeds = sorted({seed for precision, seed in curves if precision == "bf16"})
    if len(seeds) < 2:
        raise ValueError("the tolerance needs bf16 runs of two seeds (--seeds 0,1)")
    tolerance = gap(curves[("bf16", seeds[0])], curves[("bf16", seeds[1])])
    gaps = {f"{precision} seed {seed}": gap(curve, curves[("bf16", seed)])
            for (precision, seed), curve in curves.items() if precision != "bf16"}
    return {"window": window, "over_steps": [half.start, steps], "tolerance_bf16_seed_spread": tolerance,
            "float8_gap_to_bf16": gaps, "agrees": {name: value <= tolerance for name, value in gaps.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.tools.float8_loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", default="tiny", help="model size (cs336_systems.model.SIZES)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precisions", default="bf16,fp8-tensorwise,fp8-rowwise")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--data-bytes", type=int, default=32 * 2**20, help="at most this much of the sources")
    parser.add_argument("--window", type=int, default=20, help="steps the curves are smoothed over")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--plot", help="also draw the curves into this PNG (the plot extra)")
    args = parser.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.steps < 2 * args.window:
        parser.error(f"--steps {args.steps} must be at least twice --window {args.window}")
    device = torch.device(args.device)
    reason = float8.first_unavailable(precisions, device)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    data, source = stdlib_bytes(args.data_bytes)
    runs = []
    for precision in precisions:
        for seed in seeds if precision == "bf16" else seeds[:1]:
            losses = train(data, precision=precision, seed=seed, steps=args.steps, size=args.size,
                           context=args.context, batch=args.batch, lr=args.lr, data_seed=args.data_seed,
                           device=device)
            runs.append({"precision": precision, "seed": seed, "losses": losses})
            print(f"{precision} seed {seed}: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    result = {"command": "python -m cs336_systems.tools.float8_loss " + shlex.join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (float8 emulated)",
              "data": source, "model": {"size": args.size, "context": args.context, "batch": args.batch,
                                        "lr": args.lr, "optimizer": "AdamWMaster", "autocast": "bf16"},
              "runs": runs, "verdict": verdict(runs, args.window)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            print(f"error: --plot needs matplotlib (pip install -e '.[plot]'); the JSON is in {args.out}",
                  file=sys.stderr)
            return 2
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.subplots()
        for run in runs:
            ax.plot(smoothed(run["losses"], args.window), label=f"{run['precision']} seed {run['seed']}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss (mean of {args.window} steps)")
        ax.legend()
        fig.savefig(args.plot, dpi=120)
    print(json.dumps(result["verdict"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
