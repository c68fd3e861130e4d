"""Process-group setup for torchrun jobs, and a hang-proof spawner for multi-process tests.

Two entry points:

* `init_from_env()` — for code launched by ``torchrun`` (one or many nodes): env:// rendezvous from
  MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, the device from LOCAL_RANK, NCCL when CUDA is present and
  gloo otherwise.  Nothing node-specific is assumed, so ``--nnodes > 1`` works unchanged.
* `spawn(fn, world_size, *args)` — runs ``fn(rank, world_size, *args)`` in ``world_size`` new processes
  joined by a `torch.distributed.FileStore` in a private temporary directory (no ports, so parallel tests
  cannot collide), with a timeout on rendezvous, on every collective and on the join.  The processes are
  forked from a forkserver that imported torch once (`_start_context`), and run with the caller's
  environment of the moment of the call.  Each worker pins
  OMP_NUM_THREADS=1, always destroys its process group, and sends back its return value or its traceback;
  a worker that fails or a job that outlives ``timeout_s`` raises `SpawnError` in the parent after every
  worker has been killed.  Return values may hold tensors (they travel as `torch.save` bytes).  A hung test is a failed test, never a hung CI.

Helpers for collective code:

* `check_same_across_ranks(who, signature)` (with `module_signature` / `tensor_signature`): raise on every
  rank when the ranks hold different models (names, shapes, dtypes, ``requires_grad``), naming the ranks
  that differ; the DDP wrappers, FSDP and ShardedOptimizer call it at construction.
* `side_group`, `tear_down_default_group`, `GroupSpec`: what `cs336_systems.bench.rank_timing` uses to end
  a case on every rank within seconds when one rank fails (agree on a private gloo group, release the
  peers blocked on the failed rank, make the default group again).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import io
import os
import queue as queue_module
import socket
import tempfile
import threading
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


# --- the same model on every rank --------------------------------------------------------------------

def tensor_signature(name: str, tensor: torch.Tensor) -> str:
    """What must match across ranks for a tensor that a wrapper communicates: name, shape, dtype, and
    whether it is trained (a parameter's ``requires_grad`` decides whether its gradient is reduced)."""
    trained = " trainable" if tensor.requires_grad else ""
    return f"{name} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}{trained}"


def module_signature(module: torch.nn.Module) -> list[str]:
    """`tensor_signature` of every parameter, then every buffer, in registration order (each once)."""
    return ([tensor_signature(n, p) for n, p in module.named_parameters()]
            + [tensor_signature(f"buffer {n}", b) for n, b in module.named_buffers()])


def check_same_across_ranks(who: str, signature: list[str], what: str = "models",
                            unit: str = "parameters and buffers") -> None:
    """Collective: raise ValueError on every rank when ``signature`` (e.g. `module_signature`) is not the
    same on all ranks, naming the ranks that differ from rank 0 and their first difference.

    Wrappers that broadcast or reduce tensor by tensor would otherwise hang (a different count), die inside
    the backend (different sizes) or train on reshaped data (equal sizes, different shapes).  Costs one
    all-gather of two integers per rank, and an object all-gather only when something differs.
    ``what`` and ``unit`` name the things compared in the message ("models"; "parameters and buffers").
    """
    require_process_group(who)
    digest = hashlib.sha256("\n".join(signature).encode()).digest()
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    mine = torch.tensor([len(signature), int.from_bytes(digest[:8], "little", signed=True)],
                        dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = [t.tolist() for t in every]
    if all(row == rows[0] for row in rows):
        return
    signatures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(signatures, list(signature))
    differing = [r for r, row in enumerate(rows) if row != rows[0]]
    details = [_first_difference(signatures[0], signatures[r], r, unit) for r in differing[:3]]
    ranks = ", ".join(map(str, differing))
    raise ValueError(f"{who}: ranks hold different {what}: rank(s) {ranks} differ from rank 0: "
                     + "; ".join(details))


def _first_difference(reference: list[str], other: list[str], rank: int, unit: str) -> str:
    parts = []
    if len(reference) != len(other):
        parts.append(f"rank {rank} has {len(other)} {unit}, rank 0 has {len(reference)}")
    i = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if i is not None:
        parts.append(f"first difference #{i}: rank 0 has {reference[i]!r}, rank {rank} has {other[i]!r}")
    return ", ".join(parts) or f"rank {rank}: a different digest of the same entries"  # unreachable (sha256)


# --- recovering from a failed rank -------------------------------------------------------------------
#
# A rank that fails while its peers wait for it in a collective cannot tell them: they stay blocked until
# the group's timeout.  The helpers below let a caller (cs336_systems.bench.rank_timing) end such a state
# within seconds: a *side group* (a private gloo group over the default group's store, independent of the
# default group) to agree on the outcome, `tear_down_default_group()` to release the peers blocked on this
# rank, and `GroupSpec.reinit()` to make the default group again afterwards, on every rank.

def default_group_timeout(fallback_s: float = 600.0) -> datetime.timedelta:
    """The collective timeout the default process group was created with."""
    require_process_group("default_group_timeout")
    pg = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    try:
        timeout = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=fallback_s)


_SIDE_GROUP_SOCKETS: set[int] = set()  # file descriptors of side groups' connections: never shut down
_RANK_ADDRESSES: set[str] = set()  # the other ranks' addresses, as side groups connected to them


def _socket_fds() -> set[int]:
    """This process's open socket file descriptors (Linux: /proc/self/fd; elsewhere none are known)."""
    fds = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except (OSError, ValueError):
            pass
    return fds


def _store_ports(store: Any) -> set[int]:
    """The TCP ports of the store chain (a TCPStore under PrefixStores), whose connections must stay up."""
    ports = {int(os.environ["MASTER_PORT"])} if os.environ.get("MASTER_PORT", "").isdigit() else set()
    seen = 0
    while store is not None and seen < 32:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        store = getattr(store, "underlying_store", None)
        seen += 1
    return ports


def _tcp_connections(fds: set[int]):
    """(fd, socket duplicate, local (address, port), peer (address, port)) of the connected TCP sockets
    among ``fds``; each duplicate is closed once the caller moves on to the next."""
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                yield fd, sock, sock.getsockname()[:2], sock.getpeername()[:2]  # raises if not connected
        except OSError:
            pass
        finally:
            sock.close()


def _shut_down_connections(keep_ports: set[int]) -> int:
    """Shut down (not close: their owners keep valid descriptors) this process's TCP connections to the
    other ranks (the addresses side groups connected to), except the side groups' own and those to or from
    ``keep_ports`` (the store).  -> how many were shut down."""
    count = 0
    for _, sock, local, peer in _tcp_connections(_socket_fds() - _SIDE_GROUP_SOCKETS):
        if peer[0] not in _RANK_ADDRESSES or local[1] in keep_ports or peer[1] in keep_ports:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
    return count


def side_group(tag: str, timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A private gloo group of all ranks over the default group's store, for host-side agreement.

    Collective: every rank calls it with the same ``tag`` (which must be new for this store).  The group is
    not registered with torch.distributed: use its methods (``allreduce([t]).wait()``) directly.  It has
    its own connections, so collectives on it never match the default group's (a rank that failed can
    agree with peers whatever those were doing), and it keeps working after `tear_down_default_group()`.
    ``timeout`` defaults to the default group's.
    """
    require_process_group("side_group")
    store = dist.PrefixStore(f"cs336-side-group/{tag}/", dist.distributed_c10d._get_default_store())
    before = _socket_fds()
    group = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(),
                                  timeout if timeout is not None else default_group_timeout())
    made = _socket_fds() - before
    _SIDE_GROUP_SOCKETS.update(made)
    _RANK_ADDRESSES.update(peer[0] for _, _, _, peer in _tcp_connections(made))
    return group


def tear_down_default_group() -> None:
    """End this rank's membership of the default process group (and its subgroups) so that peers blocked
    in a collective with this rank fail at once instead of at the timeout.  No-op without a group.

    NCCL: the communicators are aborted (``ncclCommAbort``, which never blocks on work in flight).  gloo:
    gloo cannot abort, and destroying the group closes its connections only once nothing references it,
    which cannot be relied on (torch modules imported after the group was made keep ``dist.group.WORLD``
    as a default argument).  So this rank's TCP connections are shut down first: a peer waiting on one
    raises "Connection closed by peer" at once.  Only connections to the other ranks' addresses (those a
    `side_group` connected to) are touched, sparing the side groups' own and the store's (its port, and
    MASTER_PORT); any other gloo group of this process (a subgroup, a private one) goes down too.  It needs
    Linux's /proc/self/fd and a side group made before; elsewhere only the destroy is done.  Afterwards the
    default group must be made again (`GroupSpec.reinit`) before the next collective.
    """
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        return
    _shut_down_connections(_store_ports(dist.distributed_c10d._get_default_store()))
    dist.destroy_process_group()


@dataclass(frozen=True)
class GroupSpec:
    """How the default process group was made: enough to make it again after `tear_down_default_group`."""

    backend: str
    rank: int
    world_size: int
    timeout: datetime.timedelta
    store: Any  # the default group's store (a fresh prefix of it names each new group)
    device_id: torch.device | None

    @classmethod
    def of_default_group(cls) -> GroupSpec:
        require_process_group("GroupSpec.of_default_group")
        pg = dist.distributed_c10d._get_default_group()
        device_id = getattr(pg, "bound_device_id", None)
        return cls(dist.get_backend(), dist.get_rank(), dist.get_world_size(), default_group_timeout(),
                   dist.distributed_c10d._get_default_store(), device_id)

    def reinit(self, tag: str) -> None:
        """Collective: tear down what is left of the default group and make a new one, as before, over a
        fresh prefix ``tag`` of the same store (every rank passes the same, new ``tag``); return once every
        rank has it (`wait_until_every_rank_connected`)."""
        tear_down_default_group()
        kwargs = {"device_id": self.device_id} if self.device_id is not None else {}
        store = dist.PrefixStore(f"cs336-reinit/{tag}/", self.store)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=self.timeout, **kwargs)
        wait_until_every_rank_connected(store, self.rank, self.world_size, self.timeout)


def wait_until_every_rank_connected(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Collective, over the store only: return once every rank has returned from making its process group.

    gloo's full-mesh connect can return on one rank while a peer still completes its handshake on their
    connection; if the first rank then closes its group (it had nothing more to do, or failed and tore it
    down), the peer's connect fails with "Connection closed by peer".  ``store`` must be the one the group
    was made over (a prefix of it is fine): the keys live under its "cs336-connected/" prefix.
    """
    store.set(f"cs336-connected/{rank}", "1")
    store.wait([f"cs336-connected/{r}" for r in range(world_size)], timeout)


def _to_bytes(value: Any) -> bytes:
    # torch pickles tensors through a queue as shared-memory handles that vanish when the worker exits
    # (the parent then fails with ConnectionResetError); torch.save bytes carry the data by value.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def _destroy_if_initialized() -> None:
    """Destroy the default process group unless ``fn`` already did (or tore it down after a failure)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, store_path: str, backend: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple, results: Any, environ: dict[str, str]) -> None:
    # The forkserver's environment is the one of the moment it started, not the caller's now (a test's
    # monkeypatched variable, CUDA_VISIBLE_DEVICES set since): take the caller's, before anything reads it.
    os.environ.clear()
    os.environ.update(environ)
    # What this process holds now is the forkserver's imports (and fn, args): keep it out of every garbage
    # collection (which would otherwise walk all of torch's objects, and copy each page it touches).
    gc.freeze()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, bound before NCCL creates its communicator
        store = dist.FileStore(store_path, world_size)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        wait_until_every_rank_connected(store, rank, world_size, timeout)  # before any rank can leave
        try:
            value = fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            # Report before tearing down: destroying a group with unmatched collectives in flight (the
            # usual way a rank fails) can block, and the parent must learn the root cause regardless.
            results.put((rank, False, traceback.format_exc()))
            _destroy_if_initialized()
            return
        _destroy_if_initialized()
        results.put((rank, True, _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - init or teardown failed
        results.put((rank, False, traceback.format_exc()))


# Imported once by the forkserver, so that a rank starts with them loaded (torch._dynamo: every torch.optim
# optimizer imports it when first made, 3-4 s).  Nothing here may initialize CUDA (a process forked after
# that cannot use it): importing these does not, torch.cuda calls would.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _start_context():
    """How `spawn` starts its ranks: forked from a forkserver that imported torch once, where the platform has
    one (Linux, macOS), instead of a fresh interpreter importing it again (2-3 s of CPU per rank, per call).

    The server is one per process, started by the first `spawn` from a clean interpreter (not a fork of the
    caller: threads and CUDA state of the caller do not reach it), and ends with the caller.  Its environment
    is the caller's at that first call, so `_worker` installs the caller's current one; only what torch reads
    at import (e.g. TORCH_* logging switches) stays as it was when the server started.  Elsewhere (Windows)
    each rank is a fresh interpreter (spawn)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # no effect once the server runs (it keeps its modules)
    return ctx


def _start(procs: list[Any], within_s: float) -> None:
    """Start ``procs``, or raise SpawnError after ``within_s``: a forkserver's start blocks until the server
    has imported its preload and forked, which must not block the caller without end if it never does."""
    errors: list[BaseException] = []

    def start_all() -> None:
        try:
            for p in procs:
                p.start()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)

    starter = threading.Thread(target=start_all, name="cs336-spawn-start", daemon=True)
    starter.start()
    starter.join(within_s)
    if errors:
        raise errors[0]  # e.g. fn or args that cannot be pickled
    if starter.is_alive():
        raise SpawnError(f"the ranks' processes did not start within {within_s:.0f} s (startup_s)")


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 120.0, startup_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function).  Collectives inside time out after
    ``timeout_s`` as well, so a rank waiting on a peer that never arrives fails instead of hanging.
    ``startup_s`` is added to the job's deadline for process start-up (the first call starts the forkserver,
    which imports torch: seconds) and bounds the start of the processes itself.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' with world_size={world_size} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    ctx = _start_context()
    results = ctx.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="cs336-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker,
                        args=(r, world_size, store_path, backend, timeout_s, fn, args, results, environ),
                        daemon=True)
            for r in range(world_size)
        ]
        deadline = time.monotonic() + timeout_s + startup_s
        collected: dict[int, tuple[bool, Any]] = {}
        failure: str | None = None
        try:
            _start(procs, within_s=startup_s)
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
                    # a peer that died without a word (a crash) is often the root cause of the others' errors
                    dead = {r: p.exitcode for r, p in enumerate(procs) if r not in collected and p.exitcode is not None}
                    if dead:
                        failure += (f"\nrank(s) {sorted(dead)} exited with codes {[dead[r] for r in sorted(dead)]} "
                                    "without reporting a result")
                    break
        finally:
            procs = [p for p in procs if p.pid is not None]  # started (all, unless `_start` raised)
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
