"""Tile configurations of the Triton FlashAttention kernels: every config is correct, and the choice.

On CPU the kernels run in Triton's interpreter (fp32), so the tiling logic (causal bands, ragged edges,
BLOCK_M != BLOCK_N, longest-first order) is checked for the tile shapes the tuner may pick, not only
the interpreter's fixed 32 x 32.  On the GPU, every configuration committed in `TUNED_SM90` is checked.
"""

import json
import os
import re
import socket
import stat

import pytest
import torch
from attention_reference import reference

from cs336_systems.attention.kernels.portable import autotune as flash_autotune
from cs336_systems.attention.kernels.portable import configs as flash_configs
from cs336_systems.attention.kernels.portable import launch as flash_launch
from cs336_systems.attention.kernels.portable.configs import KERNELS, ShapeKey, TileConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grads_with(cfgs: dict[str, TileConfig], q, k, v, causal, longest_first=True):
    """o, lse, dq, dk, dv from the launchers with explicit configs; q, k, v: (BH, N, d)."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    flash_launch.forward(q, k, v, o, lse, causal, cfgs["fwd"], longest_first=longest_first)
    do = torch.randn_like(o, generator=torch.Generator(q.device).manual_seed(3))
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # as the backward runs them: dQ computes delta = rowsum(o * do) for dK/dV
    flash_launch.dq(q, k, v, do, lse, delta, dq, causal, cfgs["dq"], longest_first=longest_first, o=o)
    flash_launch.dkdv(q, k, v, do, lse, delta, dk, dv, causal, cfgs["dkdv"])
    return o, lse, do, (dq, dk, dv)


def _check_against_float64(cfgs, bh, nq, nk, d, dtype, causal, longest_first=True, tol=None):
    g = torch.Generator(DEVICE).manual_seed(nq * 1000 + nk)
    q, k, v = (torch.randn(bh, n, d, generator=g, device=DEVICE).to(dtype) for n in (nq, nk, nk))
    o, lse, do, grads = _grads_with(cfgs, q, k, v, causal, longest_first)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference(q64, k64, v64, causal)
    ref_grads = torch.autograd.grad(ref_o, (q64, k64, v64), do.double())
    tol = tol or (2e-4 if dtype == torch.float32 else 3e-2)
    for name, got, ref in [("o", o, ref_o), ("lse", lse, ref_lse)] + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
        err = (got.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol} with {cfgs}, shape {(bh, nq, nk, d)}, causal={causal}"


# Tile shapes from the search space (and the asymmetric extremes) on ragged lengths, Nq != Nk included.
INTERPRETER_CASES = [
    (TileConfig(16, 64, 4, 1), TileConfig(32, 128, 4, 1), TileConfig(128, 32, 4, 1)),
    (TileConfig(64, 32, 4, 1), TileConfig(64, 64, 4, 1), TileConfig(64, 128, 4, 1)),
    (TileConfig(128, 64, 4, 1), TileConfig(16, 64, 4, 1), TileConfig(32, 64, 4, 1)),
]


# Equal lengths of two ragged tiles (200, ~0.9 s each here) are slow: test_natural_order_gives_the_same_result
# takes Nq = Nk, and the default run keeps every tile set at both unequal lengths.
@pytest.mark.parametrize("tiles", INTERPRETER_CASES, ids=lambda t: "-".join(c.short() for c in t))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq, nk", [pytest.param(200, 200, marks=pytest.mark.slow), (77, 150), (150, 77)])
def test_tile_configs_match_float64(tiles, causal, nq, nk):
    if DEVICE == "cpu" and not flash_autotune.interpreter_active():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    cfgs = dict(zip(KERNELS, tiles))
    _check_against_float64(cfgs, 2, nq, nk, 32, torch.float32, causal)


def test_natural_order_gives_the_same_result():
    if DEVICE == "cpu" and not flash_autotune.interpreter_active():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    cfgs = dict(zip(KERNELS, INTERPRETER_CASES[1]))
    _check_against_float64(cfgs, 1, 130, 130, 16, torch.float32, True, longest_first=False)


@pytest.mark.gpu
def test_gpu_every_committed_config_matches_float64(monkeypatch):
    """Each TUNED_SM90 entry, at a ragged length near its bucket (capped), its dtype and fp32 arithmetic,
    causal as keyed."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TUNED_SM90 applies to sm_90 only")
    assert flash_configs.TUNED_SM90, "no committed configurations to check"
    for text, entry in flash_configs.TUNED_SM90.items():
        key = ShapeKey.parse(text)
        cfgs = {kernel: TileConfig.parse(c) for kernel, c in entry.items()}
        n = min(key.n_bucket, 2048) - 37
        monkeypatch.setenv(flash_configs.FP32_DOT_ENV, "ieee" if key.dtype == "fp32ieee" else "tf32x3")
        dtype = torch.bfloat16 if key.dtype == "half" else torch.float32
        _check_against_float64(cfgs, 2, n, n, key.head_dim, dtype, key.causal)


def test_tile_config_text_round_trip_and_validation():
    cfg = TileConfig(128, 32, 8, 3)
    assert TileConfig.parse(cfg.short()) == cfg
    tma = TileConfig(64, 128, 4, 3, tma=True)
    assert tma.tma == 1 and tma.short() == "64x128w4s3t" and TileConfig.parse("64x128w4s3t") == tma
    band = TileConfig(64, 128, 4, 3, tma=2)
    assert band.short() == "64x128w4s3b" and TileConfig.parse("64x128w4s3b") == band != tma
    with pytest.raises(ValueError, match="TileConfig.tma must be 0, 1 or 2; got 3"):
        TileConfig(64, 64, 4, 2, tma=3)
    assert "tma" not in tma.launch_kwargs()  # the launchers turn it into descriptors, not a kernel argument
    with pytest.raises(ValueError, match=r"block_m must be a power of two >= 16 \(tl.dot.s minimum\); got 48"):
        TileConfig(48, 64, 4, 2)
    with pytest.raises(ValueError, match="num_warps .* got 3"):
        TileConfig(64, 64, 3, 2)
    with pytest.raises(ValueError, match="'64x64' is not of the form"):
        TileConfig.parse("64x64")
    two = TileConfig(32, 64, 8, 2, parts=2)
    assert two.short() == "32x64w8s2p2" and TileConfig.parse("32x64w8s2p2") == two != TileConfig(32, 64, 8, 2)
    assert TileConfig.parse("64x64w4s3tp2") == TileConfig(64, 64, 4, 3, tma=1, parts=2)
    assert "parts" not in two.launch_kwargs()  # the dK/dV launcher turns it into two launches
    with pytest.raises(ValueError, match="TileConfig.parts must be 1 or 2; got 3"):
        TileConfig(64, 64, 4, 2, parts=3)


def _two_pass_cases():
    """Every (lengths, heads, splits) with and without the mask; the default run takes one pair of lengths per
    head layout (plain heads at Nq < Nk, grouped heads in split groups at Nq > Nk), the rest (~1 s each in the
    interpreter) are slow, as .ci/run runs them."""
    for nq, nk in [(77, 150), (150, 77)]:
        for heads, kv_heads, splits in [(2, 2, 1), (4, 1, 1), (4, 1, 2)]:
            fast = (heads, nq) == (2, 77) or (splits, nq) == (2, 150)
            for causal in (True, False):
                yield pytest.param(causal, heads, kv_heads, splits, nq, nk, marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("causal, heads, kv_heads, splits, nq, nk", list(_two_pass_cases()))
def test_two_pass_dkdv_is_bit_equal_to_one_pass(causal, heads, kv_heads, splits, nq, nk):
    """parts=2 (a dV launch, then a dK launch) computes each output with the same arithmetic as parts=1:
    the same bits, grouped-query attention and split groups included, on ragged lengths."""
    if DEVICE == "cpu" and not flash_autotune.interpreter_active():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator(DEVICE).manual_seed(nq + nk + heads)
    q = torch.randn(1, heads, nq, 32, generator=g, device=DEVICE)
    k, v = (torch.randn(1, kv_heads, nk, 32, generator=g, device=DEVICE) for _ in range(2))
    one, two = TileConfig(32, 64, 4, 1), TileConfig(32, 64, 4, 1, parts=2)
    o, lse = torch.empty_like(q), torch.empty(1, heads, nq, device=DEVICE)
    flash_launch.forward(q, k, v, o, lse, causal, one)
    do = torch.randn(o.shape, generator=g, device=DEVICE)
    delta, dq = torch.empty_like(lse), torch.empty_like(q)
    flash_launch.dq(q, k, v, do, lse, delta, dq, causal, one, o=o)
    got = {}
    for cfg in (one, two):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        flash_launch.dkdv(q, k, v, do, lse, delta, dk, dv, causal, cfg, splits=splits)
        got[cfg.parts] = (dk, dv)
    for a, b in zip(got[1], got[2]):
        assert not a.isnan().any() and torch.equal(a, b)


def test_shape_key_buckets():
    key = ShapeKey.of(bh=16, n_queries=16384, n_keys=16384, head_dim=64, dtype=torch.bfloat16, causal=True)
    assert key == ShapeKey(64, "half", True, 16384, 16)
    assert ShapeKey.of(1, 1000, 3000, 128, torch.float16, False) == ShapeKey(128, "half", False, 4096, 1)
    assert ShapeKey.of(5, 10, 10, 16, torch.float32, True) == ShapeKey(16, "fp32x3", True, 128, 16)
    assert ShapeKey.of(1000, 10**6, 10, 32, torch.float32, True).n_bucket == 65536
    assert ShapeKey.of(1000, 10, 10, 32, torch.float32, True).bh_bucket == 64
    assert ShapeKey.parse(key.text()) == key
    ieee = ShapeKey(16, "fp32ieee", True, 128, 16)
    assert ShapeKey.parse(ieee.text()) == ieee and ieee.text() == "d16-fp32ieee-causal-n128-bh16"
    with pytest.raises(ValueError, match="shape key 'd64-half' is not of the form"):
        ShapeKey.parse("d64-half")
    with pytest.raises(ValueError, match="got dtype torch.int32"):
        ShapeKey.of(1, 8, 8, 16, torch.int32, True)


def test_shape_key_is_the_register_width(monkeypatch):
    """Split head dims get their own keys (the autotune cache must not mix their configurations with the padded
    tile's) when every kernel is opted in; float32 and the default (padded, or a forward alone split at a head
    dim of `FORWARD_SPLIT_HEAD_DIMS`, in fewer columns than the padded tile its configuration was chosen for)
    share the padded tile's key."""
    monkeypatch.setenv("CS336_FLASH_SPLIT_D", "1")
    assert ShapeKey.of(1, 4096, 4096, 80, torch.bfloat16, True).head_dim == 80
    assert ShapeKey.of(1, 4096, 4096, 96, torch.float16, True).head_dim == 96
    assert ShapeKey.of(1, 4096, 4096, 112, torch.bfloat16, True).head_dim == 128  # no split: 64 + 64 saves nothing
    assert ShapeKey.of(1, 4096, 4096, 80, torch.float32, True).head_dim == 128
    assert ShapeKey.of(1, 4096, 4096, 192, torch.bfloat16, True).head_dim == 192
    monkeypatch.setenv("CS336_FLASH_SPLIT_D", "0")
    assert ShapeKey.of(1, 4096, 4096, 80, torch.bfloat16, True).head_dim == 128
    monkeypatch.delenv("CS336_FLASH_SPLIT_D")
    assert ShapeKey.of(1, 4096, 4096, 80, torch.bfloat16, True).head_dim == 128


def test_split_widths_take_the_padded_widths_tuned_entries(monkeypatch):
    """The committed H100 table has no entries for split widths: d = 80 takes d = 128's, 192 takes 256's."""
    monkeypatch.setenv("CS336_FLASH_SPLIT_D", "1")
    for d, padded in ((80, 128), (96, 128), (192, 256)):
        for bh, n in ((1, 16384), (16, 8192), (1, 65536)):
            key = ShapeKey.of(bh, n, n, d, torch.bfloat16, True)
            assert key.head_dim == d
            assert flash_configs.nearest_tuned(key, flash_configs._tuned_sm90()) is None
            chosen = flash_configs.tuned_sm90(key)
            assert chosen is not None
            assert chosen == flash_configs.tuned_sm90(ShapeKey.of(bh, n, n, padded, torch.bfloat16, True))
    monkeypatch.delenv("CS336_FLASH_SPLIT_D")  # by default d = 80 is keyed as the padded tile
    assert ShapeKey.of(1, 4096, 4096, 80, torch.bfloat16, True) == ShapeKey.of(1, 4096, 4096, 128, torch.bfloat16, True)


@pytest.mark.parametrize("dtype, fp32_dot", [(torch.bfloat16, ""), (torch.float32, "tf32x3"), (torch.float32, "ieee")])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("n", [128, 1024, 65536])
def test_candidates_are_pruned_but_never_empty(dtype, fp32_dot, d, n, monkeypatch):
    monkeypatch.setenv(flash_configs.FP32_DOT_ENV, fp32_dot)
    key = ShapeKey.of(1, n, n, d, dtype, True)
    assert key.dtype == {"": "half", "tf32x3": "fp32x3", "ieee": "fp32ieee"}[fp32_dot]
    element = 4 if dtype == torch.float32 else 2
    for kernel in KERNELS:
        cands = flash_configs.candidates(kernel, key)
        assert cands, f"no candidates for {kernel} at {key.text()}"
        assert len(cands) <= 10  # tuning one shape must stay well under a minute
        for cfg in cands:
            assert max(cfg.block_m, cfg.block_n) <= max(n, 64)
            assert flash_configs._shared_bytes(kernel, cfg.block_m, cfg.block_n, d, element, cfg.num_stages) <= 200 * 1024
        assert set(cands) <= set(flash_configs.SEARCH_SPACE[(kernel, key.dtype)])
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_configs.candidates("bwd", key)


def test_fp32_arithmetic_is_tf32x3_unless_ieee_is_asked_for(monkeypatch):
    monkeypatch.delenv(flash_configs.FP32_DOT_ENV, raising=False)
    assert flash_configs.fp32_dot() == "tf32x3" and flash_launch.precision(torch.float32) == "tf32x3"
    assert flash_configs.dtype_class(torch.float32) == "fp32x3"
    assert flash_launch.precision(torch.bfloat16) == "tf32"  # ignored by tl.dot for 16-bit operands
    monkeypatch.setenv(flash_configs.FP32_DOT_ENV, "ieee")
    assert flash_launch.precision(torch.float32) == "ieee" and flash_configs.dtype_class(torch.float32) == "fp32ieee"
    assert flash_configs.dtype_class(torch.bfloat16) == "half"
    monkeypatch.setenv(flash_configs.FP32_DOT_ENV, "tf32")  # plain TF32 would lose fp32 accuracy: refused
    with pytest.raises(ValueError, match=r"CS336_FLASH_FP32_DOT must be one of tf32x3, ieee \(or unset\), got 'tf32'"):
        flash_launch.precision(torch.float32)


@pytest.mark.parametrize("dtype_class", flash_configs.DTYPE_CLASSES)
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_default_configs_fit_sm80_shared_memory(dtype_class, d):
    element = 2 if dtype_class == "half" else 4
    for n in (128, 4096, 65536):
        for kernel, cfg in flash_configs.default_config(ShapeKey(d, dtype_class, True, n, 1)).items():
            assert flash_configs._shared_bytes(kernel, cfg.block_m, cfg.block_n, d, element, cfg.num_stages) <= 160 * 1024


def test_nearest_tuned_prefers_sequence_length_then_parallelism():
    def entry(tag):
        return {kernel: TileConfig(tag, 64, 4, 2) for kernel in KERNELS}

    table = {
        ShapeKey(64, "half", True, 16384, 16): entry(128),
        ShapeKey(64, "half", True, 4096, 1): entry(64),
        ShapeKey(64, "half", True, 1024, 16): entry(32),
        ShapeKey(128, "half", True, 65536, 1): entry(16),
    }
    assert flash_configs.nearest_tuned(ShapeKey(64, "half", True, 8192, 16), table) is not None
    assert flash_configs.nearest_tuned(ShapeKey(64, "half", True, 16384, 1), table)["fwd"].block_m == 128
    assert flash_configs.nearest_tuned(ShapeKey(64, "half", True, 4096, 4), table)["fwd"].block_m == 64
    assert flash_configs.nearest_tuned(ShapeKey(64, "half", True, 512, 1), table)["fwd"].block_m == 32
    assert flash_configs.nearest_tuned(ShapeKey(128, "half", True, 128, 64), table)["fwd"].block_m == 16
    assert flash_configs.nearest_tuned(ShapeKey(32, "half", True, 4096, 1), table) is None
    assert flash_configs.nearest_tuned(ShapeKey(64, "fp32x3", True, 4096, 1), table) is None


def test_committed_table_parses_and_covers_the_sweep():
    table = flash_configs._tuned_sm90()
    for key, cfgs in table.items():
        assert set(cfgs) == set(KERNELS), key
        for kernel, cfg in cfgs.items():
            assert cfg in flash_configs.search_space(kernel, key) or cfg in flash_configs.default_config(key).values()
    for d in (64, 128):
        if table:
            for causal in (True, False):  # entries of their own with and without the mask
                key = ShapeKey(d, "half", causal, 16384, 1)
                assert flash_configs.nearest_tuned(key, table) is not None, key
                assert table.get(key) is not None, key


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    path = tmp_path / "flash-autotune.json"
    monkeypatch.setenv(flash_autotune.CACHE_ENV, str(path))
    flash_autotune.clear_memo()
    yield path
    flash_autotune.clear_memo()


def test_select_order_cache_then_table_then_default(tmp_cache, monkeypatch):
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    cpu = torch.device("cpu")
    key = ShapeKey.of(2, 300, 300, 64, torch.float16, True)
    # No cache, no table for CPU: the default heuristic.
    assert flash_autotune.select(2, 300, 300, 64, torch.float16, True, cpu) == flash_configs.default_config(key)
    # A cache entry for this device wins, once the memo is cleared.
    entry = {"fwd": "64x32w4s4", "dkdv": "16x64w4s4", "dq": "32x64w4s3"}
    tmp_cache.write_text(json.dumps({flash_autotune.device_id(cpu): {key.text(): entry}}))
    assert flash_autotune.select(2, 300, 300, 64, torch.float16, True, cpu)["fwd"] == flash_configs.default_config(key)["fwd"]
    flash_autotune.clear_memo()
    chosen = flash_autotune.select(2, 300, 300, 64, torch.float16, True, cpu)
    assert {k: c.short() for k, c in chosen.items()} == entry
    # An incomplete entry is ignored.
    tmp_cache.write_text(json.dumps({flash_autotune.device_id(cpu): {key.text(): {"fwd": "64x32w4s4"}}}))
    flash_autotune.clear_memo()
    assert flash_autotune.select(2, 300, 300, 64, torch.float16, True, cpu) == flash_configs.default_config(key)


def test_float32_never_reads_cache_entries_tuned_for_the_other_arithmetic(tmp_cache, monkeypatch):
    """An IEEE-tuned tile can run out of shared memory with tf32x3 dots: the caches stay apart, and entries
    from before the split (class "fp32", tuned with IEEE dots) are not read at all."""
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    monkeypatch.delenv(flash_configs.FP32_DOT_ENV, raising=False)
    cpu = torch.device("cpu")
    entry = {"fwd": "64x64w4s2", "dkdv": "64x64w4s2", "dq": "64x64w4s2"}
    stale = {f"d128-{cls}-causal-n1024-bh1": entry for cls in ("fp32", "fp32ieee")}
    tmp_cache.write_text(json.dumps({flash_autotune.device_id(cpu): stale}))
    key = ShapeKey.of(1, 1000, 1000, 128, torch.float32, True)
    assert key.dtype == "fp32x3"
    assert flash_autotune.select(1, 1000, 1000, 128, torch.float32, True, cpu) == flash_configs.default_config(key)
    monkeypatch.setenv(flash_configs.FP32_DOT_ENV, "ieee")  # the fp32ieee entry is for this arithmetic
    chosen = flash_autotune.select(1, 1000, 1000, 128, torch.float32, True, cpu)
    assert {k: c.short() for k, c in chosen.items()} == entry


def test_unreadable_cache_is_reported_and_ignored(tmp_cache, monkeypatch, capsys):
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    tmp_cache.write_text("{not json")
    key = ShapeKey.of(1, 64, 64, 16, torch.float32, False)
    assert flash_autotune.select(1, 64, 64, 16, torch.float32, False, torch.device("cpu")) == flash_configs.default_config(key)
    assert "ignoring unreadable cache" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "ignoring unreadable cache"),  # valid JSON, wrong structure
    ('{"DEVICE": "oops"}', "ignoring unreadable cache"),
    ('{"DEVICE": {"KEY": {"fwd": "64x32", "dkdv": "16x64w4s4", "dq": "32x64w4s3"}}}', "ignoring cache entry"),
    ('{"DEVICE": {"KEY": {"fwd": "48x32w4s4", "dkdv": "16x64w4s4", "dq": "32x64w4s3"}}}', "ignoring cache entry"),
    ('{"DEVICE": {"KEY": {"fwd": 7, "dkdv": "16x64w4s4", "dq": "32x64w4s3"}}}', "ignoring cache entry"),
])
def test_malformed_cache_falls_back_instead_of_failing_the_call(tmp_cache, monkeypatch, capsys, content, message):
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    cpu = torch.device("cpu")
    key = ShapeKey.of(1, 64, 64, 16, torch.float32, False)
    tmp_cache.write_text(content.replace("DEVICE", flash_autotune.device_id(cpu)).replace("KEY", key.text()))
    assert flash_autotune.select(1, 64, 64, 16, torch.float32, False, cpu) == flash_configs.default_config(key)
    assert message in capsys.readouterr().err


def test_storing_keeps_entries_another_process_saved_meanwhile(tmp_cache):
    cpu = torch.device("cpu")
    mine, theirs = ShapeKey.of(1, 64, 64, 16, torch.float32, False), ShapeKey.of(1, 4096, 4096, 64, torch.float16, True)
    assert flash_autotune.cached(mine, cpu) is None  # this process has loaded the (empty) cache
    entry = {"fwd": "64x32w4s4", "dkdv": "16x64w4s4", "dq": "32x64w4s3"}
    tmp_cache.write_text(json.dumps({flash_autotune.device_id(cpu): {theirs.text(): entry}}))  # another tuner
    flash_autotune._store_cache(cpu, mine, {k: TileConfig.parse(c) for k, c in entry.items()})
    saved = json.loads(tmp_cache.read_text())[flash_autotune.device_id(cpu)]
    assert set(saved) == {mine.text(), theirs.text()}
    assert flash_autotune.cached(theirs, cpu) is not None  # the memo follows the merged file


_ENTRY = {"fwd": "64x32w4s4", "dkdv": "16x64w4s4", "dq": "32x64w4s3"}


def _store(key: ShapeKey) -> None:
    flash_autotune._store_cache(torch.device("cpu"), key, {k: TileConfig.parse(c) for k, c in _ENTRY.items()})


def _a_readable_cache() -> str:
    key = ShapeKey.of(1, 4096, 4096, 64, torch.float16, True)
    return json.dumps({flash_autotune.device_id(torch.device("cpu")): {key.text(): _ENTRY}}, indent=1)


@pytest.mark.parametrize("content", [
    # CS336_FLASH_CACHE pointed at another JSON file: a saved benchmark run, a dict of dicts, a list
    json.dumps({"machine_info": {"node": "gpu-7"}, "benchmarks": [{"name": "test_x"}]}, indent=1) * 40,
    json.dumps({"name": {"version": "1.0", "deps": {"torch": "2.11"}}}),
    "[1, 2, 3]",
    # a readable cache with one bad byte
    _a_readable_cache().replace(":", ";", 1),
    _a_readable_cache().encode()[:40] + b"\xff" + _a_readable_cache().encode()[41:],  # not even UTF-8
])
def test_storing_never_overwrites_a_file_that_is_not_a_readable_cache(tmp_cache, content):
    if isinstance(content, bytes):
        tmp_cache.write_bytes(content)
    else:
        tmp_cache.write_text(content)
    before = tmp_cache.read_bytes()
    mine = ShapeKey.of(1, 64, 64, 16, torch.float32, False)
    with pytest.warns(RuntimeWarning, match=r"not a readable autotune cache.*left untouched.*\.new"):
        _store(mine)
    assert tmp_cache.read_bytes() == before  # byte for byte
    beside = tmp_cache.with_name(tmp_cache.name + ".new")
    saved = json.loads(beside.read_text())
    assert saved == {flash_autotune.device_id(torch.device("cpu")): {mine.text(): _ENTRY}}
    assert flash_autotune.cached(mine, torch.device("cpu")) is not None  # this process keeps its entry
    # the next tune merges into the file beside it, still leaving the original alone
    other = ShapeKey.of(1, 4096, 4096, 64, torch.float16, True)
    with pytest.warns(RuntimeWarning):
        _store(other)
    assert tmp_cache.read_bytes() == before
    assert set(json.loads(beside.read_text())[flash_autotune.device_id(torch.device("cpu"))]) == {
        mine.text(), other.text()}


def test_storing_beside_skips_files_that_are_not_caches_either(tmp_cache):
    tmp_cache.write_text("{not json")
    taken = tmp_cache.with_name(tmp_cache.name + ".new")
    taken.write_text('{"someone": "else"}')
    with pytest.warns(RuntimeWarning, match=r"saved to .*flash-autotune\.json\.new\.1"):
        _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    assert tmp_cache.read_text() == "{not json" and taken.read_text() == '{"someone": "else"}'
    assert json.loads(tmp_cache.with_name(tmp_cache.name + ".new.1").read_text())


@pytest.mark.parametrize("content", [None, "", "  \n", "{}", _a_readable_cache()])
def test_storing_into_a_missing_empty_or_readable_cache_writes_it(tmp_cache, content, recwarn):
    if content is not None:
        tmp_cache.write_text(content)
    mine = ShapeKey.of(1, 64, 64, 16, torch.float32, False)
    _store(mine)
    saved = json.loads(tmp_cache.read_text())[flash_autotune.device_id(torch.device("cpu"))]
    assert mine.text() in saved and (content != _a_readable_cache() or len(saved) == 2)
    assert not tmp_cache.with_name(tmp_cache.name + ".new").exists()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _real_replace_refusing_special_files(monkeypatch):
    """os.replace that fails the test instead of replacing a non-regular file: if the code under test ever
    regressed, a test run as root would otherwise swap the machine's /dev/null for a regular file."""
    real = os.replace

    def guarded(src, dst, *args, **kwargs):
        if os.path.exists(dst) and not stat.S_ISREG(os.stat(dst).st_mode):
            raise AssertionError(f"os.replace onto {dst}, which is not a regular file")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", guarded)


def test_a_character_device_is_neither_read_nor_replaced(monkeypatch):
    """CS336_FLASH_CACHE=/dev/null used to read as an empty cache and be replaced by a regular file."""
    _real_replace_refusing_special_files(monkeypatch)
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    monkeypatch.setenv(flash_autotune.CACHE_ENV, "/dev/null")
    flash_autotune.clear_memo()
    before = os.stat("/dev/null")
    lock_existed = os.path.exists("/dev/null.lock")
    try:
        message = r"CS336_FLASH_CACHE=/dev/null is a character device, not a regular file: it is neither read"
        with pytest.raises(flash_autotune.CacheFileError, match=message):
            flash_autotune.select(1, 64, 64, 16, torch.float32, False, torch.device("cpu"))
        with pytest.raises(flash_autotune.CacheFileError, match=message):
            _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    finally:
        flash_autotune.clear_memo()
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert os.path.exists("/dev/null.lock") == lock_existed  # nothing created beside it either


def _make_special(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))  # the socket file stays after the socket is closed
        server.close()


@pytest.mark.timeout(60)  # reading a FIFO that no one writes would block: fail, do not hang the run
@pytest.mark.parametrize("through_link", [False, True])
@pytest.mark.parametrize("kind, described", [("fifo", r"a FIFO \(named pipe\)"), ("directory", "a directory"),
                                              ("socket", "a socket")], ids=["fifo", "directory", "socket"])
def test_special_files_are_neither_read_nor_replaced(tmp_cache, monkeypatch, kind, described, through_link):
    if not hasattr(os, "mkfifo") or not hasattr(socket, "AF_UNIX"):
        pytest.skip("needs POSIX FIFOs and sockets")
    _real_replace_refusing_special_files(monkeypatch)
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)
    special = tmp_cache.with_name("special") if through_link else tmp_cache
    _make_special(special, kind)
    if through_link:
        tmp_cache.symlink_to(special)
    link = rf" \(a link to {re.escape(str(special))}\)" if through_link else ""
    message = rf"CS336_FLASH_CACHE={re.escape(str(tmp_cache))}{link} is {described}, not a regular file"
    with pytest.raises(flash_autotune.CacheFileError, match=message):
        flash_autotune.select(1, 64, 64, 16, torch.float32, False, torch.device("cpu"))
    with pytest.raises(flash_autotune.CacheFileError, match=message):
        _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    assert {kind: os.path.isdir, "fifo": lambda p: stat.S_ISFIFO(os.stat(p).st_mode),
            "socket": lambda p: stat.S_ISSOCK(os.stat(p).st_mode)}[kind](special)
    assert tmp_cache.is_symlink() == through_link
    left = {"special", tmp_cache.name} if through_link else {tmp_cache.name}
    assert {p.name for p in tmp_cache.parent.iterdir()} == left  # no lock, no .new, no temporary file
    if kind == "directory":
        assert not any(special.iterdir())


@pytest.mark.timeout(60)
def test_a_special_file_beside_an_unreadable_cache_is_skipped_unopened(tmp_cache):
    """The .new files are candidates too: a FIFO there is passed over, not read (which would block)."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs POSIX FIFOs")
    tmp_cache.write_text("{not json")
    os.mkfifo(tmp_cache.with_name(tmp_cache.name + ".new"))
    with pytest.warns(RuntimeWarning, match=r"saved to .*flash-autotune\.json\.new\.1"):
        _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    assert stat.S_ISFIFO(os.stat(tmp_cache.with_name(tmp_cache.name + ".new")).st_mode)
    assert tmp_cache.read_text() == "{not json"


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_cache_is_written_through_the_link(tmp_cache, dangling):
    """The file the link points to (in another directory) is replaced; the link stays a link to it."""
    elsewhere = tmp_cache.parent / "elsewhere"
    elsewhere.mkdir()
    real = elsewhere / "real.json"
    if not dangling:
        real.write_text(_a_readable_cache())
    tmp_cache.symlink_to(os.path.relpath(real, tmp_cache.parent))
    mine = ShapeKey.of(1, 64, 64, 16, torch.float32, False)
    _store(mine)
    assert tmp_cache.is_symlink() and os.readlink(tmp_cache) == os.path.relpath(real, tmp_cache.parent)
    saved = json.loads(real.read_text())[flash_autotune.device_id(torch.device("cpu"))]
    theirs = ShapeKey.of(1, 4096, 4096, 64, torch.float16, True)  # the entry _a_readable_cache holds
    assert set(saved) == {mine.text()} | (set() if dangling else {theirs.text()})
    # the temporary file went beside the target (so os.replace was atomic) and is gone; the lock is there too
    assert {p.name for p in elsewhere.iterdir()} == {"real.json", "real.json.lock"}
    assert {p.name for p in tmp_cache.parent.iterdir()} == {tmp_cache.name, "elsewhere"}


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664], ids=oct)
@pytest.mark.parametrize("through_link", [False, True])
def test_rewriting_keeps_the_cache_files_permission_bits(tmp_cache, mode, through_link):
    real = tmp_cache.with_name("real.json") if through_link else tmp_cache
    real.write_text(_a_readable_cache())
    real.chmod(mode)
    if through_link:
        tmp_cache.symlink_to(real)
    _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    assert len(json.loads(real.read_text())[flash_autotune.device_id(torch.device("cpu"))]) == 2  # rewritten
    assert stat.S_IMODE(real.stat().st_mode) == mode


def test_a_new_cache_file_gets_the_usual_permissions(tmp_cache):
    """A file the cache creates has the umask's bits (as any new file), not the private temporary file's."""
    umask = os.umask(0o022)
    os.umask(umask)
    _store(ShapeKey.of(1, 64, 64, 16, torch.float32, False))
    assert stat.S_IMODE(tmp_cache.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", "on"])
def test_autotune_variable_is_validated(tmp_cache, monkeypatch, value):
    monkeypatch.setenv(flash_autotune.AUTOTUNE_ENV, value)
    with pytest.raises(ValueError, match=rf"CS336_FLASH_AUTOTUNE must be one of 0, 1 \(or unset\), got '{value}'"):
        flash_autotune.select(1, 64, 64, 16, torch.float32, False, torch.device("cpu"), may_tune=True)
    monkeypatch.setattr(flash_autotune, "interpreter_active", lambda: False)  # the GPU path, on a memo miss
    with pytest.raises(ValueError, match="CS336_FLASH_AUTOTUNE must be one of"):
        flash_autotune.select(1, 64, 64, 16, torch.float32, False, torch.device("cpu"))


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("0", False), ("1", True)])
def test_autotune_variable_accepted_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(flash_autotune.AUTOTUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(flash_autotune.AUTOTUNE_ENV, value)
    assert flash_autotune.autotune_requested() is expected


def test_tune_picks_the_fastest_correct_candidate_and_caches_it(tmp_cache):
    if not flash_autotune.interpreter_active():
        pytest.skip("the CPU run of the tuner needs TRITON_INTERPRET=1")
    timed = []

    def fake_bench(fn):
        # Later candidates are "faster": the tuner must pick each kernel's last correct candidate.
        timed.append(fn)
        return 10.0 - 0.1 * len(timed)

    result = flash_autotune.tune(1, 70, 70, 16, torch.float32, True, "cpu", bench=fake_bench)
    key = ShapeKey.of(1, 70, 70, 16, torch.float32, True)
    for kernel in KERNELS:
        cands = flash_configs.candidates(kernel, key)
        assert result.chosen[kernel] == cands[-1]
        assert all(isinstance(t, float) for t in result.timings_ms[kernel].values()), result.timings_ms[kernel]
        assert len(result.timings_ms[kernel]) == len(cands)
    saved = json.loads(tmp_cache.read_text())
    assert saved[flash_autotune.device_id(torch.device("cpu"))][key.text()] == {
        kernel: cfg.short() for kernel, cfg in result.chosen.items()
    }
    assert flash_autotune.cached(key, torch.device("cpu")) == result.chosen


def test_tune_times_the_tile_its_key_names(tmp_cache, monkeypatch):
    """Where a head dim's forward runs split by default (`FORWARD_SPLIT_HEAD_DIMS`, here d 80) its configuration
    is keyed by the padded width (shared with d 112 and 128): the tuner times the padded forward there; opted in
    to split tiles everywhere, the key is the split width and the tuner times the split forward."""
    if not flash_autotune.interpreter_active():
        pytest.skip("the CPU run of the tuner needs TRITON_INTERPRET=1")
    from cs336_systems.attention.kernels.portable import launch as flash_launch

    seen = []
    real = flash_launch.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("tiles"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_launch, "forward", spy)
    monkeypatch.setattr(flash_configs, "candidates", lambda kernel, key: [flash_configs.TileConfig(32, 32, 4, 1)])
    monkeypatch.setattr(flash_configs, "FORWARD_SPLIT_HEAD_DIMS", (80,))
    for split_d, want in (("", (128, 0)), ("1", None)):
        monkeypatch.setenv("CS336_FLASH_SPLIT_D", split_d)
        seen.clear()
        flash_autotune.tune(1, 40, 40, 80, torch.float16, True, "cpu", kernels=("fwd",), bench=lambda fn: 1.0,
                            save=False)
        assert seen and all(tiles == want for tiles in seen), (split_d, seen)


def test_close_rejects_wrong_or_nonfinite_outputs():
    ref = torch.randn(4, 8)
    assert flash_autotune._close(ref + 1e-6, ref)
    assert not flash_autotune._close(ref + 0.1, ref)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not flash_autotune._close(bad, ref)
    assert flash_autotune._close(ref.bfloat16(), ref)


@pytest.mark.parametrize("shape", ["16,16384", "0,128,64", "1,-5,64", "1,128,48", "a,b,c"])
def test_cli_rejects_bad_shapes_before_anything_runs(shape, capsys):
    with pytest.raises(SystemExit) as exc:
        flash_autotune.main(["--shape", shape])
    assert exc.value.code == 2 and "--shape" in capsys.readouterr().err
