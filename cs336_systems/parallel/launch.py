"""Process-group setup for torchrun jobs, and a hang-proof spawner for multi-process tests.

Two entry points:

* `init_from_env()` — for code launched by ``torchrun`` (one or many nodes): env:// rendezvous from
  MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, the device from LOCAL_RANK, NCCL when CUDA is present and
  gloo otherwise.  Nothing node-specific is assumed, so ``--nnodes > 1`` works unchanged.
* `spawn(fn, world_size, *args)` — runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes
  joined by a `torch.distributed.FileStore` in a private temporary directory (no ports, so parallel tests
  cannot collide), with a timeout on rendezvous, on every collective and on the join.  Each worker pins
  OMP_NUM_THREADS=1, always destroys its process group, and sends back its return value or its traceback;
  a worker that fails or a job that outlives ``timeout_s`` raises `SpawnError` in the parent after every
  worker has been killed.  Return values may hold tensors (they travel as `torch.save` bytes).  A hung test is a failed test, never a hung CI.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class SpawnError(RuntimeError):
    """A spawned worker raised, died, or the job exceeded its timeout."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def require_process_group(who: str) -> None:
    """Raise a clear error when ``who`` is used without an initialized default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (or cs336_systems.parallel.launch.init_from_env() "
            "under torchrun)"
        )


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> DistContext:
    """Initialize the default process group from torchrun's environment and pick this rank's device.

    backend: "nccl" | "gloo" | None (NCCL when CUDA is available, else gloo).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: environment variables {missing} are not set; launch with torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(
            backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _to_bytes(value: Any) -> bytes:
    # torch pickles tensors through a queue as shared-memory handles that vanish when the worker exits
    # (the parent then fails with ConnectionResetError); torch.save bytes carry the data by value.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def _worker(rank: int, world_size: int, store_path: str, backend: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, bound before NCCL creates its communicator
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            # Report before tearing down: destroying a group with unmatched collectives in flight (the
            # usual way a rank fails) can block, and the parent must learn the root cause regardless.
            results.put((rank, False, traceback.format_exc()))
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
        results.put((rank, True, _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - init or teardown failed
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 120.0, startup_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function).  Collectives inside time out after
    ``timeout_s`` as well, so a rank waiting on a peer that never arrives fails instead of hanging.
    ``startup_s`` is added to the job's deadline for process start-up (importing torch takes seconds).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' with world_size={world_size} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cs336-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, backend, timeout_s, fn, args, results),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + startup_s
        collected: dict[int, tuple[bool, Any]] = {}
        failure: str | None = None
        try:
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    failure = f"timed out after {timeout_s + startup_s:.0f} s with ranks {sorted(collected)} done"
                    break
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue_module.Empty:
                    # Exit code 0 counts too (os._exit(0) inside fn): a rank that returned normally has
                    # flushed its result into the queue before exiting, so it is collected, not "dead".
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected
                            and p.exitcode is not None]
                    if dead:
                        # give its queue message a moment to arrive (it may have failed cleanly)
                        time.sleep(0.5)
                        if results.empty():
                            failure = (f"rank(s) {dead} exited with codes {[procs[r].exitcode for r in dead]} "
                                       "without reporting a result")
                            break
                    continue
                collected[rank] = (ok, value)
                if not ok:
                    # A rank's failure usually makes its peers fail too ("connection closed"); collect what
                    # arrives within a short grace period so the root cause is in the report, not just the echo.
                    errors = {rank: value}
                    grace_end = time.monotonic() + 3.0
                    while time.monotonic() < grace_end and len(collected) < world_size:
                        try:
                            r2, ok2, v2 = results.get(timeout=0.2)
                        except queue_module.Empty:
                            continue
                        collected[r2] = (ok2, v2)
                        if not ok2:
                            errors[r2] = v2
                    failure = "\n".join(f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
                    break
        finally:
            for p in procs:
                p.join(timeout=5.0 if failure is None else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
    if failure is not None:
        raise SpawnError(failure)
    return [_from_bytes(collected[r][1]) for r in range(world_size)]


def run_case_on_local_device(rank: int, world_size: int, body: Callable[[torch.device, dict], Any],
                             case: dict) -> Any:
    """A `spawn` target for collective benchmark bodies: ``body(device, case)`` on this rank's device
    (``cuda:<rank>`` under NCCL, the CPU under gloo)."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    return body(device, case)
