"""benchmarks.json: the declarative benchmark matrix, loaded and validated once.

Layout::

    {
      "suites": {
        "<suite>": {
          "description": "...",
          "profiles": {
            "cpu":  [ <grid>, ... ],      # each grid is a cartesian product of its list-valued axes
            "gpu":  [ <grid>, ... ],
            "full": [ <grid>, ... ]
          }
        }
      },
      "gates": [ ... ],                    # in-run ratio gates (`reporting.gates`)
      "regression": {                      # the statistical gate against a baseline (`reporting.significance`)
        "default": {"min_effect": 0.05, "alpha": 0.002},
        "groups": {"<group>": {"min_effect": 0.10, "min_abs_effect_s": 4e-6}}   # overrides per perf group
      }
    }

A grid maps axis names to lists of values (``"sizes": ["small", "xl"]``) and settings to scalars
(``"warmup": 5``).  A nullable axis takes ``null`` as one of its values (``"heads": [null]``: no heads
dimension).  A profile's cases are the union of its grids' products, duplicates removed, in
file order.  Every suite declares its schema in SUITE_SCHEMAS: an unknown suite, profile, key or a bad
value raises `MatrixError` naming where it is (``suites.end_to_end.profiles.gpu[1].sizes[2]``).

Rules checked at load time, so that nothing that loads can fail later inside a case or a rank:

* values have the type and range their workload needs (``sizes_mb``: finite, a whole number of float32
  elements, at least one; bucket sizes finite and positive; no bucket size on a variant without buckets;
  no fp16 on a sharded data-parallel variant; no graph timing of mode backward; an end-to-end baseline
  implementation such as hf-llama only with attention sdpa; the adamw-master optimizers only with bf16);
* a case's identity is its test id (`case_id`): two grids of one profile whose cases share an id but
  differ in a field the id leaves out (``rounds``, ``inner_iters``) are an error naming both grids, since
  pytest would rename them ``..._0`` / ``..._1`` and saved runs would no longer pair up.  Cases equal in
  every field except ``group`` are one case (listed by two groups), not a conflict;
* a gate names only case fields of its suite, with values its suite's grids contain (a typo would
  otherwise select nothing), and a finite positive ``max_ratio``.

A person changes what is measured by editing the JSON; no code changes.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.amp import PRECISIONS
from cs336_systems.attention.plan import FlashOptions
from cs336_systems.float8 import DEFAULT_PRECISION as DEFAULT_LINEAR_PRECISION
from cs336_systems.float8 import PRECISIONS as LINEAR_PRECISIONS
from cs336_systems.bench.workloads.attention import DTYPES as ATTENTION_DTYPES
from cs336_systems.bench.workloads.attention import MODES as ATTENTION_MODES
from cs336_systems.bench.workloads.lm import DEFAULT_IMPL as LM_DEFAULT_IMPL
from cs336_systems.bench.workloads.lm import IMPLS as LM_IMPLS
from cs336_systems.bench.workloads.lm import OPTIMIZERS as LM_OPTIMIZERS
from cs336_systems.bench.workloads.lm import DEFAULT_OPTIMIZER as LM_DEFAULT_OPTIMIZER
from cs336_systems.bench.workloads.lm import MASTER_FORMAT as LM_MASTER_FORMAT
from cs336_systems.bench.workloads.lm import MODES as LM_MODES
from cs336_systems.bench.workloads.lm import PACKINGS as LM_PACKINGS
from cs336_systems.bench.workloads.packed_attention import IMPLS as PACKED_IMPLS
from cs336_systems.bench.workloads.packed_attention import MODES as PACKED_MODES
from cs336_systems.model import SIZES

PROFILES = ("cpu", "gpu", "full")
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "benchmarks.json"


class MatrixError(ValueError):
    """benchmarks.json is malformed; the message names the offending key or value."""


# --- value validators: each returns the value or raises MatrixError(f"{where}: ...") -----------------

Validator = Callable[[object, str], object]


def _positive_int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MatrixError(f"{where}: expected a positive integer, got {value!r}")
    return value


def _non_negative_int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MatrixError(f"{where}: expected an integer >= 0, got {value!r}")
    return value


def _boolean(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MatrixError(f"{where}: expected true or false, got {value!r}")
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise MatrixError(f"{where}: expected a non-empty string, got {value!r}")
    return value


GROUP_SEPARATOR = ","  # --perf-group=a,b splits on it


def _group_name(value: object, where: str) -> str:
    """A group name: a non-empty string without `GROUP_SEPARATOR` or surrounding spaces (``--perf-group``
    splits on the one and strips the other, so such a group could never be selected)."""
    name = _string(value, where)
    if GROUP_SEPARATOR in name or name != name.strip():
        raise MatrixError(f"{where}: group name {name!r} cannot be selected: --perf-group splits on "
                          f"{GROUP_SEPARATOR!r} and strips spaces")
    return name


def _flash_options(value: object, where: str) -> str:
    """flash-triton's explicit kernel choices as `FlashOptions.text` ("" for the plan's defaults), e.g.
    "fused_bwd=off" or "hopper_fwd=on,tma=off"."""
    if not isinstance(value, str):
        raise MatrixError(f"{where}: expected a FlashOptions string such as \"fused_bwd=off\", got {value!r}")
    try:
        return FlashOptions.parse(value).text()
    except (TypeError, ValueError) as exc:
        raise MatrixError(f"{where}: {exc}") from None


def _optional(check: Validator) -> Validator:
    """``check``, or None (JSON null) meaning "absent" (e.g. no heads dimension)."""

    def nullable(value: object, where: str) -> object:
        return None if value is None else check(value, where)

    return nullable


def _one_of(valid: Callable[[], list[str]] | tuple[str, ...]) -> Validator:
    def check(value: object, where: str) -> str:
        options = list(valid() if callable(valid) else valid)
        if value not in options:
            raise MatrixError(f"{where}: unknown value {value!r}; valid: {', '.join(map(str, options))}")
        return value  # type: ignore[return-value]

    return check


def _attention_names() -> list[str]:
    from cs336_systems import attention

    return attention.names()


@dataclass(frozen=True)
class Key:
    """One grid key: ``axis`` keys take a non-empty list (one case per value), others a scalar."""

    check: Validator
    axis: bool
    required: bool = True
    default: object = None


_LM_GRID = {
    "sizes": Key(_one_of(lambda: list(SIZES)), axis=True),
    "contexts": Key(_positive_int, axis=True),
    "batch_sizes": Key(_positive_int, axis=True),
    "modes": Key(_one_of(LM_MODES), axis=True),
    "precisions": Key(_one_of(tuple(PRECISIONS)), axis=True),
    "compile": Key(_boolean, axis=True),
    "attention": Key(_one_of(_attention_names), axis=True, required=False, default=["sdpa"]),
    "warmup": Key(_non_negative_int, axis=False),
    "rounds": Key(_positive_int, axis=False),
    "group": Key(_group_name, axis=False, required=False, default="default"),
}

def _checkpoint_policy(value: object, where: str) -> str:
    from cs336_systems.checkpointing import CheckpointPolicy

    try:
        return str(CheckpointPolicy.parse(value))
    except (TypeError, ValueError) as exc:
        raise MatrixError(f"{where}: {exc}") from None


# The end-to-end suite also sweeps the implementation of the model (cs336_systems.bench.workloads.lm.IMPLS):
# "own" (cs336_systems.model, the default) or a baseline of the same size ("hf-llama": transformers'
# LlamaForCausalLM), so that both are timed in one run; and the optimizer of the train step ("adamw": torch's
# fused AdamW over float32 weights, the default; "adamw-master": bf16 compute weights with float32 masters in
# cs336_systems.optim.AdamWMaster, kept split into the weight and its low bits; "adamw-master-fp32": the same
# with float32 copies; both bf16 precision only).
# "cuda_graphs": the compiled units replayed as CUDA graphs (compile true only; ids gain "cudagraphs").
# "packings" (cs336_systems.bench.workloads.lm.PACKINGS): "none", the dense (batch, context) rows; "packed",
# the batch's tokens as `documents` documents in one row (flash-triton only); "padded", the same documents
# one per row, each padded to the context (ids gain "packed-docs<D>" / "padded-docs<D>").
_E2E_GRID = {**_LM_GRID, "impls": Key(_one_of(LM_IMPLS), axis=True, required=False, default=[LM_DEFAULT_IMPL]),
             "optimizers": Key(_one_of(LM_OPTIMIZERS), axis=True, required=False, default=[LM_DEFAULT_OPTIMIZER]),
             "cuda_graphs": Key(_boolean, axis=True, required=False, default=[False]),
             "packings": Key(_one_of(LM_PACKINGS), axis=True, required=False, default=["none"]),
             # the Linear layers' GEMMs: "bf16" (autocast's) or torchao's float8 recipes (cs336_systems.float8)
             "linear_precisions": Key(_one_of(LINEAR_PRECISIONS), axis=True, required=False,
                                      default=[DEFAULT_LINEAR_PRECISION]),
             "documents": Key(_positive_int, axis=False, required=False, default=16)}

# Activation checkpointing (model.build(checkpoint=...)): the LM grid with a policy axis.
_CHECKPOINT_GRID = {**_LM_GRID, "checkpoints": Key(_checkpoint_policy, axis=True)}

# The warm-up study reuses the LM grid but sweeps the number of warm-up rounds.
_WARMUP_GRID = {**_LM_GRID, "warmup": Key(_non_negative_int, axis=True)}

# Attention alone (cs336_systems.bench.workloads.attention): q, k, v of shape (B, N, d), or (B, H, N, d) when
# "heads" is a number; Nq = Nk = N.  "compile" wraps the registered function in
# torch.compile(fullgraph=True); "flush_l2" zeroes a 256 MiB buffer before every round (untimed), as
# triton.testing.do_bench does; "timings" picks how a round is timed (`cs336_systems.bench.harness`: "host",
# the synchronizing clock, "device", CUDA events as do_bench, or "graph", CUDA events around CUDA-graph
# replays of the step, as do_bench_cudagraph; not with mode "backward").  The attention, flash and leaderboard
# suites share this schema and differ in their values (benchmarks.json).
_ATTENTION_GRID = {
    "impls": Key(_one_of(_attention_names), axis=True),
    "batch_sizes": Key(_positive_int, axis=True),
    "heads": Key(_optional(_positive_int), axis=True, required=False, default=[None]),
    # K/V heads for grouped-query attention (a divisor of heads; null: as many as the query heads)
    "kv_heads": Key(_optional(_positive_int), axis=True, required=False, default=[None]),
    "seq_lens": Key(_positive_int, axis=True),
    "head_dims": Key(_positive_int, axis=True),
    "dtypes": Key(_one_of(ATTENTION_DTYPES), axis=True),
    "causal": Key(_boolean, axis=True),
    "modes": Key(_one_of(ATTENTION_MODES), axis=True),
    "compile": Key(_boolean, axis=True, required=False, default=[False]),
    # flash-triton's kernel choices passed explicitly (`cs336_systems.attention.plan.FlashOptions`), for A/B
    # runs in one session; "" (the default): the plan's rules.  Other implementations ignore it.
    "flash_options": Key(_flash_options, axis=True, required=False, default=[""]),
    "flush_l2": Key(_boolean, axis=False, required=False, default=False),
    "timings": Key(_one_of(("host", "device", "graph")), axis=True, required=False, default=["host"]),
    "warmup": Key(_non_negative_int, axis=False),
    "rounds": Key(_positive_int, axis=False),
    "group": Key(_group_name, axis=False, required=False, default="default"),
}

# Packed attention (bench/workloads/packed_attention.py): `docs` documents of a fixed long-tailed draw summing
# to `total` tokens in one row, attention within each, by implementation (ids: impl-t<total>-docs<D>-h-d-...).
_PACKED_ATTENTION_GRID = {
    "impls": Key(_one_of(PACKED_IMPLS), axis=True),
    "totals": Key(_positive_int, axis=True),
    "docs": Key(_positive_int, axis=True),
    "heads": Key(_positive_int, axis=True),
    "head_dims": Key(_positive_int, axis=True),
    "dtypes": Key(_one_of(ATTENTION_DTYPES), axis=True),
    "causal": Key(_boolean, axis=True),
    "modes": Key(_one_of(PACKED_MODES), axis=True),
    "timings": Key(_one_of(("host", "device")), axis=True, required=False, default=["host"]),
    "warmup": Key(_non_negative_int, axis=False),
    "rounds": Key(_positive_int, axis=False),
    "group": Key(_group_name, axis=False, required=False, default="default"),
}


def _positive_number(value: object, where: str) -> float:
    """A finite number > 0 (JSON's Infinity and NaN load as floats; neither is a size)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise MatrixError(f"{where}: expected a positive number, got {value!r}")
    return value


MiB = 2**20


def _float32_mib(value: object, where: str) -> float:
    """A tensor size in MiB that `allreduce_case` can build: ``int(value * 2**20)`` bytes, a positive multiple
    of 4 (whole float32 elements, at least one)."""
    _positive_number(value, where)
    nbytes = int(value * MiB)
    if nbytes < 4 or nbytes % 4:
        raise MatrixError(f"{where}: {value!r} MiB is {value * MiB:.10g} bytes; the all-reduce needs a positive whole "
                          "number of float32 elements (a multiple of 4 bytes, at least 4)")
    return value


def _data_parallel_variants() -> tuple[str, ...]:
    from cs336_systems.bench.workloads.data_parallel import VARIANTS
    return VARIANTS


# Collectives (cs336_systems.bench.workloads.allreduce): one all-reduce of a float32 tensor of size_mb MiB on
# world_size ranks (spawned locally, or the torchrun job's ranks), inner_iters back-to-back per round.
_ALLREDUCE_GRID = {
    "backends": Key(_one_of(("gloo", "nccl")), axis=True),
    "sizes_mb": Key(_float32_mib, axis=True),
    "world_sizes": Key(_positive_int, axis=True),
    "inner_iters": Key(_positive_int, axis=False, required=False, default=1),
    "warmup": Key(_non_negative_int, axis=False),
    "rounds": Key(_positive_int, axis=False),
    "group": Key(_group_name, axis=False, required=False, default="default"),
}

# Data-parallel training steps (cs336_systems.bench.workloads.data_parallel): LM size x context x per-rank
# batch x precision x variant (x bucket size for the bucketed variants; null = not bucketed / one bucket).
_DATA_PARALLEL_GRID = {
    "variants": Key(_one_of(_data_parallel_variants), axis=True),
    "bucket_sizes_mb": Key(_optional(_positive_number), axis=True, required=False, default=[None]),
    "sizes": Key(_one_of(lambda: list(SIZES)), axis=True),
    "contexts": Key(_positive_int, axis=True),
    "batch_sizes": Key(_positive_int, axis=True),
    "precisions": Key(_one_of(tuple(PRECISIONS)), axis=True),
    "world_sizes": Key(_positive_int, axis=True),
    "backends": Key(_one_of(("gloo", "nccl")), axis=True),
    "warmup": Key(_non_negative_int, axis=False),
    "rounds": Key(_positive_int, axis=False),
    "group": Key(_group_name, axis=False, required=False, default="default"),
}

SUITE_SCHEMAS: dict[str, dict[str, Key]] = {
    "end_to_end": _E2E_GRID,
    "warmup_study": _WARMUP_GRID,
    "checkpointing": _CHECKPOINT_GRID,
    "attention": _ATTENTION_GRID,
    "flash": _ATTENTION_GRID,
    "leaderboard": _ATTENTION_GRID,
    "packed_attention": _PACKED_ATTENTION_GRID,
    "allreduce": _ALLREDUCE_GRID,
    "data_parallel": _DATA_PARALLEL_GRID,
}

# Axis key (plural, in the JSON) -> case field (singular, in the expanded case).
_SINGULAR = {
    "sizes": "size",
    "contexts": "context",
    "batch_sizes": "batch_size",
    "modes": "mode",
    "precisions": "precision",
    "compile": "compile",
    "cuda_graphs": "cuda_graphs",
    "packings": "packing",
    "linear_precisions": "linear_precision",
    "totals": "total",
    "docs": "docs",
    "attention": "attention",
    "warmup": "warmup",
    "impls": "impl",
    "optimizers": "optimizer",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "seq_lens": "seq_len",
    "head_dims": "head_dim",
    "dtypes": "dtype",
    "causal": "causal",
    "backends": "backend",
    "checkpoints": "checkpoint",
    "sizes_mb": "size_mb",
    "world_sizes": "world_size",
    "variants": "variant",
    "bucket_sizes_mb": "bucket_size_mb",
    "timings": "timing",
    "flash_options": "flash_options",
}


# Case field -> how it appears in a test id, in id order.  A case shows only the fields it has, so LM
# ids (small-ctx128-b4-forward-bf16-eager-sdpa-w5) and attention ids
# (naive-b8-n1024-d64-backward-fp32-full-eager-w5) share one table.  Fields left out (rounds, inner_iters,
# group) say how long or in which run a case is measured, not which case it is.  An LM case's impl shows only
# when it is a baseline (hf-llama-xl-ctx512-...): our own model's ids are the ids saved before the impl axis.
_ID_FORMAT = (
    ("impl", "{}"), ("size", "{}"), ("context", "ctx{}"), ("batch_size", "b{}"), ("heads", "h{}"),
    ("kv_heads", "kv{}"), ("total", "t{}"), ("docs", "docs{}"), ("seq_len", "n{}"), ("head_dim", "d{}"),
    ("mode", "{}"), ("precision", "{}"), ("linear_precision", None), ("dtype", "{}"),
    ("causal", None), ("compile", None), ("cuda_graphs", None), ("packing", None), ("attention", "{}"),
    ("checkpoint", "ckpt-{}"), ("optimizer", "{}"),
    ("backend", "{}"),
    ("variant", "{}"), ("bucket_size_mb", "bucket{}MiB"), ("size_mb", "{}MiB"), ("world_size", "ranks{}"),
    ("flash_options", "opts-{}"), ("warmup", "w{}"), ("flush_l2", None), ("timing", None),
)


def case_id(case: dict) -> str:
    """A case's readable, stable test id and its identity: values joined in a fixed order
    (e.g. small-ctx128-b4-forward-bf16-eager).  Saved runs pair cases by it."""
    parts = []
    for key, fmt in _ID_FORMAT:
        if key not in case or case[key] is None:  # heads=None: no heads dimension
            continue
        if key == "compile":
            parts.append("compiled" if case[key] else "eager")
        elif key == "causal":
            parts.append("causal" if case[key] else "full")
        elif key == "flush_l2":
            if case[key]:
                parts.append("l2flush")
        elif key == "impl" and "size" in case and case[key] == LM_DEFAULT_IMPL:
            continue  # our own LM (an LM case has a size; an attention case's impl is always shown)
        elif key == "cuda_graphs":
            if case[key]:  # without CUDA graphs: the ids saved before the axis
                parts.append("cudagraphs")
        elif key == "linear_precision":
            if case[key] != DEFAULT_LINEAR_PRECISION:  # the ids saved before the axis
                parts.append(case[key])
        elif key == "packing":
            if case[key] != "none":  # dense rows: the ids saved before the axis
                parts.append(f"{case[key]}-docs{case['documents']}")
        elif key == "optimizer" and case[key] == LM_DEFAULT_OPTIMIZER:
            continue  # the ids saved before the optimizer axis
        elif key == "timing":
            if case[key] != "host":  # the default keeps the ids saved before timings existed
                parts.append(f"{case[key]}time")
        elif key == "flash_options":
            if case[key]:  # the defaults keep the ids saved before the axis
                parts.append(fmt.format(case[key]))
        else:
            parts.append(fmt.format(case[key]))
    return "-".join(parts)


def _check_keys(obj: object, where: str, allowed: set[str], required: set[str]) -> dict:
    if not isinstance(obj, dict):
        raise MatrixError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise MatrixError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(obj))
    if missing:
        raise MatrixError(f"{where}: missing required key {missing[0]!r}")
    return obj


def _validate_grid(grid: object, schema: dict[str, Key], where: str) -> dict:
    required = {name for name, key in schema.items() if key.required}
    grid = _check_keys(grid, where, set(schema), required)
    out = {}
    for name, key in schema.items():
        value = grid.get(name, key.default)
        if key.axis:
            if not isinstance(value, list) or not value:
                raise MatrixError(f"{where}.{name}: expected a non-empty list, got {value!r}")
            out[name] = [key.check(v, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
        else:
            out[name] = key.check(value, f"{where}.{name}")
    for rule in _GRID_RULES:
        rule(out, where)
    return out


# --- combinations a workload refuses: checked per grid, so the case fails at load time, not in a rank -------

# `DistributedTrainStep` (bench/workloads/data_parallel.py) takes a bucket size only for these variants, and
# refuses fp16 (GradScaler, whose skip decision would differ between ranks) for the sharded ones.
BUCKETED_VARIANTS = ("bucketed", "zero-broadcast")
NO_FP16_VARIANTS = ("zero-broadcast", "zero1", "fsdp", "torch-zero", "torch-fsdp2")


def _graph_needs_no_untimed_forward(grid: dict, where: str) -> None:
    if "graph" in grid.get("timings", ()) and "backward" in grid.get("modes", ()):
        # a graph replays one captured step: the untimed forward before a timed backward cannot run between
        # replays (cs336_systems.bench.harness, timing="graph"); the case could never run
        raise MatrixError(f"{where}: timings 'graph' cannot time mode 'backward' (its forward runs untimed "
                          "before every round); use modes forward / forward-backward, or timings device")


def _bucket_sizes_only_on_bucketed_variants(grid: dict, where: str) -> None:
    sizes = [s for s in grid.get("bucket_sizes_mb", ()) if s is not None]
    other = [v for v in grid.get("variants", ()) if v not in BUCKETED_VARIANTS]
    if sizes and other:
        raise MatrixError(f"{where}: bucket_sizes_mb {sizes} apply only to variants {', '.join(BUCKETED_VARIANTS)}, "
                          f"but the grid also crosses them with {other}; put those variants in a grid of their own")


def _no_fp16_on_sharded_variants(grid: dict, where: str) -> None:
    sharded = [v for v in grid.get("variants", ()) if v in NO_FP16_VARIANTS]
    if sharded and "fp16" in grid.get("precisions", ()):
        raise MatrixError(f"{where}: precision 'fp16' (GradScaler) is not supported with variants {sharded}: "
                          "ranks would skip different steps; use bf16 or fp32")


def _baselines_run_sdpa_only(grid: dict, where: str) -> None:
    if "attention" not in grid:  # not an LM grid (attention grids name kernels in "impls")
        return
    baselines = [i for i in grid.get("impls", ()) if i != LM_DEFAULT_IMPL]
    other = [a for a in grid["attention"] if a != "sdpa"]
    if baselines and other:
        # transformers' attention is its own attn_implementation ("sdpa"), not one of our kernels
        raise MatrixError(f"{where}: impls {baselines} run attention 'sdpa' only, but the grid also crosses them "
                          f"with attention {other}; put those in a grid of their own")


def _master_weights_need_bf16(grid: dict, where: str) -> None:
    other = [p for p in grid.get("precisions", ()) if p != "bf16"]
    masters = [o for o in grid.get("optimizers", ()) if o in LM_MASTER_FORMAT]
    if masters and other:
        # AdamWMaster's compute weights are bf16 (cs336_systems.bench.workloads.lm.check_optimizer)
        raise MatrixError(f"{where}: optimizers {masters} need precision 'bf16' only, but the grid also "
                          f"crosses them with precisions {other}")


def _cuda_graphs_need_compile(grid: dict, where: str) -> None:
    if True in grid.get("cuda_graphs", ()) and False in grid.get("compile", ()):
        # inductor records the compiled units (cs336_systems.bench.workloads.lm.check_cuda_graphs)
        raise MatrixError(f"{where}: cuda_graphs [true] needs compile [true] only, but the grid also crosses it "
                          "with compile false; put the eager cases in a grid of their own")


def _packing_needs_our_model_and_flash_triton(grid: dict, where: str) -> None:
    packed = [p for p in grid.get("packings", ()) if p != "none"]
    if not packed:
        return
    if [i for i in grid.get("impls", ()) if i != LM_DEFAULT_IMPL]:
        raise MatrixError(f"{where}: packings {packed} run our model only (impls ['own'])")
    if "packed" in packed and [a for a in grid.get("attention", ()) if a != "flash-triton"]:
        # packed rows attend within each document through flash_attention_varlen (model.Packing)
        raise MatrixError(f"{where}: packing 'packed' needs attention ['flash-triton'] only")
    documents = grid.get("documents", 16)
    smallest = min(grid.get("contexts", (documents,))) * min(grid.get("batch_sizes", (1,)))
    if documents < max(grid.get("batch_sizes", (1,))) or documents > smallest:
        # a batch's tokens as documents of at most one context each (workloads.lm.document_lengths), and at
        # least one token a document
        raise MatrixError(f"{where}: documents {documents} must be at least the largest batch size and at most "
                          f"the smallest batch's tokens ({smallest})")


def _float8_needs_bf16(grid: dict, where: str) -> None:
    fp8 = [p for p in grid.get("linear_precisions", ()) if p != DEFAULT_LINEAR_PRECISION]
    other = [p for p in grid.get("precisions", ()) if p != "bf16"]
    if fp8 and other:
        # torchao's Float8Linear trains under bf16 autocast (cs336_systems.bench.workloads.lm)
        raise MatrixError(f"{where}: linear_precisions {fp8} need precision 'bf16' only, but the grid also crosses "
                          f"them with precisions {other}")


def _kv_heads_divide_heads(grid: dict, where: str) -> None:
    kv_heads = [h for h in grid.get("kv_heads", ()) if h is not None]
    if not kv_heads:
        return
    bad = [(h, kv) for h in grid.get("heads", ()) for kv in kv_heads if h is None or h % kv]
    if bad:
        # grouped-query attention pairs each K/V head with heads / kv_heads query heads
        raise MatrixError(f"{where}: kv_heads must divide heads (grouped-query attention); heads {bad[0][0]} with "
                          f"kv_heads {bad[0][1]} cannot be grouped")


_GRID_RULES = (_graph_needs_no_untimed_forward, _bucket_sizes_only_on_bucketed_variants, _no_fp16_on_sharded_variants,
               _baselines_run_sdpa_only, _kv_heads_divide_heads, _master_weights_need_bf16, _cuda_graphs_need_compile,
               _packing_needs_our_model_and_flash_triton, _float8_needs_bf16)


def case_fields(suite: str) -> set[str]:
    """The field names of a suite's expanded cases (axis keys singular, settings as they are)."""
    return {_SINGULAR.get(name, name) if key.axis else name for name, key in SUITE_SCHEMAS[suite].items()}


def _schema_key(suite: str, field: str) -> Key:
    """The schema key of ``suite`` that produces case field ``field``."""
    for name, key in SUITE_SCHEMAS[suite].items():
        if (_SINGULAR.get(name, name) if key.axis else name) == field:
            return key
    raise KeyError(field)


def _same(a: object, b: object) -> bool:
    """Equal as case values: 100 and 100.0 are, True and 1 are not."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _grid_values(grids: list[dict], suite: str, field: str) -> list:
    """The values ``field`` takes in ``grids`` (validated, defaults filled in), in file order."""
    values: list = []
    for grid in grids:
        for name, value in grid.items():
            key = SUITE_SCHEMAS[suite][name]
            if (_SINGULAR.get(name, name) if key.axis else name) != field:
                continue
            for v in value if key.axis else [value]:
                if not any(_same(v, seen) for seen in values):
                    values.append(v)
    return values


def _validate_gate(gate: object, where: str, suites: dict[str, dict[str, list[dict]]]) -> dict:
    """A ratio gate (`cs336_systems.reporting.gates`): numerator cases over their denominator twins <= max_ratio.

    Every field a gate names must be a case field of its suite, and every value must pass that field's
    check and occur in the suite's grids (in any profile): a typo (``"variant": "buckted"``, ``"0.05"`` for
    a number) would otherwise match no case and disable the gate.  ``max_ratio`` must be finite and > 0.
    """
    gate = _check_keys(
        gate, where,
        {"name", "suite", "where", "numerator", "denominator", "max_ratio", "statistic"},
        {"name", "suite", "numerator", "denominator", "max_ratio"},
    )
    name = _string(gate["name"], f"{where}.name")
    suite = _one_of(tuple(SUITE_SCHEMAS))(gate["suite"], f"{where}.suite")
    fields = case_fields(suite)
    grids = [g for profile in suites.get(suite, {}).values() for g in profile]
    for side in ("where", "numerator", "denominator"):
        if side == "where" and side not in gate:
            continue
        if not isinstance(gate[side], dict) or (side != "where" and not gate[side]):
            raise MatrixError(f"{where}.{side}: expected a non-empty object of case fields")
        unknown = sorted(set(gate[side]) - fields)
        if unknown:
            raise MatrixError(
                f"{where}.{side}: unknown case field {unknown[0]!r}; valid: {', '.join(sorted(fields))}"
            )
        for field, value in gate[side].items():
            path = f"{where}.{side}.{field}"
            try:
                _schema_key(suite, field).check(value, path)
            except MatrixError as exc:
                raise MatrixError(f"{exc} (gate {name!r})") from None
            present = _grid_values(grids, suite, field)
            if not any(_same(value, v) for v in present):
                listed = ", ".join(json.dumps(v) for v in present) or "none"
                raise MatrixError(f"{path}: value {json.dumps(value)} occurs in no grid of suite {suite!r} "
                                  f"(values there: {listed}); the gate would match no case (gate {name!r})")
    if {**gate.get("where", {}), **gate["numerator"]} == {**gate.get("where", {}), **gate["denominator"]}:
        raise MatrixError(f"{where}: numerator and denominator name the same cases, so the gate would compare each "
                          f"case with itself and always pass at 1.000 (gate {name!r})")
    ratio = gate["max_ratio"]
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < math.inf:
        raise MatrixError(f"{where}.max_ratio: expected a finite positive number, got {ratio!r} (gate {name!r})")
    _one_of(("median", "mean", "min", "peak_memory_gib"))(gate.get("statistic", "median"), f"{where}.statistic")
    return gate


@dataclass(frozen=True)
class GateSettings:
    """The statistical gate's settings for one perf group (`reporting.significance`): ``min_effect``, the
    smallest relative change of a case's median that counts (0.05: 5%), ``alpha``, the significance
    level of the Mann-Whitney test, and ``min_abs_effect_s``, the smallest absolute change of the median
    that counts, in seconds (0: none): a case's threshold is the larger of the two, so calls of a few
    microseconds, whose medians move by a fixed amount between runs, are held to that amount."""

    min_effect: float = 0.05
    alpha: float = 0.002
    min_abs_effect_s: float = 0.0

    def __post_init__(self) -> None:
        for name, high in (("min_effect", 1.0), ("alpha", 0.5)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < high:
                raise MatrixError(f"{name} must be a number in (0, {high:g}), got {value!r}")
        value = self.min_abs_effect_s
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise MatrixError(f"min_abs_effect_s must be a number of seconds in [0, 1), got {value!r}")

    def threshold(self, baseline_median_s: float) -> float:
        """The relative change that counts for a case whose baseline median is ``baseline_median_s``."""
        if self.min_abs_effect_s and baseline_median_s > 0:
            return max(self.min_effect, self.min_abs_effect_s / baseline_median_s)
        return self.min_effect

    def label(self) -> str:
        """As the verdict tables show the settings: "5%, 0.002", "+ 4 us" where an absolute floor is set."""
        floor = f" + {self.min_abs_effect_s * 1e6:g} us" if self.min_abs_effect_s else ""
        return f"{self.min_effect:.0%}{floor}, {self.alpha:g}"


def _validate_regression(body: object, groups: set[str]) -> tuple[GateSettings, dict[str, GateSettings], tuple]:
    """benchmarks.json "regression": the default settings, per-group overrides (each group one that a grid
    names: a typo would otherwise leave its group on the default in silence) and per-case overrides
    ("cases": [{"group": G, "match": {case field: value, ...}, settings...}], on top of their group's)."""
    body = _check_keys(body, "regression", {"default", "groups", "cases", "$comment"}, set())

    def settings(obj: object, where: str, base: GateSettings, extra: frozenset = frozenset()) -> GateSettings:
        obj = _check_keys(obj, where, {"min_effect", "alpha", "min_abs_effect_s", "$comment"} | extra, set())
        try:
            return GateSettings(obj.get("min_effect", base.min_effect), obj.get("alpha", base.alpha),
                                obj.get("min_abs_effect_s", base.min_abs_effect_s))
        except MatrixError as exc:
            raise MatrixError(f"{where}: {exc}") from None

    def known(group: object, where: str) -> str:
        if group not in groups:
            raise MatrixError(f"{where}: no grid has group {group!r}; groups: {', '.join(sorted(groups))}")
        return group

    default = settings(body.get("default", {}), "regression.default", GateSettings())
    named = body.get("groups", {})
    if not isinstance(named, dict):
        raise MatrixError("regression.groups: expected an object of group -> settings")
    per_group = {known(group, f"regression.groups.{group}"): settings(obj, f"regression.groups.{group}", default)
                 for group, obj in named.items()}
    listed = body.get("cases", [])
    if not isinstance(listed, list):
        raise MatrixError("regression.cases: expected a list of {group, match, settings}")
    per_case = []
    for i, obj in enumerate(listed):
        where = f"regression.cases[{i}]"
        if not isinstance(obj, dict) or "group" not in obj or "match" not in obj:
            raise MatrixError(f"{where}: expected an object with \"group\", \"match\" and settings")
        group = known(obj["group"], f"{where}.group")
        match = obj["match"]
        if (not isinstance(match, dict) or not match
                or not all(isinstance(v, (str, int, float, bool)) for v in match.values())):
            raise MatrixError(f"{where}.match: expected a non-empty object of case field -> value, got {match!r}")
        per_case.append((group, dict(match), settings(obj, where, per_group.get(group, default),
                                                      frozenset({"group", "match"}))))
    return default, per_group, tuple(per_case)


@dataclass(frozen=True)
class Matrix:
    """The validated matrix: suite -> profile -> grids, plus gates and the statistical gate's settings."""

    suites: dict[str, dict[str, list[dict]]]
    descriptions: dict[str, str]
    gates: list[dict]
    regression_default: GateSettings = GateSettings()
    regression_groups: dict[str, GateSettings] = dataclasses.field(default_factory=dict)
    # (group, {case field: value}, settings): "regression.cases", first match wins
    regression_cases: tuple = ()

    def gate_settings(self, group: str, fields: Mapping | None = None) -> GateSettings:
        """The statistical gate's settings for a case of a perf group: the first per-case override whose
        group is ``group`` and whose every match field equals the case's (``fields``: its extra_info), else
        the group's override, else the default."""
        for case_group, match, settings in self.regression_cases:
            if case_group == group and fields is not None and all(fields.get(k) == v for k, v in match.items()):
                return settings
        return self.regression_groups.get(group, self.regression_default)

    def cases(self, suite: str, profile: str, groups: set[str] | None = None) -> list[dict]:
        """Expanded cases of a suite under a profile: one dict per case, singular field names.

        A case listed by several grids is kept once, with the first grid's ``group``.  ``groups``: only the
        grids of these groups are expanded, before duplicates are merged, so a case that an earlier grid of
        another group also lists still runs when its own group is selected (a group's same-run baselines).
        """
        if suite not in self.suites:
            raise ValueError(f"unknown suite {suite!r}; valid: {', '.join(self.suites)}")
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
        seen: dict[tuple, dict] = {}
        for grid in self.suites[suite].get(profile, []):
            if groups is not None and grid.get("group") not in groups:
                continue
            for case in _expand(grid):
                seen.setdefault(_identity(case), case)
        return list(seen.values())

    def groups(self, profile: str) -> list[str]:
        """The groups of a profile's grids, in file order."""
        found: list[str] = []
        for profiles in self.suites.values():
            for grid in profiles.get(profile, []):
                if grid["group"] not in found:
                    found.append(grid["group"])
        return found


def _expand(grid: dict):
    """The cases of one validated grid: the product of its axes, singular field names, settings as they are."""
    axes = [name for name in grid if isinstance(grid[name], list)]
    scalars = {name: value for name, value in grid.items() if not isinstance(value, list)}
    for values in itertools.product(*(grid[name] for name in axes)):
        yield {**{_SINGULAR[n]: v for n, v in zip(axes, values)}, **scalars}


def _identity(case: dict) -> tuple:
    """What makes two expanded cases the same case: every field but the group that lists it."""
    return tuple(sorted((k, v) for k, v in case.items() if k != "group"))


def _check_unique_ids(grids: list[dict], where: str) -> None:
    """Two cases of one profile with one test id must be one case (see the module docstring)."""
    first: dict[str, tuple[int, dict]] = {}
    for index, grid in enumerate(grids):
        for case in _expand(grid):
            cid = case_id(case)
            if cid not in first:
                first[cid] = (index, case)
                continue
            other_index, other = first[cid]
            if _identity(other) != _identity(case):
                differ = sorted(k for k in case if k != "group" and other.get(k) != case.get(k))
                shown = ", ".join(f"{k}: {other.get(k)!r} vs {case.get(k)!r}" for k in differ)
                raise MatrixError(
                    f"{where}[{other_index}] and {where}[{index}] both give case {cid!r}, differing only in "
                    f"{shown}, which the case id leaves out; pytest would rename them ..._0 / ..._1 and saved "
                    "runs would no longer pair up. Give the case one setting, in one grid")


def parse(data: object) -> Matrix:
    """Validate the decoded JSON of benchmarks.json."""
    data = _check_keys(data, "benchmarks.json", {"suites", "gates", "regression", "$comment"}, {"suites"})
    if not isinstance(data["suites"], dict):
        raise MatrixError("suites: expected an object")
    suites, descriptions = {}, {}
    for suite, body in data["suites"].items():
        where = f"suites.{suite}"
        if suite not in SUITE_SCHEMAS:
            raise MatrixError(f"{where}: unknown suite {suite!r}; valid: {', '.join(SUITE_SCHEMAS)}")
        body = _check_keys(body, where, {"description", "profiles"}, {"profiles"})
        descriptions[suite] = body.get("description", "")
        profiles = _check_keys(body["profiles"], f"{where}.profiles", set(PROFILES), set())
        suites[suite] = {}
        for profile, grids in profiles.items():
            pwhere = f"{where}.profiles.{profile}"
            if not isinstance(grids, list):
                raise MatrixError(f"{pwhere}: expected a list of grids, got {type(grids).__name__}")
            suites[suite][profile] = [
                _validate_grid(g, SUITE_SCHEMAS[suite], f"{pwhere}[{i}]") for i, g in enumerate(grids)
            ]
            _check_unique_ids(suites[suite][profile], pwhere)
    gates = data.get("gates", [])
    if not isinstance(gates, list):
        raise MatrixError("gates: expected a list")
    all_groups = {grid["group"] for profiles in suites.values() for grids in profiles.values() for grid in grids}
    default, per_group, per_case = _validate_regression(data.get("regression", {}), all_groups)
    return Matrix(suites, descriptions, [_validate_gate(g, f"gates[{i}]", suites) for i, g in enumerate(gates)],
                  default, per_group, per_case)


class _DuplicateKey(Exception):
    def __init__(self, key: str, keys: list[str]) -> None:
        self.key, self.keys = key, keys


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: an object that names a key twice (JSON would keep the last value in silence, e.g. a
    second "gates" list replacing the first) is an error."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key, [k for k, _ in pairs])
        seen.add(key)
    return dict(pairs)


def loads(text: str, source: str = "benchmarks.json") -> object:
    """Decode benchmarks.json text, refusing invalid JSON and duplicate keys (MatrixError naming the key and
    the lines where it occurs)."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise MatrixError(f"{source}: invalid JSON: {exc}") from None
    except _DuplicateKey as dup:
        lines = [str(i) for i, line in enumerate(text.splitlines(), 1) if f'"{dup.key}"' in line]
        raise MatrixError(f"{source}: key {dup.key!r} appears twice in one object (lines {', '.join(lines)}; "
                          f"the object's keys: {', '.join(dup.keys)}); JSON would keep only the last") from None


def load(path: str | Path = DEFAULT_PATH) -> Matrix:
    """Read and validate a benchmarks.json file."""
    path = Path(path)
    return parse(loads(path.read_text(), str(path)))
