"""The Gluon Hopper kernels (flash_fwd_hopper, flash_dkdv_hopper): where they are chosen, and on an sm_90 GPU
O, L, dQ, dK and dV against float64 with the Hopper kernels in the path.

The kernel itself compiles only for sm_90 (no interpreter), so on CPU these tests check the selection rules
and the dispatch; the GPU tests run on Hopper and skip elsewhere with the reason."""

import pytest
import torch
from attention_reference import assert_flash_accuracy, random_qkv, token_major_view
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.attention.kernels import flash_launch

# The Gluon API is experimental: a Triton release without these names skips this file (flash_triton then
# runs the portable kernels only).
hopper = pytest.importorskip("cs336_systems.attention.kernels.flash_fwd_hopper")
dkdv_hopper = pytest.importorskip("cs336_systems.attention.kernels.flash_dkdv_hopper")
dq_hopper = pytest.importorskip("cs336_systems.attention.kernels.flash_dq_hopper")
ws_hopper = pytest.importorskip("cs336_systems.attention.kernels.flash_fwd_hopper_ws")
fused_hopper = pytest.importorskip("cs336_systems.attention.kernels.flash_bwd_hopper")

CUDA = torch.device("cuda")


def _pretend_capability(monkeypatch, major):
    """The (cached) capability lookup every call makes answers `major` for any CUDA device."""
    monkeypatch.setattr(flash_launch, "_capability_major", lambda index: major)
    monkeypatch.setattr(flash_launch.torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def hopper_machine(monkeypatch):
    """Pretend to be an sm_90 device with the Triton release the Gluon code is written against."""
    _pretend_capability(monkeypatch, 9)
    monkeypatch.setattr(hopper.triton, "__version__", "3.6.0")
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.delenv(dkdv_hopper.ENV, raising=False)
    monkeypatch.delenv(fused_hopper.ENV, raising=False)


def test_wanted_by_default_at_the_measured_head_dims_only(hopper_machine):
    assert hopper.wanted(128, torch.bfloat16, CUDA) and hopper.wanted(128, torch.float16, CUDA)
    assert hopper.wanted(256, torch.bfloat16, CUDA)
    assert not hopper.wanted(64, torch.bfloat16, CUDA)  # slower than the portable kernel there
    assert not hopper.wanted(128, torch.float32, CUDA)
    assert not hopper.wanted(128, torch.bfloat16, torch.device("cpu"))
    assert hopper.wanted(80, torch.bfloat16, CUDA) and hopper.wanted(96, torch.bfloat16, CUDA)  # 128-wide tiles
    assert not hopper.wanted(112, torch.bfloat16, CUDA) and not hopper.wanted(48, torch.bfloat16, CUDA)


def test_environment_switches_it_off_or_on_for_every_supported_head_dim(hopper_machine, monkeypatch):
    monkeypatch.setenv(hopper.ENV, "0")
    assert not hopper.wanted(128, torch.bfloat16, CUDA)
    monkeypatch.setenv(hopper.ENV, "1")
    assert all(hopper.wanted(d, torch.bfloat16, CUDA) for d in hopper.HEAD_DIMS)
    assert not hopper.wanted(112, torch.bfloat16, CUDA)


def test_not_wanted_off_hopper_or_on_other_triton_releases(hopper_machine, monkeypatch):
    _pretend_capability(monkeypatch, 8)
    assert not hopper.wanted(128, torch.bfloat16, CUDA)
    _pretend_capability(monkeypatch, 10)
    assert not hopper.wanted(128, torch.bfloat16, CUDA)
    _pretend_capability(monkeypatch, 9)
    monkeypatch.setattr(hopper.triton, "__version__", "3.9.0")
    assert not hopper.wanted(128, torch.bfloat16, CUDA)


def test_dkdv_kernel_has_its_own_switch(hopper_machine, monkeypatch):
    assert dkdv_hopper.DEFAULT_HEAD_DIMS
    assert all(dkdv_hopper.wanted(d, torch.bfloat16, CUDA) for d in dkdv_hopper.DEFAULT_HEAD_DIMS)
    assert not dkdv_hopper.wanted(112, torch.bfloat16, CUDA)
    assert not dkdv_hopper.wanted(128, torch.float32, CUDA)
    monkeypatch.setenv(hopper.ENV, "0")  # the forward's switch leaves dK/dV alone
    assert dkdv_hopper.wanted(dkdv_hopper.DEFAULT_HEAD_DIMS[0], torch.bfloat16, CUDA)
    monkeypatch.setenv(dkdv_hopper.ENV, "0")
    assert not any(dkdv_hopper.wanted(d, torch.bfloat16, CUDA) for d in dkdv_hopper.HEAD_DIMS)
    monkeypatch.setenv(dkdv_hopper.ENV, "1")
    assert all(dkdv_hopper.wanted(d, torch.float16, CUDA) for d in dkdv_hopper.HEAD_DIMS)


def test_dkdv_takes_the_hopper_kernel_only_where_it_measured_faster(monkeypatch):
    """Defaults: no grouped K/V heads, at least MIN_QUERIES queries and two programs per SM; elsewhere the
    portable kernel (smaller key blocks, groups spread over programs), unless the environment forces it."""
    monkeypatch.setattr(dkdv_hopper, "wanted", lambda *args: True)
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(dkdv_hopper.ENV, raising=False)
    block_n = dkdv_hopper.tiles(128)[0]

    def qkv(hq, hkv, n, z=1):
        q = torch.empty(z, hq, n, 128, dtype=torch.bfloat16)
        k = torch.empty(z, hkv, n, 128, dtype=torch.bfloat16)
        return q, k, k, q

    assert dkdv_hopper.usable(*qkv(16, 16, 2048, z=4))  # 2048 programs
    assert not dkdv_hopper.usable(*qkv(25, 25, 512, z=4))  # 800 programs, but a short sequence
    assert dkdv_hopper.usable(*qkv(1, 1, 32768))  # 512 programs
    assert not dkdv_hopper.usable(*qkv(1, 1, 16384))  # 256 programs: fewer than 2 per SM
    assert dkdv_hopper.usable(*qkv(2, 2, 16384))  # 512 programs
    assert not dkdv_hopper.usable(*qkv(2, 2, 128 * block_n))  # 256 programs
    assert not dkdv_hopper.usable(*qkv(32, 8, 16384))  # grouped heads: not measured, portable
    monkeypatch.setenv(dkdv_hopper.ENV, "1")
    assert dkdv_hopper.usable(*qkv(32, 1, 8192)) and dkdv_hopper.usable(*qkv(1, 1, 64))


def test_fused_backward_takes_its_measured_territory(hopper_machine, monkeypatch):
    """The fused backward: head dims 64 and 128 (DEFAULT_HEAD_DIMS by default), bfloat16 / float16 on
    sm_90; by default causal from MIN_QUERIES queries with MIN_PROGRAMS_PER_SM programs of 128 keys (of one
    K/V head) per SM, and without the mask from NONCAUSAL_MIN_QUERIES queries without grouped heads; the
    environment forces it on at any size or off, and switching the Gluon backward kernels off switches it
    off too."""
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    n = fused_hopper.MIN_QUERIES[64]
    per_sm = 132 * fused_hopper.MIN_PROGRAMS_PER_SM * fused_hopper.BLOCK_N

    def fits(z, hq, hkv, n, d=64, dtype=torch.bfloat16, causal=True):
        return fused_hopper.fits(z, hq, hkv, n, n, d, dtype, CUDA, causal)

    assert fits(1, 16, 16, 16384) and fits(4, 16, 16, n) and fits(1, 16, 16, n, dtype=torch.float16)
    assert not fits(4, 16, 16, n // 2)  # shorter rows: the two-kernel backward
    assert fits(1, 32, 8, 16384) and not fits(1, 32, 1, 8192)  # grouped heads: programs per K/V head
    m = fused_hopper.NONCAUSAL_MIN_QUERIES[64]
    assert fits(1, 8, 8, m, causal=False) and not fits(1, 8, 8, m - 1, causal=False)  # no program count
    assert not fits(1, 32, 8, 16384, causal=False)  # grouped heads without the mask: not measured
    assert all(fits(1, 16, 16, 16384, d=d) == (d in fused_hopper.DEFAULT_HEAD_DIMS) for d in (64, 80, 128, 256))
    n128 = fused_hopper.MIN_QUERIES[128]  # d 128: shorter rows
    assert fits(4, 25, 25, n128, d=128) and not fits(4, 25, 25, n128 // 2, d=128)
    m128 = fused_hopper.NONCAUSAL_MIN_QUERIES[128]
    assert fits(1, 8, 8, m128, d=128, causal=False) and not fits(1, 8, 8, m128 - 1, d=128, causal=False)
    assert not fits(1, 16, 16, 16384, dtype=torch.float32)
    assert fits(1, 1, 1, max(n, per_sm)) and not fits(1, 1, 1, max(n, per_sm) - fused_hopper.BLOCK_N)
    monkeypatch.setenv(fused_hopper.ENV, "1")
    assert fits(4, 25, 25, 512) and fits(1, 32, 1, 100) and fits(1, 2, 2, 64, causal=False)
    assert fits(1, 8, 8, 64, d=128) and not fits(1, 8, 8, 4096, d=96)
    monkeypatch.setenv(fused_hopper.ENV, "0")
    assert not fits(1, 16, 16, 16384)
    monkeypatch.delenv(fused_hopper.ENV)
    monkeypatch.setenv(dkdv_hopper.ENV, "0")
    assert not fits(1, 16, 16, 16384)


@pytest.mark.skipif(not flash_triton.KERNELS_INTERPRETED, reason="CPU check of the small kernels in the interpreter")
def test_fused_backward_prep_and_post_kernels_match_torch():
    """The fused backward's two small kernels (the Gluon kernel itself runs only on sm_90): delta =
    rowsum(O * dO) with a zeroed float32 dQ accumulator, then dQ = accumulator · scale in dQ's dtype and
    strides; token-major views of O and dQ, a ragged last row block."""
    z, h, n, d = 2, 3, 70, 64
    o = torch.randn(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    do = torch.randn(z, h, n, d, dtype=torch.float16)
    delta, dqa = torch.empty(z, h, n), torch.full((z, h, n, d), 7.0)
    fused_hopper._prep_kernel[(2, z * h)](o, do, delta, dqa, n, h, *o.stride()[:3], *do.stride()[:3], D=d, BLOCK=64)
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    assert not dqa.any()
    dqa = torch.randn(z, h, n, d)
    dq = torch.empty(z, n, h, d, dtype=torch.float16).transpose(1, 2)
    fused_hopper._post_kernel[(2, z * h)](dqa, dq, n, h, *dq.stride()[:3], 0.125, D=d, BLOCK=64)
    assert torch.equal(dq, (dqa * 0.125).half())


def test_dkdv_at_padded_head_dims_starts_at_the_models_context(monkeypatch):
    """d 80 and 96 (a padded 128-wide tile in either kernel) take the Hopper dK/dV from PADDED_MIN_QUERIES
    queries (the 2.7B model's N 512), with the other rules unchanged; d 64 and 128 keep MIN_QUERIES."""
    monkeypatch.setattr(dkdv_hopper, "wanted", lambda *args: True)
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(dkdv_hopper.ENV, raising=False)
    assert dkdv_hopper.PADDED_MIN_QUERIES == 512 < dkdv_hopper.MIN_QUERIES

    def qkv(hq, hkv, n, d, z=4):
        q = torch.empty(z, hq, n, d, dtype=torch.bfloat16)
        k = torch.empty(z, hkv, n, d, dtype=torch.bfloat16)
        return q, k, k, q

    for d in (80, 96):
        assert dkdv_hopper.usable(*qkv(32, 32, 512, d))  # the 2.7B model: 1024 programs
        assert not dkdv_hopper.usable(*qkv(32, 32, 511, d))
        assert not dkdv_hopper.usable(*qkv(32, 8, 512, d))  # grouped heads
        assert not dkdv_hopper.usable(*qkv(1, 1, 512, d, z=32))  # 256 programs: fewer than 2 per SM
    for d in (64, 128):
        assert not dkdv_hopper.usable(*qkv(32, 32, 512, d))
        assert dkdv_hopper.usable(*qkv(32, 32, 2048, d))


def test_dkdv_at_d256_splits_dk_and_dv_and_needs_no_program_count(monkeypatch):
    """d 256 runs two programs per key block (dV, dK) and, one program per SM either way, measured faster at
    every size from N 2048: no programs-per-SM rule there, the other rules as at d 128."""
    monkeypatch.setattr(dkdv_hopper, "wanted", lambda *args: True)
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(dkdv_hopper.ENV, raising=False)
    assert [dkdv_hopper.parts(d) for d in (64, 128, 256)] == [1, 1, 2]

    def qkv(hq, hkv, n, d=256):
        q = torch.empty(1, hq, n, d, dtype=torch.bfloat16)
        k = torch.empty(1, hkv, n, d, dtype=torch.bfloat16)
        return q, k, k, q

    assert dkdv_hopper.usable(*qkv(1, 1, 4096))  # 64 key blocks: 128 programs
    assert not dkdv_hopper.usable(*qkv(1, 1, 4096, d=128))  # the d 128 rule: too few programs
    assert not dkdv_hopper.usable(*qkv(1, 1, 1024))  # shorter than measured
    assert not dkdv_hopper.usable(*qkv(8, 2, 8192))  # grouped heads


def test_forward_takes_the_hopper_kernel_only_at_long_rows_and_a_program_per_sm(monkeypatch):
    monkeypatch.setattr(hopper, "wanted", lambda *args: True)
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(hopper.ENV, raising=False)

    def qkv(bh, nq, nk):
        q = torch.empty(1, bh, nq, 128, dtype=torch.bfloat16)
        k = torch.empty(1, bh, nk, 128, dtype=torch.bfloat16)
        return q, k, k

    assert hopper.usable(*qkv(8, 16384, 16384))  # 1024 programs
    assert hopper.usable(*qkv(1, 32768, 32768))  # 256 programs: one per SM
    assert not hopper.usable(*qkv(1, 16384, 16384))  # 128 programs
    # d 128 runs the warp-specialized kernel, which takes rows from WS_MIN_KEYS keys
    assert hopper.usable(*qkv(64, 2048, 2048)) and hopper.usable(*qkv(64, 16384, 8192))
    assert not hopper.usable(*qkv(64, 2048, 2047))
    assert not hopper.usable(*qkv(2, 2048, 2048))  # 32 programs

    def qkv256(bh, nq, nk):
        q = torch.empty(1, bh, nq, 256, dtype=torch.bfloat16)
        return q, torch.empty(1, bh, nk, 256, dtype=torch.bfloat16), torch.empty(1, bh, nk, 256, dtype=torch.bfloat16)

    assert hopper.usable(*qkv256(8, 16384, 16384))
    assert not hopper.usable(*qkv256(64, 2048, 2048))  # enough programs, rows too short (MIN_KEYS)
    assert not hopper.usable(*qkv256(64, 16384, 8192))
    # d 80 and 96 (products over d in slices) from SLICED_MIN_KEYS keys, with the same program rule
    q80 = torch.empty(4, 16, 1024, 80, dtype=torch.bfloat16)
    assert hopper.usable(q80, q80, q80)
    assert hopper.usable(q80[:, :, :512], q80[:, :, :512], q80[:, :, :512])  # the 2.7B model's N 512
    assert not hopper.usable(q80[:, :, :511], q80[:, :, :511], q80[:, :, :511])
    # programs counted in 128-row units, as measured, though a program there owns 64 rows
    q17, q9 = (torch.empty(1, h, 1024, 80, dtype=torch.bfloat16) for h in (17, 9))
    assert hopper.usable(q17, q17, q17)  # 136 units of 128 rows
    assert not hopper.usable(q9, q9, q9)  # 72 units (144 programs of 64 rows)
    monkeypatch.setattr(hopper, "SLICED_HEAD_DIMS", ())
    assert not hopper.usable(q80, q80, q80)  # a padded tile needs MIN_KEYS like the others
    monkeypatch.setenv(hopper.ENV, "1")
    assert hopper.usable(*qkv(1, 128, 128))


def test_dkdv_launch_plan_by_head_dim_and_grid_size(monkeypatch):
    """d <= 128 (80 and 96 in 128-wide tiles): one launch, both outputs per program.  d 256: the dV and dK
    parts in two launches at long rows when each fills the GPU (a key block per SM), the dV part with its own
    taller steps; otherwise both parts in one launch (program_id(2) picks)."""
    calls = []
    monkeypatch.setattr(dkdv_hopper, "_launch", lambda *args: calls.append(args[-3:-1]))
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)

    def plan(bh, n, d):
        calls.clear()
        q = torch.empty(1, bh, n, d, dtype=torch.bfloat16)
        dkdv_hopper.dkdv(q, q, q, q, None, None, q, q, True)
        return list(calls)

    assert plan(8, 8192, 64) == [(dkdv_hopper.tiles(64), 0)]
    assert plan(8, 8192, 96) == [(dkdv_hopper.tiles(128), 0)]
    assert plan(8, 8192, 256) == [(dkdv_hopper.DV_TILES_256, 1), (dkdv_hopper.tiles(256), 2)]  # 1024 key blocks
    long = [(dkdv_hopper.DV_TILES_256, 1), (dkdv_hopper.DK_TILES_LONG_256, 2)]
    assert plan(1, dkdv_hopper.LONG_QUERIES, 256) == long  # the dK part's 16-row steps
    assert plan(1, dkdv_hopper.LONG_QUERIES - 64, 256) == [(dkdv_hopper.DV_TILES_256, 1), (dkdv_hopper.tiles(256), 2)]
    assert plan(1, 4096, 256) == [(dkdv_hopper.tiles(256), 3)]  # 64 key blocks: one launch of 128 programs
    assert plan(8, 2048, 256) == [(dkdv_hopper.tiles(256), 3)]  # 256 key blocks, but short rows
    assert plan(1, 8192, 256) == [(dkdv_hopper.tiles(256), 3)]  # long rows, but 128 key blocks: fewer than SMs


def test_dq_tiles_by_head_dim_length_and_grid(monkeypatch):
    """dQ at d 256 takes 64-key steps with two stages from LONG_QUERIES queries or with fewer 64-row programs
    than SMs, 32-key steps with three otherwise; at d 128 64 x 64 tiles with two stages from
    TWO_STAGE_PROGRAMS programs (by the mask) and three below; d 64 and the 128-wide tiles of d 80 / 96 always
    three."""
    chosen = []
    monkeypatch.setattr(dq_hopper.fwd, "descriptor", lambda t, rows: None)
    monkeypatch.setattr(dq_hopper, "tiles", lambda width, long_rows=False, two=False, real=dq_hopper.tiles:
                        chosen.append(real(width, long_rows, two)) or real(width, long_rows, two))
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)

    class NoLaunch:  # kernel[grid](...) does nothing: only the tile choice is under test
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(dq_hopper, "flash_dq_hopper_kernel", NoLaunch())

    def plan(bh, n, d, causal=True):
        chosen.clear()
        q = torch.empty(1, bh, n, d, dtype=torch.bfloat16)
        dq_hopper.dq(q, q, q, q, q, None, None, q, causal)
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
        w = hopper.tile_dim(d)
        block_m, block_n, stages = hopper.tiles(d)
        assert 2 * w * (block_m + 2 * stages * block_n) <= 227 * 1024, d
    # d 80 and 96: two programs per SM (64 x 64 tiles) within the SM's 228 KB less 1 KB reserved per program
    for d in (80, 96):
        block_m, block_n, stages = hopper.tiles(d)
        assert (block_m, block_n, stages) == hopper.PADDED_TILES == (64, 64, 3)
        assert 2 * (2 * 128 * (block_m + 2 * stages * block_n) + 1024) <= 228 * 1024, d
    assert hopper.tiles(128) == (128, 128, 3) and hopper.tiles(64) == (128, 128, 3)
    # the warp-specialized forward (d 64, 128): Q's two 64-row halves and its K/V ring in one program
    for d in ws_hopper.HEAD_DIMS:
        block_n, stages = ws_hopper.TILES
        assert 2 * d * (2 * ws_hopper.ROWS + 2 * stages * block_n) <= 227 * 1024, d
    # its registers: 65536 a program, spread over 12 warps at launch, then rebalanced per warpgroup
    assert 12 * 32 * ws_hopper.MAXNREG <= 65536 and ws_hopper.MAXNREG % 8 == 0
    assert sum(ws_hopper.REGS) + ws_hopper.REGS[0] <= 3 * ws_hopper.MAXNREG
    for d in dkdv_hopper.HEAD_DIMS:
        w = hopper.tile_dim(d)
        for block_n, block_m, stages in {dkdv_hopper.tiles(w), dkdv_hopper.DV_TILES_256, dkdv_hopper.DK_TILES_LONG_256}:
            assert 2 * w * (2 * block_n + 2 * stages * block_m) <= 227 * 1024, d
    for d in dq_hopper.HEAD_DIMS:
        w = hopper.tile_dim(d)
        for block_m, block_n, stages in {dq_hopper.tiles(w), dq_hopper.tiles(w, long_rows=True),
                                         dq_hopper.tiles(w, two_stages=True)}:
            assert 2 * w * (2 * block_m + 2 * stages * block_n) <= 227 * 1024, d


def test_head_dims_below_a_power_of_two_take_wider_tma_boxes():
    """d 80 and 96 run in 128-wide tiles: the descriptors' boxes are 128 columns over the d-column tensor
    (TMA zero-fills the rest on loads and drops it on stores); powers of two keep their own width."""
    assert [hopper.tile_dim(d) for d in (64, 80, 96, 128, 256)] == [64, 128, 128, 128, 256]
    t = torch.empty(2, 3, 256, 80, dtype=torch.bfloat16)
    desc = hopper.descriptor(t, 64)
    assert list(desc.shape) == [2, 3, 256, 80] and list(desc.block_shape) == [1, 1, 64, 128]
    assert hopper.descriptor(torch.empty(1, 1, 64, 128, dtype=torch.bfloat16), 64).layout is desc.layout


def test_products_over_d_skip_the_padding_at_d80_and_d96_only(monkeypatch):
    """D_SPLIT (the columns past 64 the kernels' products over d cover): d - 64 at 80 and 96 in their
    128-wide tiles; 0 (the whole tile) at the powers of two, and everywhere with SLICED_HEAD_DIMS emptied."""
    assert [hopper.d_split(d) for d in (64, 80, 96, 128, 256)] == [0, 16, 32, 0, 0]
    monkeypatch.setattr(hopper, "SLICED_HEAD_DIMS", ())
    assert [hopper.d_split(d) for d in (80, 96)] == [0, 0]


def test_tma_switch_and_bad_switch_values(hopper_machine, monkeypatch):
    monkeypatch.setenv("CS336_FLASH_TMA", "0")  # no descriptors anywhere: these kernels are TMA kernels
    assert not hopper.wanted(128, torch.bfloat16, CUDA)
    assert not dkdv_hopper.wanted(64, torch.bfloat16, CUDA)
    monkeypatch.delenv("CS336_FLASH_TMA")
    for module in (hopper, dkdv_hopper):
        monkeypatch.setenv(module.ENV, "yes")
        with pytest.raises(ValueError, match=f"{module.ENV} must be 0 or 1, got 'yes'"):
            module.wanted(128, torch.bfloat16, CUDA)
        monkeypatch.delenv(module.ENV)


def test_tma_alignment_rules():
    t = torch.empty(2, 3, 64, 128, dtype=torch.bfloat16)
    assert hopper.aligned(t)
    assert hopper.aligned(torch.empty(2, 64, 3, 128, dtype=torch.bfloat16).transpose(1, 2))  # token-major view
    assert not hopper.aligned(t[..., 1:])  # base 2 bytes off, and a 127-wide row
    assert not hopper.aligned(torch.empty(2, 3, 64, 132, dtype=torch.bfloat16)[..., :128])  # 264-byte rows
    assert not hopper.aligned(t.transpose(-1, -2))  # d not the unit-stride dim
    assert not hopper.aligned(torch.empty(1, 3, 64, 128, dtype=torch.bfloat16).expand(2, 3, 64, 128))  # broadcast
    assert hopper.aligned(torch.empty(1, 3, 64, 128, dtype=torch.bfloat16).expand(1, 3, 64, 128))


def test_descriptors_cover_strided_views_in_place():
    """Rank-4 boxes of (1, 1, rows, d) over the tensor's own strides (a token-major view is not copied); the
    box layout is built once per (rows, d, dtype)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    t = torch.empty(2, 256, 3, 128, dtype=torch.bfloat16).transpose(1, 2)
    desc = hopper.descriptor(t, 64)
    assert list(desc.block_shape) == [1, 1, 64, 128] and tuple(desc.strides) == t.stride()
    assert list(desc.shape) == list(t.shape) and desc.base is t
    assert hopper.descriptor(t, 64).layout is desc.layout
    assert hopper.descriptor(t.to(torch.float16), 64).layout is not desc.layout


def test_forward_dispatches_to_the_hopper_kernel_only_where_usable(monkeypatch):
    """flash_triton._forward hands usable eager problems to the Gluon kernel (nothing else launched) and the
    rest, and every traced launch through inductor's wrapper, to the portable one."""
    calls = []
    monkeypatch.setattr(flash_triton, "_gluon_forward", lambda q, k, v, o, lse, causal, wrap: calls.append("hopper"))
    monkeypatch.setattr(flash_triton.launch, "forward", lambda *args, **kwargs: calls.append("portable"))
    monkeypatch.setattr(flash_triton, "_select", lambda *args, **kwargs: {"fwd": None})
    q = torch.empty(1, 2, 16, 128, dtype=torch.float16)
    usable = {"yes": True}
    monkeypatch.setattr(hopper, "usable", lambda q, k, v: usable["yes"])
    o, lse = flash_triton._forward(q, q, q, True)
    assert calls == ["hopper"] and o.shape == q.shape and lse.shape == (1, 2, 16) and lse.dtype == torch.float32
    flash_triton._forward(q, q, q, True, wrap=torch.library.wrap_triton, tma=0)  # inductor's launch: portable
    usable["yes"] = False
    flash_triton._forward(q, q, q, True)
    assert calls == ["hopper", "portable", "portable"]


def test_backward_dispatches_each_kernel_to_the_hopper_one_only_where_usable(monkeypatch):
    """dQ (which also computes delta) runs first, then dK/dV; each goes to its Gluon kernel where that one is
    usable, and never through inductor's wrapper."""
    calls = []
    monkeypatch.setattr(flash_triton.launch, "dq", lambda *args, **kwargs: calls.append("portable dq"))
    monkeypatch.setattr(flash_triton.launch, "dkdv", lambda *args, **kwargs: calls.append("portable dkdv"))
    monkeypatch.setattr(dq_hopper, "dq", lambda *args: calls.append("hopper dq"))
    monkeypatch.setattr(dkdv_hopper, "dkdv", lambda *args: calls.append("hopper dkdv"))
    monkeypatch.setattr(flash_triton, "_select", lambda *args, **kwargs: {"dq": None, "dkdv": None})
    usable = {"dq": True, "dkdv": True}
    causal_seen = []

    def dq_usable(q, k, v, o, do, causal):
        causal_seen.append(causal)
        return usable["dq"]

    monkeypatch.setattr(dq_hopper, "usable", dq_usable)
    monkeypatch.setattr(dkdv_hopper, "usable", lambda q, k, v, do: usable["dkdv"])
    q = torch.empty(1, 2, 16, 64, dtype=torch.float16)
    lse = torch.empty(1, 2, 16)
    flash_triton._backward(q, q, q, q, lse, q, True)
    assert calls == ["hopper dq", "hopper dkdv"]
    flash_triton._backward(q, q, q, q, lse, q, True, wrap=torch.library.wrap_triton, tma=0)
    assert calls[2:] == ["portable dq", "portable dkdv"]
    usable["dq"] = False
    flash_triton._backward(q, q, q, q, lse, q, True)
    usable["dq"], usable["dkdv"] = True, False
    flash_triton._backward(q, q, q, q, lse, q, True)
    assert calls[4:] == ["portable dq", "hopper dkdv", "hopper dq", "portable dkdv"]
    flash_triton._backward(q, q, q, q, lse, q, False)  # the dQ rule depends on the mask: it is passed on
    assert causal_seen[-1] is False and causal_seen[:-1] and all(causal_seen[:-1])
    # the fused backward, where usable, replaces both kernels (eager launches only), with a float32 dQ
    # accumulator shaped like q
    accumulators = []
    monkeypatch.setattr(fused_hopper, "usable", lambda q, k, v, o, do, causal: causal)
    monkeypatch.setattr(fused_hopper, "backward",
                        lambda *args: calls.append("fused") or accumulators.append(args[7]))
    del calls[:]
    flash_triton._backward(q, q, q, q, lse, q, True)
    flash_triton._backward(q, q, q, q, lse, q, True, wrap=torch.library.wrap_triton, tma=0)
    flash_triton._backward(q, q, q, q, lse, q, False)  # the rule depends on the mask: it is passed on
    assert calls == ["fused", "portable dq", "portable dkdv", "hopper dq", "portable dkdv"]
    assert accumulators[0].dtype == torch.float32 and accumulators[0].shape == q.shape


def test_dq_kernel_shares_the_backward_switch_and_its_default_head_dims(hopper_machine, monkeypatch):
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    assert dq_hopper.ENV == dkdv_hopper.ENV
    assert dq_hopper.wanted(256, torch.bfloat16, CUDA) and dq_hopper.wanted(256, torch.float16, CUDA)
    assert dq_hopper.wanted(80, torch.bfloat16, CUDA) and dq_hopper.wanted(96, torch.float16, CUDA)
    assert not dq_hopper.wanted(64, torch.bfloat16, CUDA, causal=False)
    assert not dq_hopper.wanted(256, torch.float32, CUDA)

    def qkv(hq, hkv, n, d=256):
        q = torch.empty(1, hq, n, d, dtype=torch.bfloat16)
        k = torch.empty(1, hkv, n, d, dtype=torch.bfloat16)
        return q, k, k, q, q

    monkeypatch.setattr(dq_hopper, "wanted", lambda *args: True)
    assert dq_hopper.usable(*qkv(1, 1, 2048)) and dq_hopper.usable(*qkv(8, 2, 4096))
    assert not dq_hopper.usable(*qkv(4, 4, 1024))  # shorter than measured
    q80 = torch.empty(4, 32, 512, 80, dtype=torch.bfloat16)  # the 2.7B model's attention: from 512 queries
    assert dq_hopper.usable(q80, q80, q80, q80, q80)
    assert not dq_hopper.usable(*(q80[:, :, :511],) * 5)
    long80 = torch.empty(1, 1, 32768, 80, dtype=torch.bfloat16)  # beyond SLICED_MAX_QUERIES: not measured
    assert dq_hopper.usable(*(long80[:, :, :16384],) * 5) and not dq_hopper.usable(*(long80,) * 5)
    monkeypatch.setattr(hopper, "SLICED_HEAD_DIMS", ())  # whole 128-wide tiles: slower, never by default
    assert not dq_hopper.usable(*(long80[:, :, :4096],) * 5)
    broadcast = torch.empty(1, 1, 4096, 256, dtype=torch.bfloat16).expand(1, 4, 4096, 256)
    assert not dq_hopper.usable(broadcast, broadcast, broadcast, broadcast, broadcast)
    monkeypatch.setenv(dq_hopper.ENV, "1")
    assert dq_hopper.usable(*qkv(1, 1, 16))


def test_dq_kernel_takes_d128_without_the_causal_mask(hopper_machine, monkeypatch):
    """Not causal at d 128 (NONCAUSAL_HEAD_DIMS) the Gluon dQ is the default from
    NONCAUSAL_MIN_QUERIES queries, and not at d 64; ENV "0" still wins."""
    assert dq_hopper.wanted(128, torch.bfloat16, CUDA, causal=False)
    assert not dq_hopper.wanted(64, torch.bfloat16, CUDA, causal=False)
    assert not dq_hopper.wanted(128, torch.float32, CUDA, causal=False)

    monkeypatch.setattr(hopper, "supported_here", lambda dtype, device: dtype is torch.bfloat16)  # CPU tensors

    def qkv(n, d=128, hq=8, hkv=2):
        q = torch.empty(2, hq, n, d, dtype=torch.bfloat16)
        k = torch.empty(2, hkv, n, d, dtype=torch.bfloat16)
        return q, k, k, q, q

    low = dq_hopper.NONCAUSAL_MIN_QUERIES
    assert dq_hopper.usable(*qkv(low), causal=False) and dq_hopper.usable(*qkv(4 * low), causal=False)
    assert not dq_hopper.usable(*qkv(low - 1), causal=False)
    assert not dq_hopper.usable(*qkv(4 * low, d=64), causal=False)
    assert dq_hopper.fits(2, 8, 2, low, low, 128, torch.bfloat16, CUDA, False)
    assert not dq_hopper.fits(2, 8, 2, low, low, 128, torch.bfloat16, CUDA)  # causal by default: its own rule
    monkeypatch.setenv(dq_hopper.ENV, "0")
    assert not dq_hopper.usable(*qkv(4 * low), causal=False)


def test_dq_kernel_takes_causal_d64_and_d128_in_the_measured_range(hopper_machine, monkeypatch):
    """Causal at d 64 and 128 the Gluon dQ is the default from CAUSAL_MIN_QUERIES to CAUSAL_MAX_QUERIES queries
    (4096 at d 64, 8192 at d 128) with at least CAUSAL_MIN_PROGRAMS_PER_SM 64-row programs per SM (two at d 64,
    one at d 128); grouped K/V heads count their query heads; ENV "0" still wins."""
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(hopper, "supported_here", lambda dtype, device: True)
    assert dq_hopper.wanted(64, torch.bfloat16, CUDA) and dq_hopper.wanted(128, torch.bfloat16, CUDA)
    assert dq_hopper.CAUSAL_MIN_QUERIES == 2048 and dq_hopper.CAUSAL_MAX_QUERIES == {64: 4096, 128: 8192}

    def fits(z, h, n, d, hkv=None):
        return dq_hopper.fits(z, h, hkv or h, n, n, d, torch.bfloat16, CUDA, True)

    assert fits(1, 16, 2048, 128) and fits(1, 16, 8192, 128) and fits(1, 32, 4096, 128, hkv=8)
    assert not fits(1, 16, 2047, 128) and not fits(1, 16, 8193, 128) and not fits(1, 8, 16384, 128)
    assert fits(1, 5, 2048, 128) and not fits(1, 4, 2048, 128)  # 160 and 128 programs, 132 SMs
    assert fits(1, 16, 2048, 64) and fits(4, 16, 4096, 64) and fits(1, 8, 4096, 64)
    assert not fits(1, 16, 4160, 64) and not fits(1, 16, 16384, 64)  # the leaderboard keeps the portable dQ
    assert not fits(1, 8, 2048, 64) and fits(1, 9, 2048, 64)  # 256 and 288 programs: two per SM
    assert not fits(4, 25, 512, 64)  # the xl model's calls
    q = torch.empty(1, 16, 2048, 64, dtype=torch.bfloat16)
    assert dq_hopper.usable(q, q, q, q, q) and not dq_hopper.usable(q, q, q, q, q, False)
    monkeypatch.setenv(dq_hopper.ENV, "0")
    assert not fits(1, 16, 2048, 128)


def test_traced_calls_take_the_custom_ops_wherever_a_gluon_kernel_would_run(monkeypatch):
    """inductor cannot launch a Gluon kernel, so a traced call whose sizes a Gluon kernel `fits` keeps the
    custom ops (which run it), whatever the portable configuration wants; otherwise the rule is unchanged."""
    monkeypatch.setattr(flash_triton, "KERNELS_INTERPRETED", False)
    monkeypatch.setattr(flash_triton, "_configured_tma", lambda *args: False)  # the portable tiles: pointers
    chosen = {"fwd": False, "dq": False, "dkdv": False, "fused": False}
    dq_causal = []

    def dq_fits(*sizes):
        dq_causal.append(sizes[8])  # (z, heads, kv_heads, n_q, n_k, d, dtype, device, causal)
        return chosen["dq"]

    monkeypatch.setattr(hopper, "fits", lambda *sizes: chosen["fwd"])
    monkeypatch.setattr(dq_hopper, "fits", dq_fits)
    monkeypatch.setattr(dkdv_hopper, "fits", lambda *sizes: chosen["dkdv"])
    monkeypatch.setattr(fused_hopper, "fits", lambda *sizes: chosen["fused"])
    q = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16)
    assert flash_triton._inductor_path(q, q, q, True)
    for which in chosen:
        chosen.update({key: key == which for key in chosen})
        assert not flash_triton._inductor_path(q, q, q, True), which
    broadcast = torch.empty(1, 1, 4096, 128, dtype=torch.bfloat16).expand(1, 8, 4096, 128)
    assert flash_triton._inductor_path(q, broadcast, broadcast, True)  # no Gluon kernel takes these
    chosen.update(fwd=False, dq=False, dkdv=False, fused=False)
    flash_triton._inductor_path(q, q, q, False)
    assert dq_causal[-1] is False and set(dq_causal[:-1]) == {True}  # the mask reaches the dQ rule


def test_fits_is_usable_from_sizes_alone(hopper_machine, monkeypatch):
    """Each module's `usable` is its per-tensor layout rules and `fits` of the tensors' sizes."""
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)
    monkeypatch.setattr(hopper.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(hopper, "supported_here", lambda dtype, device: True)
    seen = set()
    for z, h, hkv, n, d in [(1, 8, 8, 16384, 128), (1, 1, 1, 16384, 128), (2, 4, 4, 2048, 256), (4, 25, 25, 512, 64),
                            (1, 8, 2, 32768, 256), (1, 16, 16, 16384, 64), (4, 32, 32, 512, 80), (1, 8, 8, 256, 96)]:
        q = torch.empty(z, h, n, d, dtype=torch.bfloat16)
        k = torch.empty(z, hkv, n, d, dtype=torch.bfloat16)
        sizes = (z, h, hkv, n, n, d, q.dtype, q.device)
        for name, usable, fits in [("fwd", hopper.usable(q, k, k), hopper.fits(*sizes)),
                                   ("dq", dq_hopper.usable(q, k, k, q, q), dq_hopper.fits(*sizes)),
                                   ("dq not causal", dq_hopper.usable(q, k, k, q, q, False),
                                    dq_hopper.fits(*sizes, False)),
                                   ("dkdv", dkdv_hopper.usable(q, k, k, q), dkdv_hopper.fits(*sizes)),
                                   ("fused", fused_hopper.usable(q, k, k, q, q), fused_hopper.fits(*sizes)),
                                   ("fused not causal", fused_hopper.usable(q, k, k, q, q, False),
                                    fused_hopper.fits(*sizes, False))]:
            assert usable == fits, (name, z, h, hkv, n, d)
            seen.add((name, fits))
    assert len(seen) == 12  # each kernel both taken and not taken among these sizes


# --- sm_90 GPU only ----------------------------------------------------------------------------------------

ON_HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
         and hopper.triton.__version__.startswith(hopper.TRITON_VERSIONS)),
    reason=f"the Gluon forward runs on compute capability 9.x with Triton {hopper.TRITON_VERSIONS}")


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
    split_dv=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
# Fixed edge cases: causal key blocks that see no query (dK, dV must be zeros), one key, grouped heads at
# ragged lengths.
@example(heads=(3, 3), nq=17, nk=2048, d=128, is_causal=True, dtype=torch.bfloat16, token_major=False,
         split_dv=False, seed=1)
@example(heads=(3, 3), nq=2048, nk=1, d=64, is_causal=True, dtype=torch.float16, token_major=True, split_dv=False,
         seed=2)
@example(heads=(8, 2), nq=1000, nk=1025, d=128, is_causal=False, dtype=torch.bfloat16, token_major=True,
         split_dv=False, seed=3)
@example(heads=(4, 1), nq=255, nk=1025, d=256, is_causal=True, dtype=torch.bfloat16, token_major=True,
         split_dv=False, seed=4)
@example(heads=(8, 2), nq=1000, nk=257, d=256, is_causal=False, dtype=torch.float16, token_major=True,
         split_dv=True, seed=5)
def test_gpu_hopper_kernels_match_float64_reference(heads, nq, nk, d, is_causal, dtype, token_major, split_dv,
                                                    seed):
    """O, the saved L, dQ, dK, dV against float64 with the Gluon forward, dQ and dK/dV in the path (the dQ
    kernel reads the forward's L, the dK/dV kernel the dQ kernel's delta): ragged ends, Nq != Nk, one query or
    one key, grouped K/V heads, token-major views; all three Gluon kernels must have run.  split_dv: d 256's
    dK/dV as two launches (the dV part with its own tiles, the dK part with its long-row tiles) whatever
    the size, as from 8192 and 32768 queries (the latter for odd seeds, which also take dQ's long-row tiles)."""
    q, k, v = _grouped_qkv(heads, nq, nk, d, dtype, token_major, seed)
    ran = []
    real_fwd, real_dq, real_dkdv = flash_triton._gluon_forward, dq_hopper.dq, dkdv_hopper.dkdv
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hopper.ENV, "1")
        patch.setenv(dkdv_hopper.ENV, "1")
        patch.setenv(fused_hopper.ENV, "0")  # the two-kernel backward (the fused one has a test of its own)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        if split_dv:  # the two-launch plan; odd seeds with the dK part's long-row tiles
            patch.setattr(dkdv_hopper, "SPLIT_MIN_QUERIES", 0)
            patch.setattr(dkdv_hopper, "LONG_QUERIES", 0 if seed % 2 else 1 << 30)
            patch.setattr(dq_hopper, "LONG_QUERIES", 0 if seed % 2 else 1 << 30)  # and dQ's long-row tiles
            patch.setattr(hopper, "enough_work", lambda *args: True)
        patch.setattr(flash_triton, "_gluon_forward", lambda *args: ran.append("fwd") or real_fwd(*args))
        patch.setattr(dq_hopper, "dq", lambda *args: ran.append("dq") or real_dq(*args))
        patch.setattr(dkdv_hopper, "dkdv", lambda *args: ran.append("dkdv") or real_dkdv(*args))
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
    (16, 4096, 64, True, ["fused"]),  # d 64 from the fused backward's MIN_QUERIES
])
def test_gpu_compiled_calls_run_the_gluon_kernels_an_eager_call_runs(heads, n, d, is_causal, expected):
    """torch.compile(fullgraph=True) at sizes the Gluon kernels take: the traced call keeps the custom ops,
    which run the same Gluon kernels as the eager call, with the same results."""
    q, k, v = random_qkv((1, heads), n, n, d, torch.bfloat16, "cuda", 7)
    ran = []
    real = {"fwd": flash_triton._gluon_forward, "dq": dq_hopper.dq, "dkdv": dkdv_hopper.dkdv,
            "fused": fused_hopper.backward}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(hopper.ENV, raising=False)  # the default rules
        patch.delenv(dkdv_hopper.ENV, raising=False)
        patch.delenv(fused_hopper.ENV, raising=False)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        patch.setattr(flash_triton, "_gluon_forward", lambda *args: ran.append("fwd") or real["fwd"](*args))
        patch.setattr(dq_hopper, "dq", lambda *args: ran.append("dq") or real["dq"](*args))
        patch.setattr(dkdv_hopper, "dkdv", lambda *args: ran.append("dkdv") or real["dkdv"](*args))
        patch.setattr(fused_hopper, "backward", lambda *args: ran.append("fused") or real["fused"](*args))
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
    o, lse = flash_triton._forward(q, k, v, is_causal, tma=0)  # portable forward
    stages, results = [], []
    real = dq_hopper.tiles
    monkeypatch.setattr(dq_hopper, "tiles", lambda *args: stages.append(real(*args)[2]) or real(*args))
    for threshold in (0, 1 << 30):
        monkeypatch.setattr(dq_hopper, "TWO_STAGE_PROGRAMS", {True: threshold, False: threshold})
        delta, dq = torch.empty_like(lse), torch.empty_like(q)
        dq_hopper.dq(q, k, v, o, do, lse, delta, dq, is_causal)
        results.append((dq, delta))
    assert stages == [2, 3]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.isfinite(results[0][0]).all() and results[0][0].abs().max() > 0


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("is_causal", [True, False])
def test_gpu_d256_dkdv_launch_plans_agree_bit_for_bit(is_causal):
    """At d 256 the dV and dK parts run in two launches from 8192 queries (the dV part with its own tiles) and
    in one launch below; both plans, and the portable kernel, do the same arithmetic per output."""
    g = torch.Generator("cuda").manual_seed(11)
    q, k, v, do = (torch.randn(1, 2, 8192, 256, generator=g, device="cuda").bfloat16() for _ in range(4))
    o, lse = flash_triton._forward(q, k, v, is_causal, tma=0)  # portable forward
    delta, dq = torch.empty_like(lse), torch.empty_like(q)
    cfg = flash_triton._select(q, k, is_causal)
    flash_launch.dq(q, k, v, do, lse, delta, dq, is_causal, cfg["dq"], o=o)
    results = []
    for plan in ("two launches", "one launch", "portable"):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        if plan == "two launches":
            assert q.shape[-2] >= dkdv_hopper.SPLIT_MIN_QUERIES
            dkdv_hopper.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal)
        elif plan == "one launch":
            dkdv_hopper._launch(q, k, v, do, lse, delta, dk, dv, is_causal, dkdv_hopper.tiles(256), 3)
        else:
            flash_launch.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal, cfg["dkdv"])
        results.append((dk, dv))
    for dk, dv in results[1:]:
        assert torch.equal(dk, results[0][0]) and torch.equal(dv, results[0][1])
    assert torch.isfinite(results[0][0]).all() and results[0][0].abs().max() > 0


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
    assert ws_hopper.takes(d)
    if token_major:
        q = token_major_view(z, heads[0], nq, d, torch.bfloat16, nq)
        k, v = (token_major_view(z, heads[1], nk, d, torch.bfloat16, nk + i) for i in (1, 2))
    else:
        q = random_qkv((z, heads[0]), nq, nk, d, torch.bfloat16, "cuda", nq)[0]
        _, k, v = random_qkv((z, heads[1]), nq, nk, d, torch.bfloat16, "cuda", nk)
    q, k, v = (t.detach() for t in (q, k, v))
    results = []
    for run in (ws_hopper.forward, hopper.forward):
        o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        run(q, k, v, o, lse, is_causal)
        results.append((o, lse))
    for name, a, b in zip(("o", "lse"), *results):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


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
    assert hopper.d_split(d) == d - 64
    g = torch.Generator("cuda").manual_seed(nq + d)
    q, do = (torch.randn(z, nq, heads[0], d, generator=g, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(z, nk, heads[1], d, generator=g, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    results = []
    for sliced in (hopper.SLICED_HEAD_DIMS, ()):
        monkeypatch.setattr(hopper, "SLICED_HEAD_DIMS", sliced)
        o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        hopper.forward(q, k, v, o, lse, is_causal)
        dq, delta = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        dq_hopper.dq(q, k, v, o, do, lse, delta, dq, is_causal)
        dkdv_hopper.dkdv(q, k, v, do, lse, delta, dk, dv, is_causal)
        results.append((o, lse, delta, dq, dk, dv))
    for name, a, b in zip(("o", "lse", "delta", "dq", "dk", "dv"), *results):
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
    real = {"fwd": flash_triton._gluon_forward, "dq": dq_hopper.dq, "dkdv": dkdv_hopper.dkdv}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(hopper.ENV, raising=False)
        patch.delenv(dkdv_hopper.ENV, raising=False)
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launchers counted below
        patch.setattr(flash_triton, "_gluon_forward", lambda *args: ran.append("fwd") or real["fwd"](*args))
        patch.setattr(dq_hopper, "dq", lambda *args: ran.append("dq") or real["dq"](*args))
        patch.setattr(dkdv_hopper, "dkdv", lambda *args: ran.append("dkdv") or real["dkdv"](*args))
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, True)
    assert ran == ["dq"], ran


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

    monkeypatch.setenv(hopper.ENV, "1")
    monkeypatch.setenv(dkdv_hopper.ENV, "1")
    monkeypatch.setenv(fused_hopper.ENV, "0")  # its replays: test_gpu_fused_backward_is_recorded_and_replayed
    q, k, v = (token_major_view(z, heads[i > 0], n, d, torch.bfloat16, i) for i in range(3))
    grad_out = torch.randn_like(q)
    table = {}
    _, replays = _assert_replays_match_the_ordinary_path(q, k, v, True, grad_out, table=table)
    assert replays == 4  # the forward's and the backward's signature, at the second and third call
    names = sorted(launch.compiled.name for plan in table.values() for launch in plan.launches)
    forward = "flash_fwd_hopper_ws_kernel" if ws_hopper.takes(d) else "flash_fwd_hopper_kernel"
    assert names == sorted(["flash_dkdv_hopper_kernel", "flash_dq_hopper_kernel", forward])


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
def test_gpu_fused_backward_matches_float64_reference(heads, nq, nk, d, is_causal, dtype, token_major, seed):
    """dQ, dK, dV of the fused backward (flash_bwd_hopper, forced on) against float64: ragged ends, Nq != Nk,
    one query or one key, key blocks that see no query, grouped K/V heads, token-major views, d 64 and 128."""
    q, k, v = _grouped_qkv(heads, nq, nk, d, dtype, token_major, seed)
    ran = []
    real = fused_hopper.backward
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused_hopper.ENV, "1")
        patch.setenv(flash_triton.REPLAY_ENV, "0")  # every call through the launcher counted below
        patch.setattr(fused_hopper, "backward", lambda *args: ran.append("fused") or real(*args))
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, is_causal)
    assert ran == ["fused"], ran


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("z, heads, n, d, is_causal", [(2, (4, 4), 1000, 64, True), (1, (8, 2), 700, 128, False)])
def test_gpu_fused_backward_is_recorded_and_replayed(monkeypatch, z, heads, n, d, is_causal):
    """The fused backward's three launches are recorded like the others, its float32 dQ accumulator taken as
    an extra slot: the next calls of the signature replay them.  dK and dV equal the ordinary call's bit for
    bit; dQ is summed by TMA reductions whose order varies from run to run, so it is compared within
    float32 rounding of the accumulator (one unit in the last place of the output dtype)."""
    monkeypatch.setenv(fused_hopper.ENV, "1")
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
    monkeypatch.setattr(flash_triton, "_recorded", table)
    ran, real = [], fused_hopper.backward
    monkeypatch.setattr(fused_hopper, "backward", lambda *args: ran.append(1) or real(*args))
    for _ in range(3):
        dq, dk, dv = call()
        assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
        torch.testing.assert_close(dq, expected[0], rtol=2 ** -7, atol=1e-3)
    plans = [plan for plan in table.values() if plan is not None and any(
        launch.compiled.name == "flash_bwd_hopper_kernel" for launch in plan.launches)]
    assert len(plans) == 1 and len(plans[0].launches) == 3
    assert len(ran) == 1  # recorded at the first call, replayed at the next two


@pytest.mark.gpu
@ON_HOPPER
@pytest.mark.parametrize("d, is_causal", [(64, False), (128, False), (64, True)])
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
    ran, real = [], fused_hopper.backward
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused_hopper.ENV, "1")
        patch.setenv(flash_triton.REPLAY_ENV, "0")
        patch.setattr(fused_hopper, "backward", lambda *args: ran.append("fused") or real(*args))
        assert_flash_accuracy(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, is_causal)
    assert ran == ["fused"], ran
