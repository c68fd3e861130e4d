"""What the end-to-end benchmarks time: one step of the LM in a given mode.

Modes:
  "forward"           inference: logits under torch.no_grad()
  "forward-backward"  zero grads (set to None), forward, cross-entropy loss, backward
  "train-step"        forward-backward plus an AdamW step (fused on CUDA: one kernel for all tensors)

`lm_step(...)` builds the model, random token batch and optimizer on ``device`` and returns the
zero-argument step; pass it to the harness as a setup (``lambda: lm_step(...)``) so an OOM while
building is recorded like any other.

Implementations (``impl``, `IMPLS`):
  "own"       `cs336_systems.model` (the default; the attention kernel is chosen by ``attention``)
  "hf-llama"  Hugging Face transformers' LlamaForCausalLM of the same size (`hf_llama`): the baseline.
              SDPA attention only, no activation checkpointing; needs the `baselines` extra
              (`unavailable_reason` says so when it is missing).
Both run the same step: the same batch (one generator, one seed), autocast, logits -> the same
`F.cross_entropy` -> backward, the same AdamW; only the model that turns tokens into logits differs.

Optimizers (``optimizer``, `OPTIMIZERS`), all fused (one pass over each tensor's bytes):
  "adamw"              torch.optim.AdamW(fused=True on CUDA) over float32 parameters: autocast casts every GEMM
                       weight to bf16 in the forward and its gradient back to float32 in the backward
  "adamw-master"       `cs336_systems.optim.AdamWMaster`: the Linear weights are held in bf16 and their float32
                       masters in the optimizer, so autocast casts nothing (bf16 precision only); the masters
                       split (the bf16 weight plus the 16 low bits, its default: 2 bytes an element fewer)
  "adamw-master-fp32"  the same with a float32 copy as each master (``master_format="float32"``)
  In the forward and forward-backward modes, which build no optimizer, the Linear weights of both
  "adamw-master" variants are held in bf16 the same way, so each mode times the same model.

Packing (``packing``, `PACKINGS`; our model only): "none", the dense (batch_size, context) rows of random
tokens; "packed", the same number of tokens as ``documents`` documents of `document_lengths` (a fixed
long-tailed draw, each at most ``context``) in one row, positions restarting and attention staying within
each document (`model.Packing`, attention "flash-triton"), the loss skipping each document's boundary target;
"padded", the same documents one per row, each padded to ``context``, the loss over their real tokens.  Both
carry batch_size x context tokens of documents, so their tokens/s compare: the saving of packing over padding.

Float8 (``linear_precision``: `cs336_systems.float8.PRECISIONS`): "bf16" leaves the GEMMs to autocast; the
fp8 recipes swap both models' Linear layers (the LM head excluded) for torchao's Float8Linear before the
optimizer and torch.compile see them.

Compilation (``compile=True``) compiles each TransformerBlock separately with ``dynamic=False``
(torchtitan's per-block policy): all blocks share one graph, so compile time does not grow with depth,
and static shapes give the best kernels.  The baseline's decoder layers and final norm are compiled the
same way (`compile_each`).  Dynamo's caches are reset first so cases never share (and exhaust) a
recompile budget.

CUDA graphs (``cuda_graphs=True``, with ``compile=True`` on a CUDA device): the same units compiled with
``mode="reduce-overhead"``, so inductor records each block's forward and backward kernels in CUDA graphs
(cudagraph trees) and replays them; every step starts with ``torch.compiler.cudagraph_mark_step_begin()``.
For launch-bound sizes (small: hundreds of kernels of a few microseconds) this removes the host from the
step.  The embedding, the head, the loss and the optimizer stay outside the graphs.  The graphs' memory
pool is allocated when they are recorded (during warm-up): the peak memory of the measured rounds does
not count the pool's reserved intermediates, so it is not comparable with the other modes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import amp, float8
from cs336_systems.bench.workloads import hf_llama
from cs336_systems.model import Packing, TransformerBlock, TransformerLM, build
from cs336_systems.optim.adamw_master import AdamWMaster, hold_in, linear_weights

MODES = ("forward", "forward-backward", "train-step")
PACKINGS = ("none", "packed", "padded")
IGNORE = -100  # a target the loss skips (F.cross_entropy's ignore_index): packed and padded documents' boundaries
IMPLS = ("own", "hf-llama")
DEFAULT_IMPL = "own"
MASTER_FORMAT = {"adamw-master": "split", "adamw-master-fp32": "float32"}  # AdamWMaster's master_format
OPTIMIZERS = ("adamw", *MASTER_FORMAT)
DEFAULT_OPTIMIZER = "adamw"


def document_lengths(total: int, documents: int, context: int, seed: int = 0) -> list[int]:
    """``documents`` lengths summing to ``total``, each in [1, context]: a fixed lognormal draw (sigma 1: a
    long tail of short documents and a few long ones), scaled to the total.  ValueError if they cannot fit."""
    if not 1 <= documents <= total <= documents * context:
        raise ValueError(f"documents={documents} cannot hold {total} tokens of at most context={context} each")
    draw = torch.Generator().manual_seed(seed)
    weights = torch.empty(documents, dtype=torch.float64).log_normal_(0.0, 1.0, generator=draw)
    lengths = [min(context, max(1, round(float(w)))) for w in weights / weights.sum() * total]
    i = 0
    while sum(lengths) != total:  # round-robin +-1 within [1, context] until the sum is exact
        step = 1 if sum(lengths) < total else -1
        if 1 <= lengths[i] + step <= context:
            lengths[i] += step
        i = (i + 1) % documents
    return lengths


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
    return impl


def check_optimizer(optimizer: str, precision: str) -> str:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if optimizer in MASTER_FORMAT and precision != "bf16":
        # fp16 compute weights would need a GradScaler that unscales fp16 gradients, which torch's refuses
        raise ValueError(f"optimizer {optimizer!r} holds bf16 compute weights: it needs precision 'bf16', "
                         f"got precision {precision!r}")
    return optimizer


def unavailable_reason(impl: str) -> str | None:
    """Why ``impl`` cannot run in this environment (e.g. transformers not installed), or None if it can."""
    if check_impl(impl) == "hf-llama":
        return hf_llama.unavailable_reason()
    return None


def compile_each(modules: Iterable[nn.Module], mode: str | None = None) -> None:
    """Compile each module in place, separately, with static shapes, after resetting dynamo's caches
    (``mode``: torch.compile's, e.g. "reduce-overhead" for CUDA graphs)."""
    torch._dynamo.reset()
    for module in modules:
        module.compile(dynamic=False, mode=mode)


def check_cuda_graphs(cuda_graphs: bool, compile: bool, device: torch.device) -> bool:
    """CUDA graphs are recorded by the compiled units on a CUDA device (ValueError naming what is missing)."""
    if cuda_graphs is not True and cuda_graphs is not False:
        raise ValueError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
    if cuda_graphs and not compile:
        raise ValueError("cuda_graphs=True needs compile=True (inductor records the compiled blocks), got compile=False")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {str(device)!r}")
    return cuda_graphs


def compile_units(model: TransformerLM) -> list[nn.Module]:
    """What `compile_blocks` compiles: every TransformerBlock and the final norm."""
    return [*(m for m in model.modules() if isinstance(m, TransformerBlock)), model.final_norm]


def compile_blocks(model: TransformerLM) -> TransformerLM:
    """Compile every TransformerBlock and the final norm in place; returns the model."""
    compile_each(compile_units(model))
    return model


class LMStep:
    """A zero-argument step, with the model and optimizer it drives exposed for inspection."""

    def __init__(self, run, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._run = run
        self.model = model
        self.optimizer = optimizer

    def __call__(self) -> None:
        self._run()


def lm_step(
    *,
    size: str,
    context: int,
    batch_size: int,
    mode: str,
    precision: str = "fp32",
    compile: bool = False,
    attention: str = "sdpa",
    checkpoint: str = "none",
    device: torch.device | str = "cpu",
    vocab_size: int = 10_000,
    lr: float = 1e-4,
    seed: int = 0,
    impl: str = DEFAULT_IMPL,
    optimizer: str = DEFAULT_OPTIMIZER,
    cuda_graphs: bool = False,
    packing: str = "none",
    documents: int = 16,
    linear_precision: str = "bf16",
) -> LMStep:
    """Build an LM workload and return ``step()`` running one ``mode`` step on it.

    ``checkpoint`` is an activation-checkpointing policy (`cs336_systems.checkpointing`: "none",
    "every-k", "sqrt"): blocks recompute their activations in backward instead of keeping them.
    ``impl`` picks the model (module docstring); "hf-llama" raises `hf_llama.BaselineUnavailable` without
    transformers, and ValueError for an attention other than "sdpa" or a checkpoint policy.
    ``optimizer`` picks the AdamW (module docstring); the "adamw-master" ones need precision "bf16".
    ``cuda_graphs`` replays the compiled units as CUDA graphs (module docstring; needs compile and CUDA).
    ``packing`` and ``documents``: packed or padded documents instead of dense rows (module docstring).
    ``linear_precision``: "fp8-tensorwise" / "fp8-rowwise" train the Linear layers' GEMMs in float8 through
    torchao (`cs336_systems.float8`; both models, the LM head excluded; precision "bf16" only).
    """
    float8.check_precision(linear_precision)
    if linear_precision != float8.DEFAULT_PRECISION and precision != "bf16":
        raise ValueError(f"linear_precision {linear_precision!r} trains under bf16 autocast: precision must be "
                         f"'bf16', got {precision!r}")
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; valid: {', '.join(PACKINGS)}")
    if packing != "none" and impl != DEFAULT_IMPL:
        raise ValueError(f"packing {packing!r} runs our model only, got impl {impl!r}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    amp.check_precision(precision)
    check_impl(impl)
    check_optimizer(optimizer, precision)
    device = torch.device(device)
    check_cuda_graphs(cuda_graphs, compile, device)
    torch.manual_seed(seed)
    if impl == "hf-llama":
        model = hf_llama.build(size, device=device, context_length=context, attention=attention,
                               vocab_size=vocab_size, checkpoint=checkpoint)
        units = hf_llama.compile_units(model)

        def logits_of(tokens: torch.Tensor) -> torch.Tensor:
            return hf_llama.logits(model, tokens)
    else:
        with torch.device(device):
            model = build(size, context_length=context, attention=attention, vocab_size=vocab_size,
                          checkpoint=checkpoint)
        units = compile_units(model)
        logits_of = model
    float8.convert_linears(model, linear_precision)  # before the optimizer takes the weights and before compile
    opt = None
    if mode == "train-step":
        if optimizer in MASTER_FORMAT:
            opt = AdamWMaster(model.parameters(), lr=lr, compute_params=linear_weights(model),
                              master_format=MASTER_FORMAT[optimizer])
        else:
            # fused=True: one multi-tensor kernel launch per step on CUDA instead of a loop over tensors.
            opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    elif optimizer in MASTER_FORMAT:
        hold_in(linear_weights(model), torch.bfloat16)
    if compile:  # after the weights took their dtype, so the compiled code is specialised to it
        compile_each(units, mode="reduce-overhead" if cuda_graphs else None)
    generator = torch.Generator(device).manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, context), device=device, generator=generator)
    targets = torch.randint(0, vocab_size, (batch_size, context), device=device, generator=generator)
    if packing != "none":  # targets the loss skips are IGNORE (set once here: no mask, no sync in the step)
        lengths = document_lengths(batch_size * context, documents, context, seed)
        tokens, targets = tokens.reshape(1, -1), targets.reshape(1, -1)
        if packing == "packed":
            packed = Packing.of(lengths, device)
            targets = targets.masked_fill(~packed.target_mask()[None], IGNORE)
            logits_of = functools.partial(model, packing=packed)
        else:  # one document a row, padded to the context; the loss over each row's real tokens
            ends = torch.tensor(lengths, device=device)[:, None]
            real = torch.arange(context, device=device)[None] < ends
            rows = torch.zeros(documents, context, dtype=tokens.dtype, device=device)
            tokens, targets = rows.masked_scatter(real, tokens), rows.masked_scatter(real, targets)
            keep = torch.arange(context, device=device)[None] < ends - 1  # each document's last target skipped too
            targets = targets.masked_fill(~keep, IGNORE)

    if mode == "forward":
        model.eval()

        def forward() -> None:
            if cuda_graphs:  # a new step: the graphs may overwrite the previous step's outputs
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), amp.autocast(precision, device):
                logits_of(tokens)

        return LMStep(forward, model, None)

    scaler = amp.grad_scaler(precision, device)

    def train() -> None:
        if cuda_graphs:  # a new step: the graphs may overwrite the previous step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with amp.autocast(precision, device):
            logits = logits_of(tokens)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        if scaler is not None:
            scaler.scale(loss).backward()
            if opt is not None:
                scaler.step(opt)
                scaler.update()
        else:
            loss.backward()
            if opt is not None:
                opt.step()

    return LMStep(train, model, opt)
