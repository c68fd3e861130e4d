"""The Hugging Face LlamaForCausalLM baseline of the end-to-end suite: the same model as ours (parameters,
configuration, the function it computes), the same step, the SDPA is_causal path, the same compile policy,
and a clear reason when transformers is missing."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import model as lm_model
from cs336_systems.bench import flops
from cs336_systems.bench.workloads import hf_llama
from cs336_systems.bench.workloads import lm as workloads

ROOT = Path(__file__).resolve().parents[2]
INSTALL_REASON = "transformers not installed: pip install -e .[baselines]"

try:
    import transformers
except ImportError:  # the tests of what happens without it still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason=INSTALL_REASON)


# --- the same model ---------------------------------------------------------------------------------------

@needs_transformers
@pytest.mark.parametrize("size", list(lm_model.SIZES))
def test_parameter_counts_equal_ours_at_every_size(size):
    with torch.device("meta"):
        ours = lm_model.build(size, attention="sdpa")
        theirs = hf_llama.build(size)
    assert next(theirs.parameters()).device.type == "meta"
    assert lm_model.count_parameters(theirs) == lm_model.count_parameters(ours)
    # the N of the FLOP and MFU formulas: every matmul weight (LM head included), not the embedding or norms
    assert flops.count_matmul_parameters(theirs) == flops.count_matmul_parameters(ours)
    assert flops.count_matmul_parameters(theirs) == flops.matmul_parameters(ours.config)
    assert sum(p.numel() for p in theirs.parameters() if p.dim() == 1) == \
        sum(p.numel() for p in ours.parameters() if p.dim() == 1)  # the norm gains


@pytest.mark.parametrize("size, overrides", [("2.7B", {}), ("tiny", {"rope_theta": 500.0, "norm_eps": 0.25,
                                                                     "vocab_size": 321, "context_length": 48})])
@needs_transformers
def test_llama_config_maps_every_field_of_ours(size, overrides):
    cfg = lm_model.config(size, attention="sdpa", **overrides)
    hf = hf_llama.llama_config(cfg)
    assert (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (cfg.d_model, cfg.d_ff, cfg.n_layers)
    assert hf.num_attention_heads == hf.num_key_value_heads == cfg.n_heads and hf.head_dim == cfg.d_head
    assert (hf.vocab_size, hf.max_position_embeddings) == (cfg.vocab_size, cfg.context_length)
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta and hf.rope_parameters["rope_type"] == "default"
    assert hf.rms_norm_eps == cfg.norm_eps and hf.hidden_act == "silu"
    assert not hf.attention_bias and not hf.mlp_bias and not hf.tie_word_embeddings and hf.pad_token_id is None
    assert hf._attn_implementation == "sdpa" and hf.use_cache is False


@needs_transformers
def test_built_baseline_has_no_biases_an_untied_head_and_our_norm_eps():
    model = hf_llama.build("tiny", norm_eps=0.125)
    assert isinstance(model, transformers.LlamaForCausalLM)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.bias is None for m in linears)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.padding_idx is None
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 2 * lm_model.SIZES["tiny"]["n_layers"] + 1
    assert all(m.variance_epsilon == 0.125 for m in norms)
    assert model.config._attn_implementation == "sdpa"


def _copy_ours_into_hf(ours: lm_model.TransformerLM, hf: nn.Module) -> None:
    """Our weights in HF's layout: fused q/k/v and gate/up split, and each head's q/k rows reordered from our
    RoPE pairs (2i, 2i+1) to HF's halves (i, i + d/2)."""
    cfg = ours.config
    d_head = cfg.d_head
    halves = torch.cat((torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)))  # HF channel j <- our channel

    def to_halves(weight: torch.Tensor) -> torch.Tensor:  # (H * d_head, d_model)
        return weight.view(cfg.n_heads, d_head, -1)[:, halves].reshape(cfg.d_model, -1)

    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.token_embeddings.weight)
        for mine, theirs in zip(ours.layers, hf.model.layers):
            q, k, v = mine.attn.qkv_proj.weight.chunk(3, dim=0)
            theirs.self_attn.q_proj.weight.copy_(to_halves(q))
            theirs.self_attn.k_proj.weight.copy_(to_halves(k))
            theirs.self_attn.v_proj.weight.copy_(v)
            theirs.self_attn.o_proj.weight.copy_(mine.attn.output_proj.weight)
            gate, up = mine.ffn.w13.weight.chunk(2, dim=0)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.ffn.w2.weight)
            theirs.input_layernorm.weight.copy_(mine.attn_norm.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.ffn_norm.weight)
        hf.model.norm.weight.copy_(ours.final_norm.weight)
        hf.lm_head.weight.copy_(ours.lm_head.weight)


@needs_transformers
@pytest.mark.parametrize("overrides", [{}, {"rope_theta": 37.0, "norm_eps": 0.5}])
def test_with_our_weights_the_baseline_computes_our_function(overrides):
    """The mapping is right in every detail that changes values (RoPE theta, norm eps, SwiGLU's gate and up,
    causal masking, no biases): given our weights, HF's model returns our logits."""
    torch.manual_seed(0)
    ours = lm_model.build("tiny", attention="sdpa", context_length=32, **overrides)
    with torch.no_grad():  # norm gains other than 1, so that a swapped norm would show
        for p in ours.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    hf = hf_llama.build("tiny", context_length=32, **overrides)
    _copy_ours_into_hf(ours, hf)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf_llama.logits(hf, tokens), ours(tokens), rtol=1e-4, atol=1e-4)
        # and a different eps or theta does change them: the comparison above can fail
        other = hf_llama.build("tiny", context_length=32, rope_theta=10_000.0 * 3, norm_eps=0.9)
        _copy_ours_into_hf(ours, other)
        assert not torch.allclose(hf_llama.logits(other, tokens), ours(tokens), rtol=1e-4, atol=1e-4)


@needs_transformers
def test_what_the_baseline_does_not_run_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="attention='naive'"):
        hf_llama.llama_config(lm_model.config("tiny", attention="naive"))
    with pytest.raises(ValueError, match="checkpoint='sqrt'"):
        hf_llama.build("tiny", checkpoint="sqrt")
    with pytest.raises(ValueError, match="attention='naive'"):
        workloads.lm_step(size="tiny", context=8, batch_size=1, mode="forward", attention="naive", impl="hf-llama")
    with pytest.raises(ValueError, match="unknown impl 'hf'; valid: own, hf-llama"):
        workloads.lm_step(size="tiny", context=8, batch_size=1, mode="forward", impl="hf")
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        hf_llama.build("huge")


# --- the same step, on the CPU ------------------------------------------------------------------------------

def _hf_step(mode, precision="fp32", **kwargs):
    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode=mode, precision=precision,
                             impl="hf-llama", **kwargs)
    assert isinstance(step.model, transformers.LlamaForCausalLM)
    return step, [p.detach().clone() for p in step.model.parameters()]


@needs_transformers
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_step_of_the_baseline_updates_every_parameter(precision):
    step, before = _hf_step("train-step", precision)
    step()
    after = list(step.model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(p.dtype == torch.float32 for p in after)  # fp32 master weights under autocast, as ours
    assert isinstance(step.optimizer, torch.optim.AdamW)


@needs_transformers
def test_forward_and_forward_backward_of_the_baseline():
    step, before = _hf_step("forward")
    step()
    assert not step.model.training
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(step.model.parameters(), before))
    step, before = _hf_step("forward-backward")
    step()
    step()  # grads are reset each step, not accumulated
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in step.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(step.model.parameters(), before))


@needs_transformers
def test_the_baseline_step_takes_our_loss_on_the_same_batch(monkeypatch):
    """Both implementations' steps compute F.cross_entropy of (B*T, V) logits against the same targets, and
    HF's forward is never handed labels (its own loss would shift them and upcast the logits)."""
    seen = {}
    original = F.cross_entropy

    def recording(logits, targets, *args, **kwargs):
        seen.setdefault("calls", []).append((tuple(logits.shape), targets.clone()))
        return original(logits, targets, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", recording)
    model_forward = transformers.LlamaForCausalLM.forward

    def no_labels(self, *args, **kwargs):
        assert kwargs.get("labels") is None and "labels" not in kwargs
        return model_forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", no_labels)
    for impl in ("own", "hf-llama"):
        workloads.lm_step(size="tiny", context=16, batch_size=2, mode="forward-backward", impl=impl)()
    (own_shape, own_targets), (hf_shape, hf_targets) = seen["calls"]
    assert own_shape == hf_shape == (2 * 16, 10_000)
    assert torch.equal(own_targets, hf_targets)


@needs_transformers
@pytest.mark.parametrize("mode", ["forward", "train-step"])
def test_baseline_attention_is_sdpa_is_causal_without_a_mask(monkeypatch, mode):
    calls = []
    original = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal, dropout_p, tuple(query.shape)))
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    step, _ = _hf_step(mode, "bf16")
    step()
    tiny = lm_model.SIZES["tiny"]
    assert len(calls) == tiny["n_layers"]
    head = tiny["d_model"] // tiny["n_heads"]
    assert all(mask is None and causal is True and dropout == 0.0 and shape == (2, tiny["n_heads"], 16, head)
               for mask, causal, dropout, shape in calls), calls


@needs_transformers
@pytest.mark.parametrize("impl", ["own", "hf-llama"])
def test_compiled_step_is_one_graph_per_layer_kind_for_both_implementations(impl):
    """Per-layer compilation, static shapes: one graph shared by every decoder layer plus one for the final
    norm, no graph break and no recompilation per layer, for the baseline as for our model."""
    from torch._dynamo.utils import counters

    step = workloads.lm_step(size="tiny", context=16, batch_size=2, mode="train-step", compile=True, impl=impl)
    counters.clear()
    step()
    step()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["frames"]["ok"] == 2 and counters["frames"]["total"] == 2


@needs_transformers
def test_compiled_baseline_matches_eager():
    torch.manual_seed(0)
    eager = hf_llama.build("tiny", context_length=16)
    compiled = hf_llama.build("tiny", context_length=16)
    compiled.load_state_dict(eager.state_dict())
    workloads.compile_each(hf_llama.compile_units(compiled))
    assert len(hf_llama.compile_units(compiled)) == lm_model.SIZES["tiny"]["n_layers"] + 1
    tokens = torch.randint(0, 10_000, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf_llama.logits(compiled, tokens), hf_llama.logits(eager, tokens),
                                   rtol=1e-4, atol=1e-4)


# --- without transformers ------------------------------------------------------------------------------------

def test_missing_transformers_is_a_reason_to_skip_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert hf_llama.unavailable_reason() == INSTALL_REASON
    assert workloads.unavailable_reason("hf-llama") == INSTALL_REASON
    assert workloads.unavailable_reason("own") is None
    with pytest.raises(hf_llama.BaselineUnavailable, match=r"pip install -e \.\[baselines\]"):
        workloads.lm_step(size="tiny", context=8, batch_size=1, mode="forward", impl="hf-llama")
    with pytest.raises(ValueError, match="unknown impl"):
        workloads.unavailable_reason("hf")


def test_too_old_transformers_is_named_in_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.1"))
    reason = hf_llama.unavailable_reason()
    assert reason.startswith("transformers 4.57.1 is installed") and "pip install -e .[baselines]" in reason


PERF_WITHOUT_TRANSFORMERS = "import sys\nsys.modules['transformers'] = None  # as if not installed\n"


@pytest.mark.slow  # an isolated perf session (~4 s)
def test_perf_suite_records_the_baseline_as_skipped_with_the_install_command(pytester, monkeypatch):
    """The real perf/test_end_to_end.py in a pytest session where transformers cannot be imported: our case
    runs, the baseline's is skipped with the reason, and the saved run records why it has no time."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    perf = pytester.mkdir("perf")
    (perf / "conftest.py").write_text((ROOT / "perf" / "conftest.py").read_text())
    (perf / "test_end_to_end.py").write_text(PERF_WITHOUT_TRANSFORMERS
                                             + (ROOT / "perf" / "test_end_to_end.py").read_text())
    grid = {"impls": ["own", "hf-llama"], "sizes": ["tiny"], "contexts": [8], "batch_sizes": [1],
            "modes": ["forward"], "precisions": ["fp32"], "compile": [False], "warmup": 0, "rounds": 1,
            "group": "g"}
    suites = {"end_to_end": {"profiles": {"cpu": [grid]}}, "warmup_study": {"profiles": {}},
              "checkpointing": {"profiles": {}}}  # the file's other suites, with no case
    (pytester.path / "benchmarks.json").write_text(json.dumps({"suites": suites}))
    result = pytester.runpytest_subprocess("perf", "--perf-profile=cpu", "-rs",
                                           "--benchmark-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    assert "SKIPPED [1] perf/test_end_to_end.py" in result.stdout.str() and INSTALL_REASON in result.stdout.str()
    data = json.loads((pytester.path / "out.json").read_text())
    assert [b["name"] for b in data["benchmarks"]] == ["test_end_to_end[tiny-ctx8-b1-forward-fp32-eager-sdpa-w0]"]
    (record,) = data["perf_not_timed"]
    assert record["name"] == "test_end_to_end[hf-llama-tiny-ctx8-b1-forward-fp32-eager-sdpa-w0]"
    assert record["reason"] == f"skipped: {INSTALL_REASON}"
