"""The Triton kernels compile for Hopper (sm_90) with no GPU present, with no float64 arithmetic.

Under torch.compile, inductor passed Python float arguments (the softmax scales) as fp64 scalars: first
the loop-carried accumulators silently became fp64 (a compile error on the H100), then, with a cast
after the multiply, every score tile was multiplied in fp64 (compiled forward+backward 1.6x slower
than eager, and results differing from eager by an ulp).  The scales are now constexprs; this test
compiles the kernels ahead of time and asserts the IR contains no f64 at all, so neither regression
can come back unnoticed.  The compile runs in a child process with TRITON_INTERPRET=0 (the test process
itself runs the kernels in the Triton interpreter).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cs336_systems.attention.kernels.portable import kernels
from cs336_systems.attention.kernels.portable.configs import d_tiles

causal = sys.argv[1] == "causal"
tma = sys.argv[2] != "pointers"
mode = {"pointers": 0, "tma": 1, "tma-band": 2}[sys.argv[2]]
head_dim = int(sys.argv[3])
block_d = max(16, 1 << (head_dim - 1).bit_length())
# the launchers' register tiles: descriptors take the one padded tile, pointer loads the split ones
tiles = (block_d, 0) if tma else d_tiles(head_dim, torch.bfloat16, "dq")  # opted in: every kernel the same
consts = {"CAUSAL": causal, "HEAD_DIM": head_dim, "BLOCK_D": tiles[0], "BLOCK_D2": tiles[1], "BLOCK_M": 64, "BLOCK_N": 64,
          "PRECISION": "tf32", "LONGEST_FIRST": True, "sm_scale": 0.125, "qk_scale": 0.125 * 1.4426950408889634,
          "SPLITS": 4, "TMA": mode, "PART": int(sys.argv[4]) if len(sys.argv) > 4 else 0}
only = sys.argv[5] if len(sys.argv) > 5 else None  # one kernel's name: compile only that one
descs = ["K_DESC", "V_DESC"]
if not tma:
    consts.update({name: None for name in descs})
def zhn(*tensors):
    return [f"stride_{t}{axis}" for t in tensors for axis in "zhn"]

strides = zhn("q", "k", "v")
bf16 = "*bf16"

compiled_names = []

def compile_(fn, pointers, ints, scales):
    if only is not None and fn.__name__ != only:
        return
    compiled_names.append(fn.__name__)
    names = set(fn.arg_names)
    const = {n: c for n, c in consts.items() if n in names}
    sig = {**pointers, **{n: "i32" for n in ints}, **{n: "constexpr" for n in const}}
    if tma:
        sig.update({n: f"tensordesc<bf16[64, {block_d}]>" for n in descs if n in names})
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
    for stage in ("ttir", "ttgir"):
        if "f64" in compiled.asm[stage]:
            sys.exit(f"{fn.__name__}: float64 arithmetic in the {stage}")

compile_(kernels.flash_fwd_kernel, {"Q": bf16, "K": bf16, "V": bf16, "O": bf16, "L": "*fp32"},
         strides + zhn("o") + ["n_queries", "n_keys", "heads", "group"], ["qk_scale"])
compile_(kernels.flash_bwd_dkdv_kernel,
         {"Q": bf16, "K": bf16, "V": bf16, "DO": bf16, "L": "*fp32", "Dvec": "*fp32", "DK": bf16, "DV": bf16},
         strides + zhn("do", "dk", "dv") + ["n_queries", "n_keys", "heads", "group", "heads_per_split", "stride_dks",
                                            "stride_dvs"], ["sm_scale", "qk_scale"])
compile_(kernels.flash_bwd_dq_kernel,
         {"Q": bf16, "K": bf16, "V": bf16, "DO": bf16, "L": "*fp32", "Dvec": "*fp32", "DQ": bf16, "O": bf16},
         strides + zhn("do", "dq", "o") + ["n_queries", "n_keys", "heads", "group"],
         ["sm_scale", "qk_scale"])
consts["BLOCK_D"] = block_d  # the key-split forward and the combine kernel run the padded tile
compile_(kernels.flash_fwd_split_kernel, {"Q": bf16, "K": bf16, "V": bf16, "O_PART": "*fp32", "L_PART": "*fp32"},
         strides + ["n_queries", "n_keys", "heads", "group"], ["qk_scale"])
compile_(kernels.flash_fwd_combine_kernel, {"O_PART": "*fp32", "L_PART": "*fp32", "O": bf16, "L": "*fp32"},
         zhn("o") + ["n_queries", "heads"], [])
if not compiled_names:  # a misspelled name would otherwise pass having compiled nothing
    sys.exit(f"no kernel named {only}")
print("compiled")
"""


# The widest tiles take 15-20 s each to compile (ptxas on 192- and 256-wide register tiles), d 80 with
# descriptors (its tiles padded to 128) 10 s: marked slow, so that the default run leaves them to CI
# (`pytest tests/ --run-slow`).  The default run keeps each code path: descriptors (with and without the band,
# causal) and pointers (causal and full) at d 64, the split tiles (d 80: 64 + 16) and the two-pass dK/dV
# variants; the unmasked descriptor variants are CI's too.
SLOW_COMPILE = pytest.mark.slow


# loads: pointers, descriptors for the unmasked tiles, for every tile; head dim 80 with descriptors runs
# padded (a 128-wide tile, TMA boxes wider than the rows), with pointers split (64 + 16; 192 = 64 + 128),
# and 256 in 256-wide register tiles.
@pytest.mark.parametrize("causal, loads, head_dim", [
    (causal, loads, 64) if (causal, loads) in (("causal", "pointers"), ("causal", "tma-band"))
    else pytest.param(causal, loads, 64, marks=SLOW_COMPILE)  # the others (~2.7 s each): CI's
    for causal in ("causal", "full") for loads in ("pointers", "tma", "tma-band")
] + [pytest.param("causal", "tma-band", 80, marks=SLOW_COMPILE), ("causal", "pointers", 80),
     pytest.param("full", "pointers", 192, marks=SLOW_COMPILE), pytest.param("full", "tma", 256, marks=SLOW_COMPILE)])
def test_kernels_compile_for_sm90_without_float64(causal, loads, head_dim):
    _compile(causal, loads, head_dim, part=0)


# The dK/dV kernel's two-pass form (TileConfig.parts = 2): a dV-only and a dK-only variant.  At d = 64 only that
# kernel is compiled (the others are the causal pointer-load case above); at d = 192 (split: 64 + 128) and 256
# every kernel, which also compiles the causal pointer-load forward and dQ at those widths.
@pytest.mark.parametrize("part", [1, pytest.param(2, marks=SLOW_COMPILE)])
@pytest.mark.parametrize("head_dim", [64, pytest.param(192, marks=SLOW_COMPILE),
                                      pytest.param(256, marks=SLOW_COMPILE)])
def test_two_pass_dkdv_variants_compile_for_sm90(part, head_dim):
    _compile("causal", "pointers", head_dim, part=part, only="flash_bwd_dkdv_kernel" if head_dim == 64 else None)


def _compile(causal, loads, head_dim, part, only=None):
    env = {**os.environ, "TRITON_INTERPRET": "0", "CS336_FLASH_SPLIT_D": "1"}  # pointer loads: the split tiles
    args = [causal, loads, str(head_dim), str(part)] + ([only] if only else [])
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
