"""Choosing, and measuring, the tile configuration of each FlashAttention-2 Triton kernel.

    select(bh, n_queries, n_keys, head_dim, dtype, causal, device) -> {"fwd"|"dkdv"|"dq": TileConfig}
    tune(bh, n_queries, n_keys, head_dim, dtype, causal)            -> TuneResult (and cached)

`select` is what every call uses: the autotune cache for this GPU model and Triton version, else the
configurations measured on an H100 and committed in `configs.TUNED_SM90` (sm_90 devices only),
else `configs.default_config`.  Results are memoized per (ShapeKey, device), so the eager path pays
for the lookup once per shape bucket.

Autotuning is opt-in: `CS336_FLASH_AUTOTUNE=1` makes an eager call on real CUDA tensors tune its shape
bucket on a cache miss (random inputs of the call's shape; the call's own tensors are never touched), or
run it ahead of time:

    python -m cs336_systems.flash_autotune --shape 16,16384,64 --dtype bf16 --causal

Under torch.compile the kernels are chosen while tracing, on fake tensors that cannot be timed, so a
compiled call reads the cache but never tunes: tune the shape first (eagerly or with the CLI).

Tuning one shape: every candidate of `configs.candidates` for each kernel is compiled, checked
against the default configuration's output (a wrong result disqualifies it) and timed with
`triton.testing.do_bench` (median); candidates that fail to compile or launch (shared memory) are
skipped.  Each kernel is timed alone, on the same inputs, so the three choices are independent.  The
cache is a JSON file, `$CS336_FLASH_CACHE` or ~/.cache/cs336_systems/flash-autotune.json, keyed by GPU
name and Triton version, then by `ShapeKey.text()`.

The cache file is only ever rewritten when it is a readable cache (or missing, or empty): a file that does
not parse, or is some other JSON (CS336_FLASH_CACHE pointed at the wrong file), is left untouched and the
new entries go to a file beside it, ``<path>.new`` (or ``<path>.new.1``, ... if that one is taken by
something else too), with a warning naming both.  A symlinked cache is rewritten through the link (the file
it points to is replaced, the link stays), keeping that file's permission bits; a path that names something
other than a regular file (a directory, a device such as /dev/null, a FIFO, a socket) is neither read nor
replaced: `CacheFileError`.  ``CS336_FLASH_AUTOTUNE`` must be unset, "0" or "1"
(anything else is a ValueError listing those), read when a call's shape is first selected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import stat
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from cs336_systems import switches
from cs336_systems.attention.checks import dims_text
from cs336_systems.attention.kernels.portable import configs
from cs336_systems.attention.kernels.portable import launch
from cs336_systems.attention.kernels.portable.configs import KERNELS, ShapeKey, TileConfig
from cs336_systems.cli_args import unwritable_reason
from cs336_systems.switches import interpreter_active  # (re-exported: flash_triton asks it here)

AUTOTUNE_ENV = "CS336_FLASH_AUTOTUNE"
CACHE_ENV = "CS336_FLASH_CACHE"

_selected: dict[tuple[ShapeKey, str], dict[str, TileConfig]] = {}
# Bumped whenever a memoized choice may change (a tuning saved, the memo cleared): flash_triton's recorded
# launches (`replay`) are keyed on it, so they are recorded again with the new choice.
generation = 0
_cache: dict[str, dict[str, dict[str, str]]] | None = None


def cache_path() -> Path:
    return Path(switches.read(CACHE_ENV) or Path.home() / ".cache" / "cs336_systems" / "flash-autotune.json")


def device_id(device: torch.device) -> str:
    """Cache namespace: the GPU model and the Triton version (a new compiler can change the winner)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name} | triton {triton.__version__}"


def autotune_requested() -> bool:
    """``CS336_FLASH_AUTOTUNE``: unset, "" or "0" -> False, "1" -> True; anything else is a ValueError."""
    return switches.read(AUTOTUNE_ENV) == "1"


_CACHE_SHAPE = "expected {device: {shape key: {kernel: config}}}"


class CacheFileError(ValueError):
    """The autotune cache's path names something other than a regular file (or a link to one)."""


# What each kind of non-regular file is called in errors.  Reading a FIFO would block until some writer
# appears, reading a device reads whatever it yields, and replacing any of them (os.replace) would swap a
# system file such as /dev/null for a regular one: none of them is ever opened.
_SPECIAL_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                  (stat.S_ISSOCK, "a socket"))


def _special_kind(path: Path) -> str | None:
    """What ``path`` (through any symlinks) is when it exists and is not a regular file; None for a regular
    file or a missing one (a dangling link included: writing creates its target)."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing, or cannot tell (no permission): the read or write that follows says why
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _SPECIAL_FILES if is_kind(mode)), f"not a regular file (mode {mode:o})")


def _refuse_special(path: Path) -> None:
    """CacheFileError when the cache path names a directory, device, FIFO or socket (see `_SPECIAL_FILES`)."""
    kind = _special_kind(path)
    if kind is None:
        return
    target = path.resolve()
    where = f"{CACHE_ENV}={path}" if switches.read(CACHE_ENV) else f"{path} (the default; {CACHE_ENV} is unset)"
    link = f" (a link to {target})" if str(target) != os.path.abspath(path) else ""
    raise CacheFileError(f"the autotune cache {where}{link} is {kind}, not a regular file: it is neither read nor "
                         f"replaced; set {CACHE_ENV} to the path of a JSON file (missing is fine: it is created)")


def _parse_cache_file(path: Path) -> tuple[dict[str, dict[str, dict[str, str]]] | None, str | None]:
    """(cache, None) for a missing or empty file or a readable cache; (None, why) otherwise (no output).
    Anything but a regular file is (None, what it is), without being opened."""
    kind = _special_kind(path)
    if kind is not None:
        return None, f"{path} is {kind}"
    try:
        text = path.read_text() if path.exists() else ""
        data = json.loads(text) if text.strip() else {}
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError(_CACHE_SHAPE)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        return None, str(exc)
    return data, None


def _read_cache_file(path: Path) -> dict[str, dict[str, dict[str, str]]]:
    """The cache file's {device id: {shape key: {kernel: config text}}}; {} (with a note) if unusable.
    CacheFileError if the path is not a regular file: that is a wrong setting, not a corrupt cache."""
    _refuse_special(path)
    data, problem = _parse_cache_file(path)
    if data is None:
        # A corrupt cache only costs re-tuning; say so rather than failing the attention call.
        print(f"flash_autotune: ignoring unreadable cache {path}: {problem}", file=sys.stderr)
        return {}
    return data


def _foreign(data: dict) -> str | None:
    """Why a parsed file is not this tuner's cache (to be rewritten), or None: every top-level key must be a
    device id ("<GPU> | triton <version>") holding {shape key: {kernel: config}}."""
    for device, entries in data.items():
        if " | triton " not in device:
            return f"key {device!r} is not a device id '<GPU> | triton <version>'"
        if not all(isinstance(entry, dict) for entry in entries.values()):
            return f"entries of {device!r} are not {{kernel: config}} objects"
    return None


def _writable_cache(path: Path) -> tuple[Path, dict[str, dict[str, dict[str, str]]]]:
    """The file to write the cache to and its current contents: ``path`` itself when it is missing, empty
    or a readable cache; otherwise the first of ``<path>.new``, ``<path>.new.1``, ... that is (with a
    warning: the file at ``path`` is never overwritten).  CacheFileError when ``path`` is not a regular file
    (nor a link to one): a mistyped setting such as /dev/null is refused rather than worked around."""
    _refuse_special(path)
    data, problem = _parse_cache_file(path)
    if data is not None:
        problem = _foreign(data)
        if problem is None:
            return path, data
    for index in range(100):
        beside = path.with_name(path.name + (".new" if index == 0 else f".new.{index}"))
        other, _ = _parse_cache_file(beside)
        if other is not None and _foreign(other) is None:
            warnings.warn(
                f"flash_autotune: {path} ({CACHE_ENV}) is not a readable autotune cache ({problem}); it is left "
                f"untouched and the tuned configurations are saved to {beside} instead: fix or remove {path}, "
                f"or point {CACHE_ENV} at {beside}", RuntimeWarning, stacklevel=3)
            return beside, other
    raise RuntimeError(f"flash_autotune: {path} is not a readable autotune cache ({problem}) and no free file "
                       f"beside it ({path.name}.new ... .new.99) to save to")


def _load_cache() -> dict[str, dict[str, dict[str, str]]]:
    global _cache
    if _cache is None:
        _cache = _read_cache_file(cache_path())
    return _cache


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside the cache file (POSIX); elsewhere, no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent tuners may then lose an entry (re-tuned later)
        yield
        return
    # "a", not "w": opening never truncates whatever is already there
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to the regular file ``path`` names, atomically (readers see the old file or the new one,
    never half of it): through symlinks, so the file a link points to is replaced and the link stays; with
    the replaced file's permission bits (a new file gets the umask's)."""
    target = path.resolve()  # os.replace onto a link would replace the link itself
    try:
        st = target.stat()
    except FileNotFoundError:
        mode = None
    else:
        if not stat.S_ISREG(st.st_mode):  # checked by the callers; again here, where it is replaced
            raise CacheFileError(f"flash_autotune: {target} is {_special_kind(target)}, not a regular file: "
                                 f"not replaced ({CACHE_ENV}={switches.read(CACHE_ENV)!r})")
        mode = stat.S_IMODE(st.st_mode)
    for _ in range(100):  # a name no one else uses (O_EXCL), in the target's directory: os.replace stays atomic
        tmp = target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"flash_autotune: no free temporary file name beside {target}")
    try:
        with os.fdopen(fd, "w") as out:
            if mode is not None:
                os.chmod(tmp, mode)  # before any content: a 600 cache is never readable by others, even here
            out.write(text)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _store_cache(device: torch.device, key: ShapeKey, chosen: dict[str, TileConfig]) -> None:
    """Add one entry: re-read the file under a lock and merge, so entries other processes saved since this
    one loaded the cache are kept; then write atomically (readers never see a half-written file)."""
    global _cache, generation
    path = cache_path()
    _refuse_special(path)  # before creating anything for it (the directory, the lock)
    real = path.resolve()  # the lock goes beside the file written, shared by every link to it
    real.parent.mkdir(parents=True, exist_ok=True)
    with _locked(real):
        target, cache = _writable_cache(path)  # never the file at path when it is not a readable cache
        cache.setdefault(device_id(device), {})[key.text()] = {kernel: cfg.short() for kernel, cfg in chosen.items()}
        _replace_file(target, json.dumps(cache, indent=1, sort_keys=True))
    _cache = cache
    generation += 1


def cached(key: ShapeKey, device: torch.device) -> dict[str, TileConfig] | None:
    entry = _load_cache().get(device_id(device), {}).get(key.text())
    if not isinstance(entry, dict) or set(entry) != set(KERNELS):
        return None
    try:
        return {kernel: TileConfig.parse(text) for kernel, text in entry.items()}
    except (AttributeError, TypeError, ValueError) as exc:  # a hand-edited or foreign entry: fall back
        print(f"flash_autotune: ignoring cache entry {key.text()} in {cache_path()}: {exc}", file=sys.stderr)
        return None


def clear_memo() -> None:
    """Forget memoized choices and the loaded cache (tests; after editing the cache file)."""
    global _cache, generation
    _selected.clear()
    _cache = None
    generation += 1


def select(bh: int, n_queries: int, n_keys: int, head_dim: int, dtype: torch.dtype, causal: bool,
           device: torch.device, *, may_tune: bool = False) -> dict[str, TileConfig]:
    """The configuration of each kernel for this call (see the module docstring for the order)."""
    if interpreter_active():
        autotune_requested()  # validated here too, though nothing is tuned in the interpreter
        return configs.INTERPRETER
    key = ShapeKey.of(bh, n_queries, n_keys, head_dim, dtype, causal)
    memo_key = (key, str(device))
    chosen = _selected.get(memo_key)
    if chosen is not None:
        return chosen
    tune_on_miss = autotune_requested()  # once per shape bucket, before the cache lookup: a typo always shows
    chosen = cached(key, device)
    if chosen is None and may_tune and tune_on_miss:
        chosen = tune(bh, n_queries, n_keys, head_dim, dtype, causal, device).chosen
    if chosen is None:
        chosen = configs.tuned_for_device(key, device) or configs.default_config(key)
    _selected[memo_key] = chosen
    return chosen


@dataclass
class TuneResult:
    key: ShapeKey
    shape: tuple[int, int, int, int]  # (BH, Nq, Nk, d) that was timed
    chosen: dict[str, TileConfig]
    timings_ms: dict[str, dict[str, float | str]] = field(default_factory=dict)  # kernel -> config -> ms or error
    natural_order_ms: dict[str, float] = field(default_factory=dict)  # causal: winner without longest-first
    seconds: float = 0.0

    def as_json(self) -> dict:
        return {
            "key": self.key.text(), "shape": list(self.shape), "seconds": round(self.seconds, 2),
            "chosen": {kernel: cfg.short() for kernel, cfg in self.chosen.items()}, "timings_ms": self.timings_ms,
            "natural_order_ms": self.natural_order_ms,
        }


def _do_bench(fn: Callable[[], None]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    # Same algorithm, different tile order: agreement to a few ulps of the output's dtype.
    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().clamp_min(1e-6)
    return bool(torch.isfinite(out).all()) and float((out.float() - ref.float()).abs().max() / scale) <= tol


class _Warmup:
    """Stands in for `wrap(kernel)`: `[grid](*args, **kw)` compiles for these arguments without launching."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def _precompile(jobs: list[tuple[Callable, TileConfig]]) -> None:
    """Compile every candidate in parallel threads (Triton's passes and ptxas release the GIL for much
    of a compile), so tuning from an empty cache costs about one compile per core, not one per candidate.
    Failures are left for the timed loop to record."""

    def compile_one(job):
        runner, cfg = job
        try:
            runner(cfg, _Warmup)
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, jobs))


def tune(bh: int, n_queries: int, n_keys: int, head_dim: int, dtype: torch.dtype, causal: bool,
         device: torch.device | str = "cuda", *, kernels: tuple[str, ...] = KERNELS,
         bench: Callable[[Callable[[], None]], float] = _do_bench, save: bool = True) -> TuneResult:
    """Time every candidate of each kernel on random (BH, N, d) inputs; cache and return the fastest.

    `bench(fn) -> ms` times one launch (injectable for tests); `save=False` leaves the cache alone.
    """
    device = torch.device(device)
    key = ShapeKey.of(bh, n_queries, n_keys, head_dim, dtype, causal)
    start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(n: int) -> torch.Tensor:
        return torch.randn(bh, n, head_dim, device=device, dtype=dtype, generator=gen)

    q, k, v, do = rand(n_queries), rand(n_keys), rand(n_keys), rand(n_queries)
    base = configs.default_config(key)
    # A forward that runs split by default (`configs.FORWARD_SPLIT_HEAD_DIMS`) has its configuration
    # keyed by the padded width, which d 112 and 128 share: time the padded tile there, so that the cache entry
    # means one tile for every head dim that reads it (the split one holds fewer columns, so it fits too).
    fwd_tiles = None if configs.split_opted_in(head_dim, dtype) else (configs.block_d(head_dim), 0)
    o = torch.empty_like(q)
    lse = torch.empty(bh, n_queries, device=device, dtype=torch.float32)
    launch.forward(q, k, v, o, lse, causal, base["fwd"], tiles=fwd_tiles)
    delta = torch.empty_like(lse)
    launch.dq(q, k, v, do, lse, delta, torch.empty_like(q), causal, base["dq"], o=o)  # fills delta for dK/dV
    out = {"fwd": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v), "dq": torch.empty_like(q)}
    scratch_lse = torch.empty_like(lse)
    runners = {
        "fwd": lambda cfg, wrap=launch.direct: launch.forward(q, k, v, out["fwd"], scratch_lse, causal, cfg, wrap,
                                                            tiles=fwd_tiles),
        "dkdv": lambda cfg, wrap=launch.direct: launch.dkdv(q, k, v, do, lse, delta, out["dk"], out["dv"], causal,
                                                           cfg, wrap),
        # it also rewrites delta (the same values) as the backward's first kernel does
        "dq": lambda cfg, wrap=launch.direct: launch.dq(q, k, v, do, lse, delta, out["dq"], causal, cfg, wrap, o=o),
    }
    produced = {"fwd": ("fwd",), "dkdv": ("dk", "dv"), "dq": ("dq",)}
    refs = {}
    for kernel in kernels:
        runners[kernel](base[kernel])
        refs[kernel] = [out[name].clone() for name in produced[kernel]]

    if not interpreter_active():
        _precompile([(runners[kernel], cfg) for kernel in kernels for cfg in configs.candidates(kernel, key)])

    chosen = dict(base)
    result = TuneResult(key, (bh, n_queries, n_keys, head_dim), chosen)
    for kernel in kernels:
        timings: dict[str, float | str] = {}
        best = None
        for cfg in configs.candidates(kernel, key):
            try:
                runners[kernel](cfg)
                if not all(_close(out[name], ref) for name, ref in zip(produced[kernel], refs[kernel])):
                    timings[cfg.short()] = "wrong result"
                    continue
                ms = bench(lambda cfg=cfg: runners[kernel](cfg))
            except Exception as exc:  # out of shared memory / registers, compile errors: not a candidate here
                timings[cfg.short()] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                continue
            timings[cfg.short()] = round(ms, 5)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            chosen[kernel] = best[1]
        result.timings_ms[kernel] = timings
    if causal and not interpreter_active():
        # The longest-first lever, measured with the winners: same kernels launched in natural tile order.
        natural = {
            "fwd": lambda: launch.forward(q, k, v, out["fwd"], scratch_lse, causal, chosen["fwd"], longest_first=False,
                                          tiles=fwd_tiles),
            "dq": lambda: launch.dq(q, k, v, do, lse, delta, out["dq"], causal, chosen["dq"], longest_first=False,
                                    o=o),
        }
        for kernel in set(natural) & set(kernels):
            result.natural_order_ms[kernel] = round(bench(natural[kernel]), 5)
    result.seconds = time.perf_counter() - start
    if save and set(kernels) == set(KERNELS):
        _store_cache(device, key, chosen)
        _selected[(key, str(device))] = chosen
    return result


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        bh, n, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants BH,N,D (e.g. 16,16384,64); got {text!r}") from None
    if bh < 1 or n < 1 or d not in configs.HEAD_DIMS:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: BH and N must be >= 1 and D one of the {dims_text(configs.HEAD_DIMS)}")
    return bh, n, d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=_parse_shape, action="append", required=True,
                        help="BH,N,D (repeatable): batch*heads, sequence length (Nq = Nk), head dim")
    parser.add_argument("--dtype", choices=sorted(DTYPES), action="append", help="repeatable; default bf16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, help="write every candidate's timing here")
    parser.add_argument("--no-save", action="store_true", help="do not write the cache")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("autotuning times kernels on a CUDA device; none is available")
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--json: {exc}")
        reason = unwritable_reason(args.json)
        if reason is not None:  # before tuning, not after it
            parser.error(f"--json: {reason}")
    results = []
    for dtype_name in args.dtype or ["bf16"]:
        for bh, n, d in args.shape:
            res = tune(bh, n, n, d, DTYPES[dtype_name], args.causal, save=not args.no_save)
            best = {kernel: res.timings_ms[kernel].get(cfg.short()) for kernel, cfg in res.chosen.items()}
            print(f"{res.key.text()}: {res.as_json()['chosen']} ms {best} ({res.seconds:.1f} s)", flush=True)
            results.append(res.as_json())
    if args.json:
        args.json.write_text(json.dumps({"device": device_id(torch.device("cuda")), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
