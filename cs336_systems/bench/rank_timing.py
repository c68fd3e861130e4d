"""Timing a step that runs on every rank: the harness per rank, then the slowest rank per round.

`measure_across_ranks(setup, ...)` is collective (every rank calls it with the same arguments).  Each
rank times its rounds with `cs336_systems.bench.harness.measure` (synchronizing clock, uncounted warm-up,
peak memory after warm-up), with an agreement before every round (untimed, in the per-round hook) that
also makes all ranks start each round together.  The per-round times are then all-gathered and reduced
to the maximum over ranks: a data-parallel step is as slow as its slowest rank, and that is the number
nccl-tests and the DDP benchmarks report.  Per-rank medians are kept for skew diagnosis, and peak
memory is the maximum over ranks.

Failures.  An exception on one rank (an OOM, or any error) in ``setup``, in a round or in
``after_rounds`` must not leave its peers blocked in a collective until the group's timeout.  So:

* the ranks *agree* after setup and after every round (the per-round hook, which also lines the ranks up
  for the next round) and once more after ``after_rounds``: an all-reduce of one flag per rank on a side
  group (`cs336_systems.parallel.launch.side_group`: gloo over the store, its own connections, so it
  never matches a collective of the default group, whatever the peers were doing when this rank failed);
* a rank that failed records the error (rank, phase, message, traceback), drops the workload, and tears
  down its default process group (`launch.tear_down_default_group`) before it joins the agreement: a peer
  blocked in a collective with it then fails at once ("Connection closed by peer" on gloo) and comes to
  the agreement too.  Under NCCL, where a peer's host waits in a device synchronization instead, a
  watcher thread on every rank aborts the rank's communicators as soon as a failing rank says so through
  the store;
* once the failure is agreed, every rank stops, the default group is made again (same backend, ranks and
  timeout, a fresh store prefix) so that the next case can run, and every rank returns the same result:
  status ``"oom"`` when a rank ran out of memory ("rank 1 ran out of memory in setup: CUDA out of
  memory. ..."), else ``"error"`` with the failing rank's phase and traceback.  The failure that came
  first is named first; those it caused on other ranks ("Connection closed by peer") follow, shortened.

A failed case costs a few seconds instead of the collective timeout (600 s under torchrun, 900 s per
data-parallel case under plain pytest).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.bench import harness as benchmarking
from cs336_systems.parallel import launch
from cs336_systems.parallel.launch import require_process_group


@dataclass(frozen=True)
class RankedMeasurement:
    status: str  # "ok" | "oom" | "error"
    times_s: tuple[float, ...]  # per round, the slowest rank's time
    rank_medians_s: tuple[float, ...]  # each rank's own median
    peak_memory_bytes: int | None  # max over ranks (None on CPU)
    error: str | None = None  # "rank 1 ran out of memory in setup: CUDA out of memory. ..."
    failed_ranks: tuple[int, ...] = ()  # ranks that failed, the first failure first
    after: Any = None  # what ``after_rounds`` returned (same object type on every rank)


def barrier(device: torch.device) -> None:
    """All ranks wait for each other, with this rank's queued device work finished first."""
    benchmarking.synchronize(device)
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()
    benchmarking.synchronize(device)


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """All-gather a same-length list of floats from every rank -> [rank][i]."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


# --- agreement ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, as every rank learns it."""

    rank: int
    kind: str  # "oom" | "error"
    where: str  # "setup", "warm-up round 2", "round 5", "after the rounds"
    message: str  # "ValueError: ..." (an OOM: the error's first line)
    traceback: str
    at: float  # time.time() when it happened: orders a root cause before the failures it caused

    def describe(self, limit: int | None = None) -> str:
        """One line; ``limit`` shortens the message to that many characters."""
        message = self.message if limit is None or len(self.message) <= limit else self.message[:limit] + "..."
        if self.kind == "oom":
            return f"rank {self.rank} ran out of memory in {self.where}: {message}"
        return f"rank {self.rank} raised in {self.where}: {message}"


def summarize(failures: list[RankFailure]) -> tuple[str, str]:
    """(status, error text) of a measurement that failed: "oom" naming every rank that ran out of memory,
    else "error" with the first failure's traceback; failures caused by it follow ("then ...")."""
    failures = sorted(failures, key=lambda f: (f.at, f.rank))
    oom = [f for f in failures if f.kind == "oom"]
    first = oom or failures[:1]
    others = [f for f in failures if f not in first]
    then = f" (then {'; '.join(f.describe(limit=120) for f in others)})" if others else ""
    if oom:
        return "oom", "; ".join(f.describe() for f in first) + then
    return "error", first[0].describe() + then + "\n" + first[0].traceback.rstrip()


class _Failed(Exception):
    """Internal: unwinds the harness at an agreement point once this rank or a peer has failed."""


_CONTROL: dict[str, Any] = {"group": None, "key": None, "made": 0}
_MEASUREMENTS = [0]  # measure_across_ranks calls in this process: the same count on every rank
WATCH_INTERVAL_S = 0.1  # NCCL: how often the abort watcher looks for a peer's failure


def _group_key() -> tuple:
    return id(dist.distributed_c10d._get_default_group()), dist.get_rank(), dist.get_world_size()


def _control_group() -> Any:
    """The side group for agreements: made once per default group (collective on first use), kept when
    `measure_across_ranks` remakes the default group after a failure (it does not depend on it)."""
    if _CONTROL["group"] is None or _CONTROL["key"] != _group_key():
        _CONTROL["made"] += 1
        _CONTROL["group"] = launch.side_group(f"rank-timing-{_CONTROL['made']}")
        _CONTROL["key"] = _group_key()
    return _CONTROL["group"]


def _failure_of(exc: BaseException, rank: int, where: str) -> RankFailure:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if benchmarking.is_out_of_memory(exc):
        return RankFailure(rank, "oom", where, first or type(exc).__name__, "", time.time())
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return RankFailure(rank, "error", where, message, "".join(traceback.format_exception(exc)), time.time())


class _AbortWatcher:
    """NCCL only: a thread that aborts this rank's communicators as soon as a peer reports a failure.

    A rank whose device work waits on a failed peer (an all-reduce the peer never joins) blocks in its next
    device synchronization, where no agreement can reach it; aborting the communicators ends that work.
    The thread checks the store key a failing rank sets every ``WATCH_INTERVAL_S`` (a blocking ``wait``
    would hold the store client's connection, which the main thread shares).
    """

    def __init__(self, store: Any, key: str,
                 tear_down: Callable[[], None] = launch.tear_down_default_group) -> None:
        self._store, self._key, self._tear_down = store, key, tear_down
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while tearing down: never together with the main thread
        self._thread = threading.Thread(target=self._watch, name="cs336-abort-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                signalled = self._store.check([self._key])
            except Exception:  # noqa: BLE001 - the store went away: nothing left to watch
                return
            if signalled:
                with self._lock:
                    if not self._stop.is_set():
                        self._tear_down()
                return

    def stop(self) -> None:
        """End the thread; after this, it tears nothing down."""
        with self._lock:
            self._stop.set()
        self._thread.join(timeout=5.0)


class _Run:
    """One rank's side of one collective measurement: where it is, whether it failed, the agreements."""

    def __init__(self, device: torch.device, warmup: int, namespace: str) -> None:
        self.device = device
        self.warmup = warmup
        self.namespace = namespace
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.control = _control_group()
        self.store = dist.distributed_c10d._get_default_store()
        self.spec = launch.GroupSpec.of_default_group()
        self.where = "setup"
        self.rounds_started = 0
        self.failure: RankFailure | None = None
        self.failed_ranks: list[int] = []
        self.watcher = _AbortWatcher(self.store, f"{namespace}/abort") if self.spec.backend == "nccl" else None

    def record(self, exc: BaseException) -> None:
        """Remember this rank's first failure (an exception caught from the workload)."""
        if self.failure is None:
            self.failure = _failure_of(exc, self.rank, self.where)

    def guarded(self, call: Callable[[], Any]) -> Any:
        """``call()``; an exception is recorded as this rank's failure (None is returned instead)."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - every failure becomes the agreed result
            self.record(exc)
            return None

    def before_round(self) -> None:
        """The per-round hook: agree after setup and after every round, then start the next round together."""
        if self.failure is None:
            self.guarded(lambda: benchmarking.synchronize(self.device))  # aborted device work raises here
        if self.failure is not None or self._exchange(0):
            raise _Failed  # a failed rank agrees once the harness is unwound (fail())
        benchmarking.synchronize(self.device)
        self.rounds_started += 1
        n = self.rounds_started
        self.where = f"warm-up round {n}" if n <= self.warmup else f"round {n - self.warmup}"

    def agree(self) -> bool:
        """An agreement outside the harness: True when every rank is fine (else call fail())."""
        return self.failure is None and not self._exchange(0)

    def _exchange(self, code: int) -> bool:
        """All-reduce one flag per rank on the side group; True if any rank failed."""
        flags = torch.zeros(self.world, dtype=torch.int64)
        flags[self.rank] = code
        self.control.allreduce([flags]).wait()
        self.failed_ranks = [r for r, f in enumerate(flags.tolist()) if f]
        return bool(self.failed_ranks)

    def fail(self) -> list[RankFailure]:
        """Collective, once some rank failed and this one dropped the workload: publish this rank's failure,
        release the peers blocked on it, agree, learn the others' and make the default group again."""
        if self.failure is not None:
            self.store.set(f"{self.namespace}/failure/{self.rank}", json.dumps(dataclasses.asdict(self.failure)))
            if self.watcher is not None:
                self.watcher.stop()
                self.watcher = None
                self.store.set(f"{self.namespace}/abort", "1")  # the peers' watchers abort their NCCL work
            launch.tear_down_default_group()
            self._exchange(1)
        failures = [RankFailure(**json.loads(self.store.get(f"{self.namespace}/failure/{r}")))
                    for r in self.failed_ranks]
        self.stop()
        # Ranks that did not fail still hold the old group: every rank tears it down, and no rank makes the
        # new one until all have (a gloo teardown shuts down connections to the peers' addresses, which
        # would cut a peer's new group while it connects).
        launch.tear_down_default_group()
        self.control.allreduce([torch.zeros(1)]).wait()
        self.spec.reinit(self.namespace)
        _CONTROL["key"] = _group_key()  # the side group outlives the default group it was made with
        return failures

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None


class _GuardedStep:
    """The workload's step (and its own ``before_each``) with every exception recorded, never raised; a
    no-op once this rank has failed."""

    def __init__(self, step: Callable[[], object] | None, run: _Run) -> None:
        self.step = step
        self._run = run
        if getattr(step, "before_each", None) is not None:
            self.before_each = self._before_each

    def _before_each(self) -> None:
        if self.step is not None and self._run.failure is None:
            self._run.guarded(self.step.before_each)

    def __call__(self) -> None:
        if self.step is not None and self._run.failure is None:
            self._run.guarded(self.step)


def measure_across_ranks(
    setup: Callable[[], benchmarking.Step], *, warmup: int, rounds: int, device: torch.device,
    after_rounds: Callable[[benchmarking.Step], Any] | None = None,
) -> RankedMeasurement:
    """Collective: time ``rounds`` rounds of the step on every rank; reduce to the slowest rank per round.

    ``after_rounds(step)``, if given, runs on every rank after the measured rounds, untimed, with the step
    still alive (collectives allowed, e.g. gathering what the step recorded); its return value is the
    result's ``after``.  A failure on any rank, in setup, a round or ``after_rounds``, ends the measurement
    on every rank within seconds with status "oom" or "error" (module docstring).
    """
    require_process_group("measure_across_ranks")
    device = torch.device(device)
    _MEASUREMENTS[0] += 1
    run = _Run(device, warmup, f"cs336-rank-timing/{_MEASUREMENTS[0]}")
    holder: list[_GuardedStep] = []

    def guarded_setup() -> _GuardedStep:
        step = run.guarded(setup)
        if run.failure is None and not callable(step):
            run.record(TypeError(f"setup must return a callable step, got {type(step).__name__}"))
        holder.append(_GuardedStep(step if run.failure is None else None, run))
        return holder[-1]

    ok, result, after = False, None, None
    try:
        result = benchmarking.measure(guarded_setup, warmup=warmup, rounds=rounds, device=device,
                                      before_each=run.before_round)
        if not result.ok:  # an OOM the guards did not see (in the harness's own bookkeeping)
            run.record(torch.OutOfMemoryError(result.error or "out of memory"))
        ok = run.agree()
        if ok and after_rounds is not None:
            run.where = "after the rounds"
            after = run.guarded(lambda: after_rounds(holder[0].step))
            ok = run.agree()
    except _Failed:
        ok = False
    except Exception as exc:  # noqa: BLE001 - the harness's own clock or counters (e.g. aborted device work)
        run.record(exc)
        ok = False
    if ok:
        run.stop()
        holder.clear()
        return _reduce(result, device, after)
    # Drop every reference to the workload before the default group is torn down (module docstring).
    for guarded in holder:
        guarded.step = None
    holder.clear()
    result = after = None
    benchmarking.free_memory(device)
    failures = sorted(run.fail(), key=lambda f: (f.at, f.rank))
    status, text = summarize(failures)
    return RankedMeasurement(status, (), (), None, error=text, failed_ranks=tuple(f.rank for f in failures))


def _reduce(result: benchmarking.Measurement, device: torch.device, after: Any) -> RankedMeasurement:
    peak = result.peak_memory_bytes if result.peak_memory_bytes is not None else -1
    peaks = [int(p[0]) for p in gather_floats([float(peak)], device)]
    peak_max = max(peaks) if max(peaks) >= 0 else None
    per_rank = gather_floats(list(result.times_s), device)
    slowest = tuple(max(column) for column in zip(*per_rank))
    return RankedMeasurement("ok", slowest, tuple(statistics.median(r) for r in per_rank), peak_max,
                             after=after)
