"""The flash-triton plan (`cs336_systems.attention.plan`): which kernels run for a problem, driven through a
table of problems and expected plans on preset devices (no GPU needed), the options and switches over the
rules, symbolic sizes, and the generated docs table."""

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from cs336_systems import switches
from cs336_systems.attention import plan as planning
from cs336_systems.attention.kernels.portable import configs as flash_configs
from cs336_systems.attention.plan import Device, FlashOptions, Problem, plan

H200 = Device.preset("H200")
A100 = Device.preset("A100")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# the portable kernels' configurations, pointer loads: the traced path is decided by the Gluon kernels alone
POINTERS = {kernel: flash_configs.TileConfig(64, 64, 4, 2) for kernel in flash_configs.KERNELS}
TMA = {kernel: flash_configs.TileConfig(64, 64, 4, 2, tma=1) for kernel in flash_configs.KERNELS}


def problem(b, h, n, d, hkv=None, causal=True, dtype=BF16, nk=None, **layout):
    return Problem(b, h, hkv or h, n, n if nk is None else nk, d, dtype, causal, **layout)


def kernels(p, device=H200, options=FlashOptions()):
    """(forward, backward, dq, dkdv, traced) of the plan."""
    pl = plan(p, device, options, configs=POINTERS)
    return pl.forward, pl.backward, pl.dq, pl.dkdv, pl.traced


P, HOP, WS, FUSED, TWO, CUSTOM, TRITON_OP = "portable", "hopper", "hopper-ws", "fused", "two-kernel", "custom_op", "triton_op"

# problem -> expected plan under the default options on an H200 (132 SMs); each row names the rule it probes.
TABLE = [
    # the leaderboard shapes and the models' shapes
    (problem(1, 16, 16384, 64), (P, FUSED, "-", "-", CUSTOM)),  # d 64: fused from 4096 queries
    (problem(1, 16, 16384, 128), (WS, FUSED, "-", "-", CUSTOM)),
    (problem(4, 25, 512, 64), (P, TWO, P, P, TRITON_OP)),  # the xl model at context 512: inductor launches
    (problem(4, 32, 512, 80), (HOP, FUSED, "-", "-", CUSTOM)),  # the 2.7B model at context 512
    # forward: d 128 (warp-specialized) from 2048 keys and a 128-row program per SM
    (problem(1, 64, 2048, 128, causal=False), (WS, TWO, HOP, HOP, CUSTOM)),  # dK/dV: 2048 programs of 64 keys
    (problem(1, 64, 2048, 128, nk=2047, causal=False), (P, TWO, HOP, HOP, CUSTOM)),
    (problem(1, 2, 2048, 128, causal=False), (P, TWO, HOP, P, CUSTOM)),  # 32 programs: few
    (problem(1, 1, 32768, 128, causal=False), (WS, FUSED, "-", "-", CUSTOM)),  # 256 programs: one per SM
    # forward at d 256: warp-specialized from 2048 keys and a 128-row program per SM (H200 rules), else (H100)
    # the one-program kernel from 16384 keys and a program per SM
    (problem(1, 8, 16384, 256), (WS, TWO, HOP, HOP, CUSTOM)),
    (problem(1, 64, 8192, 256), (WS, TWO, HOP, HOP, CUSTOM)),
    (problem(1, 3, 16384, 256), (WS, TWO, HOP, HOP, CUSTOM)),  # 384 programs
    (problem(1, 2, 16384, 256), (WS, TWO, HOP, HOP, CUSTOM)),  # 256 programs: one per SM
    (problem(1, 1, 16384, 256), (P, TWO, HOP, HOP, CUSTOM)),  # 128 programs: fewer than SMs
    (problem(2, 8, 1024, 256, causal=False), (P, TWO, P, P, TRITON_OP)),  # 1024 keys: short rows
    # d 80 / 96: the forward from 512 keys, programs counted in 128-row units
    (problem(1, 17, 1024, 80, causal=False), (HOP, FUSED, "-", "-", CUSTOM)),  # 136 units (and fused programs)
    (problem(1, 9, 1024, 80, causal=False), (P, TWO, HOP, P, CUSTOM)),  # 72 units; 72 fused programs: few
    (problem(4, 16, 511, 96), (P, TWO, P, P, TRITON_OP)),
    (problem(1, 1, 32768, 80), (WS, FUSED, "-", "-", CUSTOM)),  # 256 fused programs of 128 keys
    # d 80 / 96: the warp-specialized forward from 2048 keys (H200 rule)
    (problem(1, 16, 8192, 96), (WS, FUSED, "-", "-", CUSTOM)),
    (problem(1, 16, 8192, 96, nk=2047), (HOP, FUSED, "-", "-", CUSTOM)),
    # dQ: causal d 64 at 2048-4096 queries with two 64-row programs per SM, d 128 to 8192 with one
    (problem(1, 16, 2048, 64), (P, TWO, HOP, HOP, CUSTOM)),
    (problem(1, 8, 2048, 64), (P, TWO, P, P, TRITON_OP)),  # 256 dQ programs; 256 dK/dV programs
    (problem(1, 9, 2048, 64), (P, TWO, HOP, HOP, CUSTOM)),  # 288 dQ and dK/dV programs: two per SM
    (problem(1, 16, 4160, 64), (P, FUSED, "-", "-", CUSTOM)),  # past 4096: the fused pass
    (problem(1, 1, 16384 - 128, 64), (P, TWO, P, P, TRITON_OP)),  # 127 fused programs: fewer than the SMs
    (problem(4, 16, 2048, 64), (P, TWO, HOP, HOP, CUSTOM)),  # below 4096 queries: the two Gluon kernels
    (problem(4, 16, 1024, 64), (P, TWO, P, P, TRITON_OP)),  # below 2048 queries: everything portable
    (problem(1, 5, 2048, 128), (P, TWO, HOP, P, CUSTOM)),  # fused: 80 programs < SMs; dQ 160; dK/dV 160 < 264
    (problem(1, 17, 1024, 128), (P, FUSED, "-", "-", CUSTOM)),  # fused at d 128 from 1024 queries (136 programs)
    (problem(1, 8, 16384, 128, hkv=1), (WS, FUSED, "-", "-", CUSTOM)),  # MQA: the group split among programs
    (problem(1, 32, 4096, 128, hkv=1), (WS, FUSED, "-", "-", CUSTOM)),
    (problem(1, 32, 1024, 128, hkv=1), (P, TWO, P, P, TRITON_OP)),  # grouped: fused from 2048 queries
    (problem(1, 32, 2048, 64, hkv=8), (P, FUSED, "-", "-", CUSTOM)),  # 16 x 32 query-head programs
    (problem(1, 2, 2048, 64, hkv=1), (P, TWO, P, P, TRITON_OP)),  # 32 programs even split: few
    # dQ and the fused pass without the mask
    (problem(2, 8, 1024, 128, hkv=2, causal=False), (P, TWO, HOP, P, CUSTOM)),
    (problem(2, 8, 1023, 128, hkv=2, causal=False), (P, TWO, P, P, TRITON_OP)),
    (problem(2, 8, 4096, 64, hkv=2, causal=False), (P, TWO, P, P, TRITON_OP)),  # grouped: fused not measured
    (problem(1, 8, 1024, 64, causal=False), (P, FUSED, "-", "-", CUSTOM)),
    (problem(1, 8, 1023, 64, causal=False), (P, TWO, P, P, TRITON_OP)),
    (problem(1, 8, 4096, 128, causal=False), (WS, FUSED, "-", "-", CUSTOM)),
    (problem(1, 32, 4096, 128, hkv=8, causal=False), (WS, FUSED, "-", "-", CUSTOM)),  # grouped (H200 rule)
    # dK/dV: no grouped heads, two 64-key programs per SM; d 256 without a program count
    (problem(1, 1, 32768, 64), (P, FUSED, "-", "-", CUSTOM)),  # 256 fused programs of 128 keys
    (problem(1, 2, 32768, 64, hkv=1, causal=False), (P, TWO, P, P, TRITON_OP)),  # grouped, not causal
    (problem(1, 1, 4096, 256), (P, TWO, HOP, HOP, CUSTOM)),
    (problem(1, 1, 1024, 256), (P, TWO, P, P, TRITON_OP)),
    (problem(1, 8, 8192, 256, hkv=2), (WS, TWO, HOP, P, CUSTOM)),
    # what the Gluon kernels cannot take
    (problem(1, 16, 16384, 64, dtype=FP32), (P, TWO, P, P, TRITON_OP)),
    (problem(1, 16, 16384, 112), (P, TWO, P, P, TRITON_OP)),
    (problem(1, 16, 16384, 128, tma_layout=False), (P, TWO, P, P, TRITON_OP)),
    (problem(70000, 1, 4096, 128, causal=False), (P, TWO, P, P, TRITON_OP)),  # > 65535 (z, h) slices
]



@pytest.mark.parametrize("p, expected", TABLE, ids=[p.text() for p, _ in TABLE])
def test_the_plan_table(p, expected):
    assert kernels(p) == expected


# Where the H100 differs: the rules measured on the H200 only (the fused pass at d 80 / 96 and for grouped
# heads, the warp-specialized forward at d 80 / 96 and 256) are not its defaults until measured there; it keeps the
# plan those rows had before them.
H100_DIFFERS = {
    problem(4, 32, 512, 80): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 17, 1024, 80, causal=False): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 1, 32768, 80): (HOP, TWO, P, HOP, CUSTOM),  # dQ past 16384 queries: portable
    problem(1, 16, 8192, 96): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 16, 8192, 96, nk=2047): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 8, 16384, 128, hkv=1): (WS, TWO, P, P, CUSTOM),  # MQA: 128 fused programs < SMs
    problem(1, 32, 4096, 128, hkv=1): (WS, TWO, HOP, P, CUSTOM),  # dQ counts query heads: 2048 programs
    problem(1, 32, 2048, 64, hkv=8): (P, TWO, HOP, P, CUSTOM),
    problem(1, 32, 4096, 128, hkv=8, causal=False): (WS, TWO, HOP, P, CUSTOM),
    problem(1, 8, 16384, 256): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 64, 8192, 256): (P, TWO, HOP, HOP, CUSTOM),
    problem(1, 3, 16384, 256): (HOP, TWO, HOP, HOP, CUSTOM),
    problem(1, 8, 8192, 256, hkv=2): (P, TWO, HOP, P, CUSTOM),
    problem(1, 2, 16384, 256): (HOP, TWO, HOP, HOP, CUSTOM),
}


def test_the_plan_table_on_an_h100():
    # the H100 (same SM count) takes the H200's plan except where a rule names the H200 only
    assert {rule.devices for rule in planning.RULES} == {None, ("H200",)}
    table = dict(TABLE)
    assert set(H100_DIFFERS) <= set(table)
    assert all(table[p] != expected for p, expected in H100_DIFFERS.items())
    for p, expected in TABLE:
        assert kernels(p, Device.preset("H100")) == H100_DIFFERS.get(p, expected), p.text()


def test_the_fused_pass_at_one_program_per_sm_exactly():
    n = 132 * 128  # 132 programs of 128 keys at B·H 1
    assert kernels(problem(1, 1, n, 128))[1] == FUSED and kernels(problem(1, 1, n - 128, 128))[1] == TWO


def test_other_devices_take_the_portable_kernels():
    p = problem(1, 16, 16384, 128)
    assert kernels(p, A100) == (P, TWO, P, P, TRITON_OP)  # no Gluon kernels before sm_90, no descriptors
    for device in (Device("cuda", "sm_100", 10, 148, True, True), Device("cuda", "H200, Triton 3.9", 9, 132, False, True)):
        assert kernels(p, device)[:4] == (P, TWO, P, P)
    interpreter = Device("interpreter", "cpu", 0, 1, False, True)
    assert kernels(p, interpreter) == (P, TWO, P, P, CUSTOM)  # wrap_triton cannot take interpreted kernels


def test_options_switch_each_kernel_on_or_off():
    p = problem(4, 25, 512, 64)  # nothing Gluon by default
    assert kernels(p, options=FlashOptions(hopper_fwd="on"))[:2] == (WS, TWO)
    assert kernels(p, options=FlashOptions(hopper_bwd="on"))[1:4] == (TWO, HOP, HOP)
    assert kernels(p, options=FlashOptions(fused_bwd="on"))[1] == FUSED
    big = problem(1, 16, 16384, 128)
    assert kernels(big, options=FlashOptions(hopper_fwd="off"))[0] == P
    assert kernels(big, options=FlashOptions(fused_bwd="off"))[1:4] == (TWO, P, HOP)  # causal dQ: to 8192
    assert kernels(big, options=FlashOptions(hopper_bwd="off"))[1:4] == (TWO, P, P)  # the fused pass too
    assert kernels(big, options=FlashOptions(tma=False)) == (P, TWO, P, P, TRITON_OP)
    # "on" is bounded by what the kernels have: no Gluon kernel in float32 (the fused pass takes every head dim,
    # 256 in hopper/backward_wide)
    assert kernels(problem(1, 8, 4096, 96), options=FlashOptions(fused_bwd="on"))[1] == FUSED
    assert kernels(problem(1, 8, 4096, 256), options=FlashOptions(fused_bwd="on"))[1] == FUSED
    assert kernels(problem(1, 8, 64, 64, dtype=FP32), options=FlashOptions(hopper_fwd="on"))[0] == P
    assert kernels(problem(1, 2, 64, 64, causal=False, hkv=1), options=FlashOptions(fused_bwd="on"))[1] == FUSED


def test_the_environment_overrides_the_options(monkeypatch):
    for name in ("CS336_FLASH_HOPPER_FWD", "CS336_FLASH_HOPPER_BWD", "CS336_FLASH_FUSED_BWD", "CS336_FLASH_TMA"):
        monkeypatch.delenv(name, raising=False)
    options = FlashOptions(fused_bwd="on")
    assert options.with_env() is options
    monkeypatch.setenv("CS336_FLASH_FUSED_BWD", "0")
    monkeypatch.setenv("CS336_FLASH_HOPPER_FWD", "1")
    monkeypatch.setenv("CS336_FLASH_TMA", "0")
    assert options.with_env() == FlashOptions(hopper_fwd="on", fused_bwd="off", tma=False)
    monkeypatch.setenv("CS336_FLASH_HOPPER_BWD", "yes")
    with pytest.raises(ValueError, match=r"CS336_FLASH_HOPPER_BWD must be one of 0, 1 \(or unset\), got 'yes'"):
        options.with_env()


def test_options_are_validated_and_round_trip_through_their_text():
    with pytest.raises(ValueError, match="FlashOptions.fused_bwd must be one of auto, on, off; got 'yes'"):
        FlashOptions(fused_bwd="yes")
    with pytest.raises(ValueError, match="FlashOptions.tma must be a bool"):
        FlashOptions(tma="off")
    for options in (FlashOptions(), FlashOptions(hopper_fwd="off", fused_bwd="on", tma=False)):
        assert FlashOptions.parse(options.text()) == options
    assert FlashOptions().text() == ""
    with pytest.raises(ValueError, match="unknown flash option 'fused'"):
        FlashOptions.parse("fused=on")


def test_traced_path_keeps_the_custom_op_where_descriptors_are_wanted():
    p = problem(4, 25, 512, 64)
    assert plan(p, H200, configs=POINTERS).traced == TRITON_OP
    assert plan(p, H200, configs=TMA).traced == CUSTOM
    assert plan(problem(4, 25, 512, 64, kv_contiguous=False), H200, configs=TMA).traced == TRITON_OP
    assert plan(p, H200, FlashOptions(tma=False), configs=TMA).traced == TRITON_OP
    assert plan(p, H200, traced=False).traced == "eager"  # an eager call asks for no configuration
    # without given configurations a preset device reads the tuned tables (no cache, no GPU)
    pl = plan(p, H200)
    assert set(pl.configs) == set(flash_configs.KERNELS) and pl.configs_source


def test_symbolic_sizes_defer_every_choice_to_run_time():
    """A traced call whose sizes are symbolic (dynamic shapes) must not compare them with the rules (each
    comparison would guard and recompile): the plan defers the kernels and takes the custom op."""
    env = ShapeEnv()
    n = env.create_unbacked_symint()  # no hint at all: any comparison would raise
    b = env.create_unbacked_symint()
    for p in (problem(b, 16, 4096, 64), problem(1, 16, 4096, 64, nk=n), Problem(1, 16, 16, 4096, 4096, n, BF16, True)):
        assert p.symbolic
        pl = plan(p, H200)
        assert pl.traced == CUSTOM and pl.forward == pl.backward == planning.AT_RUN_TIME
        assert "symbolic" in pl.reason("traced")
    assert not env.guards  # nothing was guarded


def test_problem_of_fake_tensors_with_symbolic_shapes():
    """`Problem.of` on the tensors a dynamic-shape trace sees: symbolic sizes, and no layout question asked of
    them (a stride check would guard on the symbols)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env = ShapeEnv()
    n = env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        q = torch.empty(2, 4, n, 64, dtype=BF16)
        p = Problem.of(q, q, True, (q, q, q), addresses=False)
    assert p.symbolic and not p.tma_layout and plan(p, H200).traced == CUSTOM
    assert not env.guards


def test_tma_layout_rules():
    t = torch.empty(2, 3, 64, 128, dtype=BF16)
    assert planning.tma_layout_ok(t)
    assert planning.tma_layout_ok(torch.empty(2, 64, 3, 128, dtype=BF16).transpose(1, 2))  # token-major view
    assert not planning.tma_layout_ok(t[..., 1:])  # base 2 bytes off, and a 127-wide row
    assert not planning.tma_layout_ok(torch.empty(2, 3, 64, 132, dtype=BF16)[..., :128])  # 264-byte rows
    assert not planning.tma_layout_ok(t.transpose(-1, -2))  # d not the unit-stride dim
    assert not planning.tma_layout_ok(torch.empty(1, 3, 64, 128, dtype=BF16).expand(2, 3, 64, 128))  # broadcast
    assert planning.tma_layout_ok(torch.empty(1, 3, 64, 128, dtype=BF16).expand(1, 3, 64, 128))
    assert not planning.tma_layout_ok(torch.empty(3, 64, 128, dtype=BF16))  # not (Z, H, N, d)
    q = torch.empty(2, 3, 64, 128, dtype=BF16)
    broadcast = torch.empty(2, 1, 64, 128, dtype=BF16).expand(2, 3, 64, 128)
    assert not Problem.of(q, broadcast, True, (q, broadcast, broadcast)).tma_layout
    assert not Problem.of(q, broadcast, True, (q, broadcast, broadcast)).kv_contiguous


def test_every_rule_has_a_reason_and_a_measurement_and_is_reachable():
    for rule in planning.RULES:
        assert rule.kernel in planning.KERNELS and rule.reason and rule.measured, rule
        assert set(rule.head_dims) <= set(planning.KERNEL_HEAD_DIMS[rule.kernel]), rule
        # a problem at the rule's lower bounds with plenty of programs takes the kernel
        n = max(rule.min_q, rule.min_k, 64)
        p = Problem(64, 8, 2 if rule.grouped else 8, n, max(n, rule.min_k), rule.head_dims[0], BF16,
                    True if rule.causal is None else rule.causal)
        device = Device.preset("H100") if rule.devices == ("H100",) else H200
        assert rule.matches(p, device), rule
        assert planning._choose(rule.kernel, "auto", p, device, FlashOptions())[0], rule


def test_explain_names_each_choice_and_its_rule():
    text = planning.explain(problem(1, 16, 16384, 64), Device.preset("H100"))
    assert "forward:  portable" in text and "backward: fused" in text and "traced:   custom_op" in text
    assert "rule [d 64, causal, Nq >= 4096, >= 1 program of 128 keys per SM]" in text
    text = planning.explain(problem(4, 25, 512, 64), H200)
    assert "dq:     portable" in text and "portable tiles: fwd " in text


def test_the_docs_tables_are_generated_from_the_rules_and_the_registry():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "flash-attention.md").read_text()
    for name, table in (("plan-table", planning.rules_table()), ("switches-table", switches.markdown_table())):
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        assert start in doc and end in doc, name
        assert doc.split(start)[1].split(end)[0].strip() == table, (
            f"docs/flash-attention.md's {name} is stale: run `cs336-flash-autotune --write-docs`")


def test_explain_command(capsys, tmp_path):
    from cs336_systems import flash_autotune as cli

    assert cli.main(["--explain", "1,16,16384,128", "--device", "H200"]) == 0
    out = capsys.readouterr().out
    assert "problem: B 1, H 16, Nq 16384, Nk 16384, d 128, bfloat16, causal" in out and "backward: fused" in out
    assert cli.main(["--explain", "2,32,4096,128", "--kv-heads", "8", "--no-causal", "--dtype", "fp16",
                     "--device", "H100"]) == 0
    assert "H 32/8" in capsys.readouterr().out
    for bad, message in ((["--explain", "1,16,64"], "expected B,H,N,d"),
                         (["--explain", "1,16,64,64", "--kv-heads", "3", "--device", "H200"], "--kv-heads must divide"),
                         (["--explain", "1,16,64,64", "--device", "V100"], "invalid choice")):
        with pytest.raises(SystemExit):
            cli.main(bad)
        assert message in capsys.readouterr().err
    doc = tmp_path / "doc.md"
    doc.write_text("a\n<!-- plan-table:start -->\nSTALE ROW\n<!-- plan-table:end -->\nb\n"
                   "<!-- switches-table:start -->\n<!-- switches-table:end -->\n")
    assert cli.main(["--write-docs", str(doc)]) == 0
    text = doc.read_text()
    assert "STALE ROW" not in text and planning.rules_table() in text and switches.markdown_table() in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit):
        cli.main(["--write-docs", str(doc)])
    assert "plan-table:start" in capsys.readouterr().err


def test_a_rule_may_hold_on_named_devices_only():
    rule = planning.Rule("fused", (64,), "why", "where", causal=True, min_q=1024, devices=("H100",))
    p = problem(1, 16, 16384, 64)
    assert rule.matches(p, Device.preset("H100")) and not rule.matches(p, H200)
    assert "on H100" in rule.text()
