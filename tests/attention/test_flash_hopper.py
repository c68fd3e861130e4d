"""The Gluon Hopper kernels (flash_fwd_hopper[_ws], flash_dq_hopper, flash_dkdv_hopper, flash_bwd_hopper): their
tiles, that flash_triton launches what the plan chose, and on an sm_90 GPU O, L, dQ, dK and dV against float64
with the Hopper kernels in the path.  Where each kernel is chosen: tests/attention/test_plan.py.

The kernels compile only for sm_90 (no interpreter), so on CPU these tests check the tiles and the dispatch;
the GPU tests run on Hopper and skip elsewhere with the reason."""

import pytest
import torch
from attention_reference import assert_flash_accuracy, random_qkv, token_major_view
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cs336_systems.attention import flash_calls
from cs336_systems.attention import flash_triton
from cs336_systems.attention import flash_replays
from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.attention.kernels.portable import launch as flash_launch
from cs336_systems.attention.plan import GLUON_TRITON_VERSIONS, Plan

# The Gluon API is experimental: a Triton release without these names skips this file (flash_triton then
# runs the portable kernels only).
hopper = pytest.importorskip("cs336_systems.attention.kernels.hopper.forward")
dkdv_hopper = pytest.importorskip("cs336_systems.attention.kernels.hopper.dkdv")
dq_hopper = pytest.importorskip("cs336_systems.attention.kernels.hopper.dq")
common = pytest.importorskip("cs336_systems.attention.kernels.hopper.common")
ws_hopper = pytest.importorskip("cs336_systems.attention.kernels.hopper.forward_ws")
fused_hopper = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward")

CUDA = torch.device("cuda")


def test_every_gluon_module_has_the_same_interface_and_the_plan_knows_its_head_dims():
    """Each kernel module of kernels/hopper exposes HEAD_DIMS and launch; the plan, which must not import
    Triton, keeps its own copy of the head dims (`KERNEL_HEAD_DIMS`): they must agree."""
    from cs336_systems.attention import plan as planning

    modules = ((hopper, "fwd"), (ws_hopper, "fwd-ws"), (dq_hopper, "dq"), (dkdv_hopper, "dkdv"),
               (fused_hopper, "fused"))
    assert {kernel for _, kernel in modules} == set(planning.KERNEL_HEAD_DIMS) == set(planning.KERNELS)
    for module, kernel in modules:
        assert callable(module.launch) and module.HEAD_DIMS == planning.KERNEL_HEAD_DIMS[kernel], module.__name__


@pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="CPU check of the small kernels in the interpreter")
@pytest.mark.parametrize("d", [64, 80])
def test_fused_backward_prep_and_post_kernels_match_torch(d):
    """The fused backward's two small kernels (the Gluon kernel itself runs only on sm_90): delta =
    rowsum(O * dO) with a zeroed float32 dQ accumulator, then dQ = accumulator · scale in dQ's dtype and
    strides; token-major views of O and dQ, a ragged last row block; at d 80 a 128-column register tile
    whose columns past d touch nothing (the accumulator's neighbours stay as they were)."""
    z, h, n = 2, 3, 70
    tile = 1 << (d - 1).bit_length()
    o = torch.randn(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    do = torch.randn(z, h, n, d, dtype=torch.float16)
    delta, dqa = torch.empty(z, h, n), torch.full((z, h, n, d + 1), 7.0)  # a column past d: must stay 7
    acc = (n * d, d, 1)  # the accumulator the kernels address: (Z, H, N, d) contiguous
    common.dq_prep_kernel[(2, z * h)](o, do, delta, dqa, n, h, *o.stride()[:3], *do.stride()[:3], *acc, D=d,
                                      D_TILE=tile, BLOCK=64)
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    flat = dqa.flatten()[: z * h * n * d]  # the accumulator the kernel addresses: (Z, H, N, d) contiguous
    assert not flat.any() and torch.equal(dqa.flatten()[z * h * n * d:], torch.full((z * h * n,), 7.0))
    dqa = torch.randn(z, h, n, d)
    dq = torch.empty(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    common.dq_post_kernel[(2, z * h)](dqa, dq, n, h, *dq.stride()[:3], *acc, 0.125, D=d, D_TILE=tile, BLOCK=64)
    assert torch.equal(dq, (dqa * 0.125).half())


def test_wide_backward_refuses_other_head_dims():
    """hopper/backward_wide is d 256's: any other head dim is refused, naming it, before anything launches."""
    wide = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward_wide")
    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head dims \(256,\); got d=128"):
        wide.launch(q, q, q, q, q, None, None, None, q, q, q, True)
    with pytest.raises(ValueError, match=r"got d=128"):
        wide.launch_dkdv(q, q, q, q, None, None, q, q, True)


@pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="CPU check of the small kernels in the interpreter")
@pytest.mark.parametrize("n", [70, 64])
def test_wide_backward_prep_and_post_kernels_use_the_transposed_accumulator(n):
    """d 256's fused pass (hopper/backward_wide) keeps dQ transposed, (Z * H, 256, row) float32 with row the
    16-byte-aligned Nq (70 -> 72, a padded accumulator; 64 unpadded): delta = rowsum(O * dO) and the accumulator
    zeroed (its padding left alone), then dQ = accumulator^T · scale in dQ's dtype and strides (token-major)."""
    wide = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward_wide")
    z, h, d = 2, 3, 256
    row = -(-n // 4) * 4
    assert wide.accumulator_ok(n) == (row == n)
    o = torch.randn(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    do = torch.randn(z, h, n, d, dtype=torch.float16)
    delta, dqa = torch.empty(z, h, n), torch.full((z * h, d, row), 7.0)
    acc = (d * row, 1, row)  # the kernels' strides for (Z * H, 256, row), as backward_wide.launch passes them
    common.dq_prep_kernel[(2, z * h)](o, do, delta, dqa, n, h, *o.stride()[:3], *do.stride()[:3], *acc, D=d, D_TILE=d,
                                      BLOCK=64)
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    assert not dqa[..., :n].any() and (dqa[..., n:] == 7.0).all()
    dqa = torch.randn(z * h, d, row)
    dq = torch.empty(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    common.dq_post_kernel[(2, z * h)](dqa, dq, n, h, *dq.stride()[:3], *acc, 0.125, D=d, D_TILE=d, BLOCK=64)
    assert torch.equal(dq, (dqa[..., :n].transpose(1, 2).reshape(z, h, n, d) * 0.125).half())


@pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="CPU check of the small kernels in the interpreter")
@pytest.mark.parametrize("d, splits", [(64, 2), (80, 3)])
def test_fused_backward_sums_the_partials_of_a_split_group(d, splits):
    """Grouped heads split among programs: dK and dV are the sums of the float32 partials over the splits,
    cast into their own strides (token-major here), rows past Nk and columns past d (d 80 in a 128-wide
    tile) left out."""
    z, kv_heads, n = 2, 3, 70
    width, rows = 1 << (d - 1).bit_length(), 128  # rows: the key blocks' 128 rows each
    parts = [torch.randn(splits, z * kv_heads, rows, width) for _ in range(2)]
    dk = torch.zeros(z, n, kv_heads, d, dtype=torch.float16).transpose(1, 2)
    dv = torch.zeros(z, kv_heads, n, d, dtype=torch.float16)
    fused_hopper._sum_kernel[(2, z * kv_heads)](*parts, dk, dv, n, rows, parts[0][0].numel(), splits, kv_heads,
                                               *dk.stride()[:3], *dv.stride()[:3], D=d, WIDTH=width, BLOCK=64)
    for out, part in zip((dk, dv), parts):
        expected = part.sum(0)[:, :n, :d].reshape(z, kv_heads, n, d)
        assert torch.equal(out, expected.half())


def test_group_splits_fill_the_grid_and_bound_the_longest_program(monkeypatch):
    """The fewest parts (a divisor of the group) that give the grid SPLIT_PER_SM programs per SM and leave a
    causal program at most SPLIT_STEPS query steps; CS336_FLASH_GROUP_SPLITS forces a divisor, as it does the
    portable dK/dV's."""
    monkeypatch.delenv("CS336_FLASH_GROUP_SPLITS", raising=False)
    sms, target, most = 132, fused_hopper.SPLIT_PER_SM * 132, fused_hopper.SPLIT_STEPS
    assert fused_hopper.group_splits(1, 8, sms) == 1  # no group to split
    assert fused_hopper.group_splits(4, target, sms) == 1  # enough programs already, not causal
    for group, programs, steps in ((32, 64, 0), (4, 100, 0), (6, 64, 0), (32, 1, 0), (7, 10, 0), (4, 512, 128),
                                   (4, 512, 32), (8, 1024, 20), (32, 64, 128)):
        splits = fused_hopper.group_splits(group, programs, sms, steps)
        assert group % splits == 0

        def enough(s):
            return programs * s >= target and steps * (group // s) <= most

        assert enough(splits) or splits == group
        assert not any(enough(s) for s in range(1, splits) if group % s == 0), (group, programs, steps, splits)
    assert fused_hopper.group_splits(32, 64, sms) == 8 and fused_hopper.group_splits(32, 1, sms) == 32
    assert fused_hopper.group_splits(4, 512, sms, steps=128) == 4  # H 32 / 8, N 8192, d 128
    assert fused_hopper.group_splits(4, 512, sms, steps=32) == 2  # B 4, H 32 / 8, N 2048, d 128
    monkeypatch.setenv("CS336_FLASH_GROUP_SPLITS", "2")
    assert fused_hopper.group_splits(32, 64, sms) == 2 and fused_hopper.group_splits(4, 512, sms, steps=128) == 2
    with pytest.raises(ValueError, match="CS336_FLASH_GROUP_SPLITS must be a positive divisor of the group size 3"):
        fused_hopper.group_splits(3, 64, sms)


def _planned(forward="portable", backward="two-kernel", dq="portable", dkdv="portable"):
    return Plan(forward, backward, "-" if backward == "fused" else dq, "-" if backward == "fused" else dkdv, "eager")


def test_forward_launches_the_kernel_the_plan_chose(monkeypatch):
    """flash_calls.forward hands eager problems to the Gluon kernel the plan names (nothing else launched),
    the others, and every launch through inductor's wrapper, to the portable one."""
    calls = []
    monkeypatch.setattr(hopper, "launch", lambda *args: calls.append("hopper"))
    monkeypatch.setattr(ws_hopper, "launch", lambda *args: calls.append("hopper-ws"))
    monkeypatch.setattr(flash_calls.launch, "forward", lambda *args, **kwargs: calls.append("portable"))
    monkeypatch.setattr(flash_calls, "select_configs", lambda *args, **kwargs: {"fwd": None})
    chosen = {"plan": _planned("hopper-ws")}
    monkeypatch.setattr(flash_calls, "plan_call", lambda *args, **kwargs: chosen["plan"])
    q = torch.empty(1, 2, 16, 128, dtype=torch.float16)
    o, lse = flash_calls.forward(q, q, q, True)
    assert calls == ["hopper-ws"] and o.shape == q.shape and lse.shape == (1, 2, 16) and lse.dtype == torch.float32
    flash_calls.forward(q, q, q, True, wrap=torch.library.wrap_triton, tma=0)  # inductor's launch: portable
    chosen["plan"] = _planned("hopper")
    flash_calls.forward(q, q, q, True)
    chosen["plan"] = _planned()
    flash_calls.forward(q, q, q, True)
    assert calls == ["hopper-ws", "portable", "hopper", "portable"]


def test_backward_launches_the_kernels_the_plan_chose(monkeypatch):
    """dQ (which also computes delta) runs first, then dK/dV, each on the kernel the plan names, never a Gluon
    one through inductor's wrapper; the fused pass replaces both, with a float32 dQ accumulator like q."""
    calls, accumulators, asked = [], [], []
    monkeypatch.setattr(flash_calls.launch, "dq", lambda *args, **kwargs: calls.append("portable dq"))
    monkeypatch.setattr(flash_calls.launch, "dkdv", lambda *args, **kwargs: calls.append("portable dkdv"))
    monkeypatch.setattr(dq_hopper, "launch", lambda *args: calls.append("hopper dq"))
    monkeypatch.setattr(dkdv_hopper, "launch", lambda *args: calls.append("hopper dkdv"))
    monkeypatch.setattr(fused_hopper, "launch", lambda *args: calls.append("fused") or accumulators.append(args[7]))
    monkeypatch.setattr(flash_calls, "select_configs", lambda *args, **kwargs: {"dq": None, "dkdv": None})
    chosen = {"plan": _planned(dq="hopper", dkdv="hopper")}

    def fake_plan(q, k, is_causal, tensors, options, traced=False):
        asked.append((is_causal, len(tensors), options))
        return chosen["plan"]

    monkeypatch.setattr(flash_calls, "plan_call", fake_plan)
    q = torch.empty(1, 2, 16, 64, dtype=torch.float16)
    lse = torch.empty(1, 2, 16)
    flash_calls.backward(q, q, q, q, lse, q, True)
    assert calls == ["hopper dq", "hopper dkdv"]
    flash_calls.backward(q, q, q, q, lse, q, True, wrap=torch.library.wrap_triton, tma=0)
    assert calls[2:] == ["portable dq", "portable dkdv"] and len(asked) == 1  # no plan asked for inductor
    chosen["plan"] = _planned(dkdv="hopper")
    flash_calls.backward(q, q, q, q, lse, q, False, options="fused_bwd=off")
    assert calls[4:] == ["portable dq", "hopper dkdv"]
    assert asked[-1] == (False, 5, "fused_bwd=off")  # the mask, all five tensors' layout, the options
    chosen["plan"] = _planned(backward="fused")
    flash_calls.backward(q, q, q, q, lse, q, True)
    assert calls[6:] == ["fused"]
    assert accumulators[0].dtype == torch.float32 and accumulators[0].shape == q.shape


def test_dkdv_launch_by_head_dim(monkeypatch):
    """d <= 128 (80 and 96 in 128-wide tiles): one launch of the one-warpgroup kernel in its width's tiles, a
    program per 64 keys of each (z, h_kv).  d 256: hopper/backward_wide's dK/dV pass instead."""
    launches, wide = [], []

    class Grid:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, meta["BLOCK_N"], meta["BLOCK_M"], meta["NUM_STAGES"]))

    wide_module = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward_wide")
    monkeypatch.setattr(wide_module, "launch_dkdv", lambda *args: wide.append(args[0].shape))

    def run(d, n=1000):
        launches.clear()
        q = torch.empty(2, 3, n, d, dtype=torch.bfloat16)
        dkdv_hopper.launch(q, q, q, q, None, None, q, q, True, wrap=lambda kernel: Grid())
        return list(launches)

    assert run(64) == [((16, 6), *dkdv_hopper.tiles(64))]
    assert run(96) == run(128) == [((16, 6), *dkdv_hopper.tiles(128))]
    assert run(256) == [] and wide == [(2, 3, 1000, 256)]


def test_dq_tiles_by_head_dim_length_and_grid(monkeypatch):
    """dQ at d 256 takes 64-key steps with two stages from LONG_QUERIES queries or with fewer 64-row programs
    than SMs, 32-key steps with three otherwise; at d 128 64 x 64 tiles with two stages from
    TWO_STAGE_PROGRAMS programs (by the mask) and three below; d 64 and the 128-wide tiles of d 80 / 96 always
    three."""
    chosen = []
    monkeypatch.setattr(dq_hopper.common, "descriptor", lambda t, rows: None)
    monkeypatch.setattr(dq_hopper, "tiles", lambda width, long_rows=False, two=False, real=dq_hopper.tiles:
                        chosen.append(real(width, long_rows, two)) or real(width, long_rows, two))
    monkeypatch.setattr(common, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)

    class NoLaunch:  # kernel[grid](...) does nothing: only the tile choice is under test
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(dq_hopper, "flash_dq_hopper_kernel", NoLaunch())

    def plan(bh, n, d, causal=True):
        chosen.clear()
        q = torch.empty(1, bh, n, d, dtype=torch.bfloat16)
        dq_hopper.launch(q, q, q, q, q, None, None, q, causal)
        return chosen[0]

    long, short = dq_hopper.TILES_LONG_256, (64, 32, 3)
    assert long == (64, 64, 2)
    assert plan(8, dq_hopper.LONG_QUERIES, 256) == long  # 1024 programs: the length alone decides
    assert plan(8, dq_hopper.LONG_QUERIES - 64, 256) == short
    assert plan(4, 4096, 256) == short  # 256 programs: two waves
    assert plan(8, 2048, 256) == short
    assert plan(1, 4096, 256) == long  # 64 programs: fewer than the SMs
    assert plan(2, 4160, 256) == long and plan(2, 4224, 256) == short  # 130 and 132 programs, 132 SMs
    assert plan(1, 8192, 128) == plan(1, 128, 64) == plan(64, 8192, 64) == plan(64, 8192, 96) == (64, 64, 3)
    assert dq_hopper.TWO_STAGE_PROGRAMS == {True: 1024, False: 512}
    assert plan(16, 4096, 128) == plan(16, 8192, 128) == (64, 64, 2)  # 1024 and 2048 programs
    assert plan(15, 4096, 128) == plan(8, 4096, 128) == (64, 64, 3)  # 960 and 512 programs, causal
    assert plan(8, 4096, 128, causal=False) == (64, 64, 2) and plan(7, 4096, 128, causal=False) == (64, 64, 3)


def test_tiles_fit_shared_memory_at_every_head_dim():
    """Each kernel's bf16 tiles, at the tile width of each head dim, within the 227 KB an sm_90 program may
    use: Q + NUM_STAGES x (K + V) (forward), K + V + stages x (Q + dO) (dK/dV), Q + dO + stages x (K + V) (dQ)."""
    for d in hopper.HEAD_DIMS:
        w = common.tile_dim(d)
        block_m, block_n, stages = hopper.tiles(d)
        assert 2 * w * (block_m + 2 * stages * block_n) <= 227 * 1024, d
    # d 80 and 96: two programs per SM (64 x 64 tiles) within the SM's 228 KB less 1 KB reserved per program
    for d in (80, 96):
        block_m, block_n, stages = hopper.tiles(d)
        assert (block_m, block_n, stages) == hopper.PADDED_TILES == (64, 64, 3)
        assert 2 * (2 * 128 * (block_m + 2 * stages * block_n) + 1024) <= 228 * 1024, d
    assert hopper.tiles(128) == (128, 128, 3) and hopper.tiles(64) == (128, 128, 3)
    # the warp-specialized forward (d 64-256, 80 / 96 in 128-wide tiles): Q's two 64-row halves and its K and
    # V rings in one program
    for d in ws_hopper.HEAD_DIMS:
        block_n, k_stages, v_stages = ws_hopper.tiles(common.tile_dim(d))
        assert 2 * common.tile_dim(d) * (2 * ws_hopper.ROWS + (k_stages + (v_stages or k_stages)) * block_n) <= 227 * 1024, d
    # its registers: 65536 a program, spread over 12 warps at launch, then rebalanced per warpgroup
    assert 12 * 32 * ws_hopper.MAXNREG <= 65536 and ws_hopper.MAXNREG % 8 == 0
    assert sum(ws_hopper.REGS) + ws_hopper.REGS[0] <= 3 * ws_hopper.MAXNREG
    for d in (64, 80, 96, 128):
        w = common.tile_dim(d)
        block_n, block_m, stages = dkdv_hopper.tiles(w)
        assert 2 * w * (2 * block_n + 2 * stages * block_m) <= 227 * 1024, d
    # d 256's wide backward: K, V, the Q / dO ring, the P^T / dS^T tiles, (fused) dQ's two float32 staging tiles
    wide = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward_wide")
    for fused in (True, False):
        tiles = 2 * 256 * 2 * (wide.BLOCK_N + wide.NUM_STAGES * wide.BLOCK_M)
        tiles += wide.PDS_STAGES[fused] * 2 * 2 * wide.BLOCK_N * wide.BLOCK_M + fused * 2 * 4 * 64 * 32
        assert tiles + 2 * wide.NUM_STAGES * wide.BLOCK_M * 4 <= 227 * 1024, fused
    assert 12 * 32 * wide.MAXNREG <= 65536 and 2 * wide.REGS[0] + wide.REGS[1] <= 3 * wide.MAXNREG
    for d in dq_hopper.HEAD_DIMS:
        w = common.tile_dim(d)
        for block_m, block_n, stages in {dq_hopper.tiles(w), dq_hopper.tiles(w, long_rows=True),
                                         dq_hopper.tiles(w, two_stages=True)}:
            assert 2 * w * (2 * block_m + 2 * stages * block_n) <= 227 * 1024, d


def test_head_dims_below_a_power_of_two_take_wider_tma_boxes():
    """d 80 and 96 run in 128-wide tiles: the descriptors' boxes are 128 columns over the d-column tensor
    (TMA zero-fills the rest on loads and drops it on stores); powers of two keep their own width."""
    assert [common.tile_dim(d) for d in (64, 80, 96, 128, 256)] == [64, 128, 128, 128, 256]
    t = torch.empty(2, 3, 256, 80, dtype=torch.bfloat16)
    desc = common.descriptor(t, 64)
    assert list(desc.shape) == [2, 3, 256, 80] and list(desc.block_shape) == [1, 1, 64, 128]
    assert common.descriptor(torch.empty(1, 1, 64, 128, dtype=torch.bfloat16), 64).layout is desc.layout


def test_products_over_d_skip_the_padding_at_d80_and_d96_only(monkeypatch):
    """D_SPLIT (the columns past 64 the kernels' products over d cover): d - 64 at 80 and 96 in their
    128-wide tiles; 0 (the whole tile) at the powers of two, and everywhere with SLICED_HEAD_DIMS emptied."""
    assert [common.d_split(d) for d in (64, 80, 96, 128, 256)] == [0, 16, 32, 0, 0]
    monkeypatch.setattr(common, "SLICED_HEAD_DIMS", ())
    assert [common.d_split(d) for d in (80, 96)] == [0, 0]


def test_descriptors_cover_strided_views_in_place():
    """Rank-4 boxes of (1, 1, rows, d) over the tensor's own strides (a token-major view is not copied); the
    box layout is built once per (rows, d, dtype)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    t = torch.empty(2, 256, 3, 128, dtype=torch.bfloat16).transpose(1, 2)
    desc = common.descriptor(t, 64)
    assert list(desc.block_shape) == [1, 1, 64, 128] and tuple(desc.strides) == t.stride()
    assert list(desc.shape) == list(t.shape) and desc.base is t
    assert common.descriptor(t, 64).layout is desc.layout
    assert common.descriptor(t.to(torch.float16), 64).layout is not desc.layout


# --- sm_90 GPU only ----------------------------------------------------------------------------------------

ON_HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
         and hopper.triton.__version__.startswith(GLUON_TRITON_VERSIONS)),
    reason=f"the Gluon forward runs on compute capability 9.x with Triton {GLUON_TRITON_VERSIONS}")


def record_gluon_launches(patch, ran: list) -> None:
    """Append "fwd", "dq", "dkdv" or "fused" to ``ran`` for each Gluon launch (the kernels still run)."""
    for module, label in ((hopper, "fwd"), (ws_hopper, "fwd"), (dq_hopper, "dq"), (dkdv_hopper, "dkdv"),
                          (fused_hopper, "fused")):
        real = module.launch
        patch.setattr(module, "launch", lambda *args, real=real, label=label: ran.append(label) or real(*args))


def _grouped_qkv(heads, nq, nk, d, dtype, token_major, seed):
    """q (2, Hq, nq, d) and k, v (2, Hkv, nk, d) on the GPU, head-major or token-major views."""
    hq, hkv = heads
    if token_major:
        q = token_major_view(2, hq, nq, d, dtype, seed)
        return q, token_major_view(2, hkv, nk, d, dtype, seed + 1), token_major_view(2, hkv, nk, d, dtype, seed + 2)
    q = random_qkv((2, hq), nq, nk, d, dtype, "cuda", seed)[0]
    _, k, v = random_qkv((2, hkv), nq, nk, d, dtype, "cuda", seed + 1)
    return q, k, v


@pytest.mark.gpu
@ON_HOPPER
@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([(3, 3), (8, 2), (4, 1), (64, 32)]),
    nq=st.sampled_from([1, 17, 128, 255, 1000, 2048]),
    nk=st.sampled_from([1, 63, 128, 257, 1025, 2048]),
    d=st.sampled_from(hopper.HEAD_DIMS),
    is_causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    token_major=st.booleans(),
    long_dq=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
# Fixed edge cases: causal key blocks that see no query (dK, dV must be zeros), one key, grouped heads at
# ragged lengths.
@example(heads=(3, 3), nq=17, nk=2048, d=128, is_causal=True, dtype=torch.bfloat16, token_major=False,
         long_dq=False, seed=1)
@example(heads=(3, 3), nq=2048, nk=1, d=64, is_causal=True, dtype=torch.float16, token_major=True, long_dq=False,
         seed=2)
@example(heads=(8, 2), nq=1000, nk=1025, d=128, is_causal=False, dtype=torch.bfloat16, token_major=True,
         long_dq=False, seed=3)
@example(heads=(4, 1), nq=255, nk=1025, d=256, is_causal=True, dtype=torch.bfloat16, token_major=True,
         long_dq=False, seed=4)
@example(heads=(8, 2), nq=1000, nk=257, d=256, is_causal=False, dtype=torch.float16, token_major=True,
         long_dq=True, seed=5)
def test_gpu_hopper_kernels_match_float64_reference(heads, nq, nk, d, is_causal, dtype, token_major, long_dq,
                                                    seed):
    """O, the saved L, dQ, dK, dV against float64 with the Gluon forward, dQ and dK/dV in the path (the dQ
    kernel reads the forward's L, the dK/dV kernel the dQ kernel's delta): ragged ends, Nq != Nk, one query or
    one key, grouped K/V heads (at d 256 hopper/backward_wide's dK/dV pass walks the group's heads), token-major
    views; all three Gluon kernels must have run.  long_dq: dQ's long-row tiles whatever the size (d 256)."""
    q, k, v = _grouped_qkv(heads, nq, nk, d, dtype, token_major, seed)
    ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CS336_FLASH_HOPPER_FWD", "1")
        patch.setenv("CS336_FLASH_HOPPER_BWD", "1")
        patch.setenv("CS336_FLASH_FUSED_BWD", "0")  # the two-kernel backward (the fused one has a test of its own)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        if long_dq:
            patch.setattr(dq_hopper, "LONG_QUERIES", 0)
        record_gluon_launches(patch, ran)
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, is_causal)
    assert ran == ["fwd", "dq", "dkdv"], f"Hopper kernels that ran: {ran}"  # forced on: all three must run


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("heads, n, d, is_causal, expected", [
    (8, 16384, 128, True, ["fwd", "fused"]),
    (2, 4096, 256, True, ["dq", "dkdv"]),
    (8, 4096, 128, False, ["fwd", "fused"]),  # without the mask from the fused backward's 4096 queries at d 128
    (16, 4096, 128, True, ["fwd", "fused"]),
    (16, 2048, 64, True, ["dq", "dkdv"]),  # causal d 64 from CAUSAL_MIN_QUERIES (the forward stays portable)
    (16, 4096, 64, True, ["fused"]),  # d 64 from the fused backward's 4096 queries (the forward stays portable)
])
def test_gpu_compiled_calls_run_the_gluon_kernels_an_eager_call_runs(heads, n, d, is_causal, expected):
    """torch.compile(fullgraph=True) at sizes the Gluon kernels take: the traced call keeps the custom ops,
    which run the same Gluon kernels as the eager call, with the same results."""
    q, k, v = random_qkv((1, heads), n, n, d, torch.bfloat16, "cuda", 7)
    ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CS336_FLASH_HOPPER_FWD", raising=False)  # the default rules
        patch.delenv("CS336_FLASH_HOPPER_BWD", raising=False)
        patch.delenv("CS336_FLASH_FUSED_BWD", raising=False)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        record_gluon_launches(patch, ran)
        outputs = []
        for fn in (FlashAttentionTriton.apply, torch.compile(FlashAttentionTriton.apply, fullgraph=True)):
            ran.clear()
            q.grad = k.grad = v.grad = None
            o = fn(q, k, v, is_causal)
            o.float().square().sum().backward()
            assert ran == expected, (fn, ran)
            outputs.append([t.detach().clone() for t in (o, q.grad, k.grad, v.grad)])
    for eager, compiled in zip(*outputs):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("is_causal, n", [(True, 2000), (False, 1000)])
def test_gpu_d128_dq_stage_counts_agree_bit_for_bit(monkeypatch, is_causal, n):
    """The Gluon dQ at d 128 with two ring stages (`two_stages`: large grids) and with three does the same
    arithmetic per output: dQ and delta bit-equal, ragged ends included."""
    g = torch.Generator("cuda").manual_seed(12)
    q, k, v, do = (torch.randn(2, 3, n, 128, generator=g, device="cuda").bfloat16() for _ in range(4))
    o, lse = flash_calls.forward(q, k, v, is_causal, tma=0)  # portable forward
    stages, results = [], []
    real = dq_hopper.tiles
    monkeypatch.setattr(dq_hopper, "tiles", lambda *args: stages.append(real(*args)[2]) or real(*args))
    for threshold in (0, 1 << 30):
        monkeypatch.setattr(dq_hopper, "TWO_STAGE_PROGRAMS", {True: threshold, False: threshold})
        delta, dq = torch.empty_like(lse), torch.empty_like(q)
        dq_hopper.launch(q, k, v, o, do, lse, delta, dq, is_causal)
        results.append((dq, delta))
    assert stages == [2, 3]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.isfinite(results[0][0]).all() and results[0][0].abs().max() > 0


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("is_causal, heads, n", [(True, (2, 2), 4096), (False, (4, 2), 1000)])
def test_gpu_d256_dkdv_pass_equals_the_fused_pass_bit_for_bit(is_causal, heads, n):
    """hopper/backward_wide's dK/dV pass and its fused pass do the same arithmetic per dK and dV entry (same
    tiles, same order): equal bit for bit given the same delta (the fused pass's own, which the dK/dV pass
    then reads in place of hopper/dq's), with grouped heads and a ragged length too.  (The fused pass's dQ is
    checked against float64 by test_gpu_fused_backward_matches_float64_reference.)"""
    wide = pytest.importorskip("cs336_systems.attention.kernels.hopper.backward_wide")
    g = torch.Generator("cuda").manual_seed(11)
    q, do = (torch.randn(1, heads[0], n, 256, generator=g, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(1, heads[1], n, 256, generator=g, device="cuda").bfloat16() for _ in range(2))
    o, lse = flash_calls.forward(q, k, v, is_causal, tma=0)  # portable forward
    delta = torch.empty_like(lse)
    results = []
    for fused in (True, False):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        if fused:
            dqa = torch.empty(q.numel(), device="cuda", dtype=torch.float32)
            wide.launch(q, k, v, o, do, lse, delta, dqa, torch.empty_like(q), dk, dv, is_causal)
        else:
            wide.launch_dkdv(q, k, v, do, lse, delta, dk, dv, is_causal)
        results.append((dk, dv))
    assert torch.equal(results[0][1], results[1][1]), "dV"
    assert torch.equal(results[0][0], results[1][0]), "dK"
    assert torch.isfinite(results[0][0]).all() and results[0][0].abs().max() > 0


def _forward_inputs(z, heads, nq, nk, d, token_major, device="cuda"):
    """Detached bfloat16 q (z, Hq, nq, d) and k, v (z, Hkv, nk, d), seeded by the lengths: head-major, or
    head-major views of token-major memory."""
    if token_major:
        q = token_major_view(z, heads[0], nq, d, torch.bfloat16, nq, device)
        k, v = (token_major_view(z, heads[1], nk, d, torch.bfloat16, nk + i, device) for i in (1, 2))
    else:
        q = random_qkv((z, heads[0]), nq, nk, d, torch.bfloat16, device, nq)[0]
        _, k, v = random_qkv((z, heads[1]), nq, nk, d, torch.bfloat16, device, nk)
    return tuple(t.detach() for t in (q, k, v))


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, nq, nk, d, is_causal, token_major", [
    (1, (8, 8), 16384, 16384, 128, True, False),  # the d 128 leaderboard shape
    (2, (4, 4), 1000, 1025, 128, False, True),  # ragged ends, Nq != Nk
    (2, (3, 3), 17, 1, 64, False, False),  # one key: the only tile is also the last
    (2, (3, 3), 1, 300, 128, True, True),  # one query row: the second warpgroup's rows are all past Nq
    (1, (8, 2), 2048, 2048, 64, True, True),  # grouped K/V heads
    (2, (3, 3), 200, 700, 128, True, False),  # causal, Nk > Nq: rows see keys only up to their own index
])
def test_gpu_warp_specialized_forward_equals_the_one_program_kernel(z, heads, nq, nk, d, is_causal, token_major):
    """flash_fwd_hopper_ws runs flash_fwd_hopper's per-row loop with a producer warp and two independent
    consumer warpgroups: O and L must equal the one-program kernel's bit for bit, and be finite."""
    assert d in ws_hopper.HEAD_DIMS
    q, k, v = _forward_inputs(z, heads, nq, nk, d, token_major)
    results = []
    for run in (ws_hopper.launch, hopper.launch):
        o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        run(q, k, v, o, lse, is_causal)
        results.append((o, lse))
    for name, a, b in zip(("o", "lse"), *results):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, nq, nk, d, is_causal, token_major", [
    (1, (16, 16), 4096, 4096, 80, True, True),  # long causal rows, the model's token-major views
    (2, (4, 4), 1000, 1025, 96, False, True),  # ragged ends, Nq != Nk
    (2, (3, 3), 17, 1, 80, False, False),  # one key: the only tile is also the last
    (2, (3, 3), 1, 300, 96, True, True),  # one query row: the second warpgroup's rows are all past Nq
    (1, (8, 2), 2048, 2048, 80, True, True),  # grouped K/V heads
    (2, (3, 3), 200, 700, 96, True, False),  # causal, Nk > Nq
    (1, (4, 4), 4096, 4096, 256, True, True),  # d 256: 64-key tiles, K's ring in three stages and V's in two
    (2, (3, 3), 1000, 1025, 256, False, False),
    (2, (3, 3), 1, 300, 256, True, True),
    (1, (8, 2), 2048, 2048, 256, True, False),
])
def test_gpu_warp_specialized_forward_at_sliced_and_wide_head_dims_matches_float64(z, heads, nq, nk, d, is_causal,
                                                                                  token_major):
    """At d 80 / 96 the warp-specialized forward runs in d 128's tiles with S over d in two slices (its
    128-key tiles differ from the one-program kernel's 64, so the two agree to rounding, not bit for bit), at
    d 256 in 64-key tiles (the one-program kernel's are 32): O within 2x naive bf16 attention's error (+ the
    floor) of float64, L within 1e-4 + the floor, both finite."""
    from attention_reference import ATOL, reference

    from cs336_systems.attention.naive import naive_attention

    assert d in ws_hopper.HEAD_DIMS and common.d_split(d) == (0 if d == 256 else d - 64)
    q, k, v = _forward_inputs(z, heads, nq, nk, d, token_major)
    o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
    ws_hopper.launch(q, k, v, o, lse, is_causal)
    ref_o, ref_lse = reference(q, k, v, is_causal)
    group = heads[0] // heads[1]
    naive = naive_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=is_causal)
    floor = ATOL[torch.bfloat16] * max(1.0, ref_o.abs().max().item())
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err, bound = (o.double() - ref_o).abs().max().item(), 2 * (naive.double() - ref_o).abs().max().item() + floor
    assert err <= bound, f"O: max error {err:.3e} > bound {bound:.3e}"
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4 + ATOL[torch.bfloat16]


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, nq, nk, d, is_causal", [
    (4, (32, 32), 512, 512, 80, True),  # the 2.7B model's attention
    (2, (3, 3), 1000, 1025, 96, False),
    (2, (3, 3), 17, 1, 80, False),  # one key: the forward's only tile is also its last
    (2, (3, 3), 1, 1, 96, True),
    (1, (8, 2), 2048, 2048, 80, True),  # grouped K/V heads
    (2, (16, 16), 8192, 8192, 96, True),  # long rows: 128 key tiles per dQ program
])
def test_gpu_sliced_head_dims_agree_bit_for_bit_with_the_whole_tile(monkeypatch, z, heads, nq, nk, d, is_causal):
    """At d 80 and 96 the three Gluon kernels compute their products over d in two slices (64 + d - 64
    columns) instead of the whole 128-wide tile: the skipped columns are zeros, so O, L, delta, dQ, dK and dV
    must equal the whole tile's bit for bit, and be finite."""
    assert common.d_split(d) == d - 64
    g = torch.Generator("cuda").manual_seed(nq + d)
    q, do = (torch.randn(z, nq, heads[0], d, generator=g, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(z, nk, heads[1], d, generator=g, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    results = []
    for sliced in (common.SLICED_HEAD_DIMS, ()):
        monkeypatch.setattr(common, "SLICED_HEAD_DIMS", sliced)
        o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        o_ws, lse_ws = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
        hopper.launch(q, k, v, o, lse, is_causal)
        ws_hopper.launch(q, k, v, o_ws, lse_ws, is_causal)  # the warp-specialized forward slices S the same way
        dq, delta = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        dq_hopper.launch(q, k, v, o, do, lse, delta, dq, is_causal)
        dkdv_hopper.launch(q, k, v, do, lse, delta, dk, dv, is_causal)
        results.append((o, lse, o_ws, lse_ws, delta, dq, dk, dv))
    for name, a, b in zip(("o", "lse", "o_ws", "lse_ws", "delta", "dq", "dk", "dv"), *results):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


@pytest.mark.gpu
@ON_HOPPER
def test_gpu_default_rules_mix_gluon_dq_with_the_portable_dkdv_for_grouped_heads():
    """At d 256 with grouped K/V heads the defaults take the Gluon dQ (whose delta the portable dK/dV then
    reads) and keep the portable dK/dV and forward (2048 keys): the mixed path against float64."""
    q = random_qkv((1, 8), 2048, 2048, 256, torch.bfloat16, "cuda", 13)[0]
    _, k, v = random_qkv((1, 2), 2048, 2048, 256, torch.bfloat16, "cuda", 14)
    ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CS336_FLASH_HOPPER_FWD", raising=False)
        patch.delenv("CS336_FLASH_HOPPER_BWD", raising=False)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        record_gluon_launches(patch, ran)
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, True)
    assert ran == ["dq"], ran


@pytest.mark.gpu
@ON_HOPPER
def test_gpu_gluon_launches_from_a_thread_with_no_cuda_context_bound():
    """A new thread has no CUDA context bound until its first runtime call, and its tensors can come from the
    caching allocator without one: the Gluon kernels' host-side TMA descriptors must still encode there (as
    on autograd's device thread when a backward is its first CUDA work)."""
    import threading

    q, k, v = random_qkv((1, 4), 2048, 2048, 64, torch.bfloat16, "cuda", 3)
    do = torch.randn_like(q)
    expected = [t.clone() for t in flash_calls.forward(q, k, v, True, options="hopper_fwd=on")]
    expected += [t.clone() for t in flash_calls.backward(q, k, v, *expected, do, True, options="hopper_bwd=on")]
    results, errors = [], []

    def run():
        try:
            o, lse = flash_calls.forward(q, k, v, True, options="hopper_fwd=on")
            results.extend([o, lse, *flash_calls.backward(q, k, v, o, lse, do, True, options="hopper_bwd=on")])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # the ordinary launches, descriptors built in the thread
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0 if got.dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, n, d", [(2, (4, 4), 1000, 64), (4, (32, 32), 512, 80), (1, (8, 2), 700, 128),
                                            (1, (2, 2), 300, 256)])
def test_gpu_gluon_launches_are_recorded_and_replayed(monkeypatch, z, heads, n, d):
    """Gluon launches (host-side TMA descriptors) are recorded like the portable ones: with every Hopper
    kernel forced on, the second and third calls of a signature replay the first's launches, with the
    descriptors rebuilt on the new tensors, and give the ordinary path's outputs bit for bit (the 2.7B
    model's shape, d 80 and N 512, among them)."""
    from test_flash_replay import _assert_replays_match_the_ordinary_path

    monkeypatch.setenv("CS336_FLASH_HOPPER_FWD", "1")
    monkeypatch.setenv("CS336_FLASH_HOPPER_BWD", "1")
    monkeypatch.setenv("CS336_FLASH_FUSED_BWD", "0")  # its replays: test_gpu_fused_backward_is_recorded_and_replayed
    q, k, v = (token_major_view(z, heads[i > 0], n, d, torch.bfloat16, i) for i in range(3))
    grad_out = torch.randn_like(q)
    table = {}
    _, replays = _assert_replays_match_the_ordinary_path(q, k, v, True, grad_out, table=table)
    assert replays == 4  # the forward's and the backward's signature, at the second and third call
    names = sorted(launch.compiled.name for plan in table.values() for launch in plan.launches)
    # d 80 / 96 take the warp-specialized forward from 2048 keys only (the plan's "fwd-ws" rules)
    forward = "flash_fwd_hopper_ws_kernel" if d in (64, 128) else "flash_fwd_hopper_kernel"
    dkdv = "flash_bwd_wide_kernel" if d == 256 else "flash_dkdv_hopper_kernel"  # d 256: hopper/backward_wide's pass
    assert names == sorted([dkdv, "flash_dq_hopper_kernel", forward])


@pytest.mark.gpu
@ON_HOPPER
@settings(max_examples=30, deadline=None)
@given(
    heads=st.sampled_from([(3, 3), (8, 2), (4, 1)]),
    nq=st.sampled_from([1, 17, 128, 255, 1000, 2048]),
    nk=st.sampled_from([1, 63, 128, 257, 1025, 2048]),
    d=st.sampled_from(fused_hopper.HEAD_DIMS),
    is_causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    token_major=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(heads=(3, 3), nq=17, nk=2048, d=64, is_causal=True, dtype=torch.bfloat16, token_major=False, seed=1)
@example(heads=(8, 2), nq=1000, nk=1025, d=128, is_causal=False, dtype=torch.bfloat16, token_major=True, seed=3)
@example(heads=(4, 1), nq=2048, nk=2048, d=64, is_causal=True, dtype=torch.float16, token_major=True, seed=4)
@example(heads=(3, 3), nq=255, nk=2048, d=128, is_causal=True, dtype=torch.bfloat16, token_major=False, seed=5)
@example(heads=(4, 1), nq=1000, nk=257, d=80, is_causal=True, dtype=torch.bfloat16, token_major=True, seed=6)
@example(heads=(8, 2), nq=128, nk=1025, d=96, is_causal=False, dtype=torch.float16, token_major=False, seed=7)
@example(heads=(3, 3), nq=255, nk=1025, d=256, is_causal=True, dtype=torch.bfloat16, token_major=False, seed=8)
@example(heads=(8, 2), nq=1000, nk=63, d=256, is_causal=False, dtype=torch.float16, token_major=True, seed=9)
@example(heads=(4, 1), nq=2048, nk=2048, d=256, is_causal=True, dtype=torch.bfloat16, token_major=True, seed=10)
@example(heads=(3, 3), nq=17, nk=128, d=256, is_causal=False, dtype=torch.bfloat16, token_major=False, seed=11)
def test_gpu_fused_backward_matches_float64_reference(heads, nq, nk, d, is_causal, dtype, token_major, seed):
    """dQ, dK, dV of the fused backward (flash_bwd_hopper, forced on) against float64: ragged ends, Nq != Nk,
    one query or one key, key blocks that see no query, grouped K/V heads (on these small grids each group
    split among programs, with partial dK and dV summed after; at d 256 the group's heads in turn), token-major
    views, every head dim it has (256: hopper/backward_wide's kernel, an Nq not a multiple of 4 with an
    accumulator padded per call)."""
    q, k, v = _grouped_qkv(heads, nq, nk, d, dtype, token_major, seed)
    ran = []
    real = fused_hopper.launch
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CS336_FLASH_FUSED_BWD", "1")
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launcher counted below
        patch.setattr(fused_hopper, "launch", lambda *args: ran.append("fused") or real(*args))
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, is_causal)
    assert ran == ["fused"], ran


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, n, d, is_causal, split", [(2, (4, 4), 1000, 64, True, False),
                                                              (1, (8, 2), 700, 128, False, False),
                                                              (1, (8, 2), 700, 80, True, True),
                                                              (1, (4, 2), 700, 256, True, False)])
def test_gpu_fused_backward_is_recorded_and_replayed(monkeypatch, z, heads, n, d, is_causal, split):
    """The fused backward's three launches are recorded like the others, its float32 dQ accumulator taken as
    an extra slot: the next calls of the signature replay them.  dK and dV equal the ordinary call's bit for
    bit; dQ is summed by TMA reductions whose order varies from run to run, so it is compared within
    float32 rounding of the accumulator (one unit in the last place of the output dtype).  A group split
    among programs (``split``) allocates its partial sums per call, which a recording refuses: every call
    then takes the ordinary path, with the same dK and dV bit for bit."""
    monkeypatch.setenv("CS336_FLASH_FUSED_BWD", "1")
    if not split:
        monkeypatch.setattr(fused_hopper, "group_splits", lambda *args: 1)
    q, k, v = (token_major_view(z, heads[i > 0], n, d, torch.bfloat16, i).requires_grad_() for i in range(3))
    grad_out = torch.randn_like(q)

    def call():
        for t in (q, k, v):
            t.grad = None
        FlashAttentionTriton.apply(q, k, v, is_causal).backward(grad_out)
        return [t.grad.clone() for t in (q, k, v)]

    monkeypatch.setenv(flash_triton.REPLAY_ENV, "0")
    expected = call()
    monkeypatch.delenv(flash_triton.REPLAY_ENV)
    table = {}
    monkeypatch.setattr(flash_replays, "recorded", table)
    ran, real = [], fused_hopper.launch
    monkeypatch.setattr(fused_hopper, "launch", lambda *args: ran.append(1) or real(*args))
    for _ in range(3):
        dq, dk, dv = call()
        assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
        torch.testing.assert_close(dq, expected[0], rtol=2 ** -7, atol=1e-3)
    plans = [plan for plan in table.values() if plan is not None and any(
        launch.compiled.name in ("flash_bwd_hopper_kernel", "flash_bwd_wide_kernel") for launch in plan.launches)]
    if split:
        assert not plans and len(ran) == 3
        return
    assert len(plans) == 1 and len(plans[0].launches) == 3
    assert len(ran) == 1  # recorded at the first call, replayed at the next two


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("d, is_causal", [(64, False), (128, False), (64, True), (256, False), (256, True)])
def test_gpu_fused_backward_masks_the_keys_past_nk(d, is_causal):
    """Keys past Nk are zero-filled by TMA, so their scores are 0: with every real score far below 0 (L about
    -20), exp(-L) overflows float16, and unmasked they would put inf x 0 into dQ.  Nk ragged (1000), Nq >
    Nk, float16: the gradients stay finite and match float64."""
    q, k, v = _grouped_qkv((2, 2), 1100, 1000, d, torch.float16, False, 21)
    with torch.no_grad():  # q = -a u, k = a u (u a unit vector, small noise): scores -a^2 / sqrt(d) = -20
        unit = torch.ones(d, device="cuda", dtype=torch.float16) / d ** 0.5
        a = (20 * d ** 0.5) ** 0.5
        q.copy_(q * 0.01 - a * unit)
        k.copy_(k * 0.01 + a * unit)
    ran, real = [], fused_hopper.launch
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CS336_FLASH_FUSED_BWD", "1")
        patch.setenv(flash_triton.REPLAY_ENV, "0")
        patch.setattr(fused_hopper, "launch", lambda *args: ran.append("fused") or real(*args))
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, is_causal)
    assert ran == ["fused"], ran
