"""`python -m cs336_systems.flash_autotune` (console script `cs336-flash-autotune`): tune flash-triton's tile
configurations for your shapes, or say which kernels run for a shape.

    cs336-flash-autotune --shape 64,4096,64 [--dtype bf16] [--no-causal]     tune (a CUDA GPU)
    cs336-flash-autotune --explain 1,16,16384,64 [--kv-heads 4] [--nk N] [--no-causal] [--dtype bf16]
                         [--device H100|H200|A100]                            the plan, with each rule's reason
    cs336-flash-autotune --write-docs [docs/flash-attention.md]              regenerate the docs' plan and
                                                                              switches tables

``--explain`` describes this machine's GPU (or a preset ``--device``), under the options the environment's
``CS336_FLASH_*`` switches set.  The tuner is `cs336_systems.attention.kernels.flash_autotune`; the plan
`cs336_systems.attention.plan`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cs336_systems.attention import plan as planning
from cs336_systems.attention.kernels.portable.autotune import DTYPES
from cs336_systems.attention.kernels.portable.autotune import main as tune_main

DOC = Path(__file__).resolve().parent.parent / "docs" / "flash-attention.md"


def _problem_shape(text: str) -> tuple[int, int, int, int]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 4 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected B,H,N,d (four positive integers), got {text!r}")
    return sizes


def explain_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cs336-flash-autotune --explain",
                                     description="Which flash-triton kernels run for a shape, and why.")
    parser.add_argument("--explain", type=_problem_shape, required=True, metavar="B,H,N,d")
    parser.add_argument("--kv-heads", type=int, help="K/V heads (a divisor of H); default H")
    parser.add_argument("--nk", type=int, help="keys per row; default N")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=sorted(planning.PRESETS),
                        help="a preset GPU instead of this machine's (default: this machine's CUDA device)")
    args = parser.parse_args(argv)
    b, h, n, d = args.explain
    kv = args.kv_heads or h
    if kv < 1 or h % kv:
        parser.error(f"--kv-heads must divide H={h}; got {kv}")
    if args.device:
        device = planning.Device.preset(args.device)
    elif torch.cuda.is_available():
        device = planning.Device.of(torch.device("cuda"))
    else:
        parser.error("no CUDA device here: name one with --device (H100, H200, A100)")
    problem = planning.Problem(b, h, kv, n, args.nk or n, d, DTYPES[args.dtype], args.causal)
    print(planning.explain(problem, device, planning.FlashOptions().with_env()))
    return 0


def write_docs_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cs336-flash-autotune --write-docs")
    parser.add_argument("--write-docs", nargs="?", const=str(DOC), type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    path = Path(args.write_docs)
    try:
        path.write_text(planning.fill_doc_tables(path.read_text()))
    except (OSError, ValueError) as exc:
        parser.error(f"--write-docs {path}: {exc}")
    print(f"wrote the plan and switches tables into {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--explain" or a.startswith("--explain=") for a in argv):
        return explain_main(argv)
    if any(a == "--write-docs" or a.startswith("--write-docs=") for a in argv):
        return write_docs_main(argv)
    return tune_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
