"""What the data-parallel benchmarks time: one training step of the LM under a parallelism variant.

Variants (``VARIANTS``), all with AdamW (fused on CUDA), the precision mode's autocast, a per-rank batch
of random tokens (different on every rank) and the model built from one seed:

  "none"            no communication: each rank trains alone (the lower bound on step time)
  "torch-ddp"       torch.nn.parallel.DistributedDataParallel, default settings (25 MiB buckets)
  "naive"           NaiveDDP             "flat"        FlatDDP
  "individual"      DDPIndividualParameters
  "bucketed"        DDPBucketed(bucket_size_mb)          (``None`` -> one bucket)
  "zero-broadcast"  DDPBucketed(bucket_size_mb or 25) + ShardedOptimizer(mode="broadcast")
  "zero1"           ShardedOptimizer(mode="zero1", bucket_size_mb=100, overlap=True) over the plain model:
                    it reduce-scatters the local gradients itself in 100 MiB buckets (the best DDPBucketed
                    size) from backward hooks, taking over DDP's all-reduce, and all-gathers the parameters
                    bucket by bucket.  Under fp16 (GradScaler) overlap is off: the scaler unscales p.grad after
                    backward, which overlapped buckets would already have read
  "fsdp"            FSDP(model, compute_dtype=bf16 under the bf16 mode, else None)
  "torch-zero"      torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  "torch-fsdp2"     torch.distributed.fsdp.fully_shard on every TransformerBlock and the root
                    (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under bf16)

A step is: zero_grad(set_to_none=True), forward + cross-entropy under autocast, backward,
``finish_gradient_synchronization()`` where the wrapper has one, optimizer.step().

Recorded (the benchmark keeps, of ``sync_s``, the median over the measured rounds of the slowest rank's
value, and of ``memory`` the maximum over ranks):
  ``sync_s``  time inside finish_gradient_synchronization() with the wrapper's ``record_timing`` (on CUDA:
              events on the compute stream, no host synchronization in the step): from the end of
              backward's kernels to the end of synchronization, so for naive/flat it is the
              communication time and for the overlapped wrappers the communication backward did not
              hide;
  ``memory``  (CUDA only) bytes allocated after construction, the peak up to right before
              optimizer.step() and right after it, and a breakdown at the point before the step:
              parameters, gradients, optimizer state (all local to the rank) and activations/other (the
              rest of that peak).  Recorded by one extra step after the measured rounds
              (`DistributedTrainStep.record_memory`, untimed: the timed step does no bookkeeping), which
              resets the CUDA peak counter at its start, so these are per-step peaks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems import amp
from cs336_systems.model import TransformerBlock, build
from cs336_systems.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.launch import require_process_group
from cs336_systems.parallel.zero import ShardedOptimizer

VARIANTS = ("none", "torch-ddp", "naive", "flat", "individual", "bucketed", "zero-broadcast", "zero1",
            "fsdp", "torch-zero", "torch-fsdp2")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a (possibly DTensor) parameter or gradient."""
    return t.to_local() if hasattr(t, "to_local") else t


class DistributedTrainStep:
    """A zero-argument training step under one parallelism variant (see the module docstring)."""

    def __init__(self, *, variant: str, size: str, context: int, batch_size: int, precision: str,
                 device: torch.device | str, bucket_size_mb: float | None = None, vocab_size: int = 10_000,
                 lr: float = 1e-4, seed: int = 0) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
        if bucket_size_mb is not None and variant not in ("bucketed", "zero-broadcast"):
            raise ValueError(f"bucket_size_mb={bucket_size_mb} applies only to 'bucketed' and 'zero-broadcast', "
                             f"not variant {variant!r}")
        amp.check_precision(precision)
        if precision == "fp16" and variant in ("zero1", "fsdp", "torch-fsdp2", "zero-broadcast", "torch-zero"):
            # GradScaler decides to skip a step from this rank's (sharded or un-averaged) gradients alone:
            # ranks would skip different steps and drift apart, or issue different collectives and hang.
            raise ValueError(f"precision='fp16' (GradScaler) is not supported with variant {variant!r}: the "
                             "inf check is per rank; use bf16")
        require_process_group("DistributedTrainStep")
        self.variant, self.precision = variant, precision
        self.device = device = torch.device(device)
        self.cuda = device.type == "cuda"
        torch.manual_seed(seed)  # same initial weights everywhere (the wrappers broadcast rank 0's anyway)
        with torch.device(device):
            model = build(size, context_length=context, vocab_size=vocab_size)
        generator = torch.Generator(device).manual_seed(seed + 1 + dist.get_rank())  # per-rank data
        self.tokens = torch.randint(0, vocab_size, (batch_size, context), device=device, generator=generator)
        self.targets = torch.randint(0, vocab_size, (batch_size, context), device=device, generator=generator)
        self.scaler = amp.grad_scaler(precision, device)
        adamw = dict(lr=lr, fused=True) if self.cuda else dict(lr=lr)
        low = amp.PRECISIONS[precision]

        self.wrapper = None
        if variant == "none":
            self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), **adamw)
        elif variant in ("torch-ddp", "torch-zero"):
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, device_ids=[device.index] if self.cuda else None)
            self.optimizer = (
                torch.optim.AdamW(self.model.parameters(), **adamw) if variant == "torch-ddp"
                else ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
            )
        elif variant in ("naive", "flat", "individual", "bucketed", "zero-broadcast"):
            if variant == "naive":
                self.wrapper = NaiveDDP(model, record_timing=True)
            elif variant == "flat":
                self.wrapper = FlatDDP(model, record_timing=True)
            elif variant == "individual":
                self.wrapper = DDPIndividualParameters(model, record_timing=True)
            else:
                size_mb = bucket_size_mb if (variant == "bucketed" or bucket_size_mb is not None) else 25.0
                self.wrapper = DDPBucketed(model, size_mb, record_timing=True)
            self.model = self.wrapper
            self.optimizer = (
                torch.optim.AdamW(model.parameters(), **adamw) if variant != "zero-broadcast"
                else ShardedOptimizer(model.parameters(), torch.optim.AdamW, mode="broadcast", **adamw)
            )
        elif variant == "zero1":
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.detach(), src=0)
            self.model = model
            self.optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mode="zero1",
                                              bucket_size_mb=100, overlap=self.scaler is None, **adamw)
        elif variant == "fsdp":
            self.wrapper = FSDP(model, compute_dtype=low)
            self.model = self.wrapper
            self.optimizer = torch.optim.AdamW(self.wrapper.parameters(), **adamw)
        else:  # torch-fsdp2
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low is not None
                      else MixedPrecisionPolicy())
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    fully_shard(module, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        self.last_sync = None  # the wrapper's SyncStats of the last step (read lazily: see sync_s)
        self.memory: dict[str, int] = {}
        if self.cuda:
            torch.cuda.synchronize(device)
            self.memory["after_construction"] = torch.cuda.memory_allocated(device)

    @property
    def sync_s(self) -> float | None:
        """The last step's time inside finish_gradient_synchronization() (None without a timing wrapper).
        On CUDA this waits for the step's end event: read it outside a timed region."""
        return None if self.last_sync is None else self.last_sync.finish_time_s

    # --- memory accounting ----------------------------------------------------------------------
    def _local_params(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.model.parameters()]

    def _optimizer_state_bytes(self) -> int:
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.local_state_bytes()
        state = getattr(self.optimizer, "optim", self.optimizer).state  # ZeroRedundancyOptimizer wraps .optim
        return sum(_tensor_bytes(_local(v) for v in s.values() if torch.is_tensor(v)) for s in state.values())

    def _record_breakdown(self) -> None:
        """The memory breakdown at the point right before optimizer.step() (see record_memory)."""
        params = self._local_params()
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        if isinstance(self.optimizer, ShardedOptimizer):
            grads += self.optimizer.gradient_tensors()  # zero1 with overlap released p.grad at packing
        peak_before = torch.cuda.max_memory_allocated(self.device)
        p_bytes, g_bytes, o_bytes = _tensor_bytes(params), _tensor_bytes(grads), self._optimizer_state_bytes()
        self.memory.update(
            peak_before_step=peak_before, parameters=p_bytes, gradients=g_bytes, optimizer_state=o_bytes,
            activations_other=max(peak_before - p_bytes - g_bytes - o_bytes, 0),
        )

    def record_memory(self) -> dict[str, int]:
        """Run one more step, untimed, recording ``memory`` (CUDA only; the module docstring lists the fields)
        on the way, and return it ({} on other devices).

        The timed step does no bookkeeping: walking every parameter, gradient and optimizer-state tensor
        (``DTensor.to_local()`` on each, under torch-fsdp2) costs milliseconds of host time, different per
        variant, that would land inside the measured rounds.  Every step of a case allocates alike, so one
        recorded step after the measured rounds gives the same numbers.  Collective, like the step.
        """
        if not self.cuda:
            return {}
        torch.cuda.reset_peak_memory_stats(self.device)
        self._step(before_optimizer_step=self._record_breakdown)
        self.memory["peak_step"] = torch.cuda.max_memory_allocated(self.device)
        self.memory["allocated_after_step"] = torch.cuda.memory_allocated(self.device)
        return dict(self.memory)

    def __call__(self) -> None:
        """One training step, as timed: nothing but the step (memory: `record_memory`)."""
        self._step()

    def _step(self, before_optimizer_step: Callable[[], None] | None = None) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with amp.autocast(self.precision, self.device):
            logits = self.model(self.tokens)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        if self.wrapper is not None:
            self.wrapper.finish_gradient_synchronization()
            self.last_sync = getattr(self.wrapper, "last_sync", None)
        if before_optimizer_step is not None:
            before_optimizer_step()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


def train_case(device: torch.device, case: dict) -> dict:
    """Collective perf-case body for the data_parallel suite.  Returns what rank 0 records.

    The timed rounds run the bare step; what is recorded besides the times (the slowest rank's sync time per
    round, the memory breakdown of one extra recorded step, the bucket count) is gathered after them, untimed
    (``after_rounds``).  A failure on any rank ends the case on every rank with status "oom" or "error"
    (`cs336_systems.bench.rank_timing`).
    """
    import statistics

    from cs336_systems.bench import rank_timing as timing

    sync: list = []  # SyncStats per round, resolved after the measurement (reading one waits for its events)

    def setup():
        step = DistributedTrainStep(
            variant=case["variant"], size=case["size"], context=case["context"], batch_size=case["batch_size"],
            precision=case["precision"], device=device, bucket_size_mb=case.get("bucket_size_mb"),
        )

        def run() -> None:
            step()
            if step.last_sync is not None:
                sync.append(step.last_sync)

        run.train_step = step  # for after_rounds; the harness holds the only reference (rank_timing)
        return run

    def after_rounds(run) -> dict:
        step: DistributedTrainStep = run.train_step
        out: dict = {}
        if sync:
            measured_sync = [s.finish_time_s for s in sync[case["warmup"]:]]  # the measured rounds' values
            out["sync_s"] = [max(col) for col in zip(*timing.gather_floats(measured_sync, device))]
        memory = step.record_memory()  # one more step, untimed
        if memory:
            gathered = timing.gather_floats([float(v) for v in memory.values()], device)
            out["memory_gib"] = {k: max(r[i] for r in gathered) / 2**30 for i, k in enumerate(memory)}
        if step.wrapper is not None and hasattr(step.wrapper, "num_buckets"):
            out["num_buckets"] = step.wrapper.num_buckets
        elif getattr(step.optimizer, "num_buckets", None) is not None:  # zero1's reduce-scatter buckets
            out["num_buckets"] = step.optimizer.num_buckets
        return out

    measured = timing.measure_across_ranks(setup, warmup=case["warmup"], rounds=case["rounds"], device=device,
                                           after_rounds=after_rounds)
    if measured.status != "ok":
        return {"status": measured.status, "error": measured.error}
    extra: dict = {"rank_median_ms": [m * 1e3 for m in measured.rank_medians_s]}
    after = dict(measured.after)
    if "sync_s" in after:
        sync_median = statistics.median(after.pop("sync_s"))
        extra["sync_ms"] = sync_median * 1e3
        extra["sync_share"] = sync_median / statistics.median(measured.times_s)
    extra.update(after)
    return {"status": "ok", "times_s": measured.times_s, "peak_memory_bytes": measured.peak_memory_bytes,
            "extra_info": extra}
