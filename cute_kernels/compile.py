"""Arch pinning, the compile cache (memory + disk) and warmup for the CuTe DSL kernels."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import inspect
import logging
import os
import pickle
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
import tvm_ffi

log = logging.getLogger("boundary")
SUPPORTED_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")
EXPORT_NAME = "func"
_KERNEL_DIR = Path(__file__).resolve().parent


class UnsupportedGPUError(RuntimeError):
    """Raised when the GPU in hand is not one the CuTe DSL kernels are built for."""


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for a compute capability: sm_90a on Hopper, sm_100a on Blackwell."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if (major, minor) == (10, 0):
        return "sm_100a"
    raise UnsupportedGPUError(
        f"the fused mHC boundary kernels are built for sm_90a (H100/H200) and sm_100a (B200/GB200); "
        f"this GPU is sm_{major}{minor}. Use the reference path instead: "
        f"BoundaryAllReduce(..., backend='reference')."
    )


def arch_for_device(device: Any) -> str:
    """The compile target for a torch CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return arch_for_capability(major, minor)


def check_arch(arch: str) -> None:
    """Raise unless `arch` is one of the compile targets we support."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")


def fake_tensor(dtype: type, shape: Sequence[Any], *, divisibility: int = 8) -> cute.Tensor:
    """A fake compact row-major tensor for tensor-free compiles; shape entries are ints or sym_ints."""
    align = max(1, min(16, divisibility * dtype.width // 8))
    order = tuple(range(len(shape) - 1, -1, -1))
    return cute.runtime.make_fake_compact_tensor(dtype, tuple(shape), stride_order=order, assumed_align=align)


def fake_stream() -> Any:
    """The fake stream that makes a compiled function launch on the caller's current torch stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(kernel: Any, *args: Any, arch: str) -> Callable[..., Any]:
    """Compile one kernel object for `arch` with the TVM-FFI call path."""
    check_arch(arch)
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def cache_dir() -> Path:
    """The on-disk cache folder: $MHC_BOUNDARY_CACHE_DIR, else a per-user folder under the temp dir."""
    root = os.environ.get("MHC_BOUNDARY_CACHE_DIR")
    if root:
        return Path(root)
    user = os.environ.get("USER") or str(os.getuid())
    return Path(tempfile.gettempdir()) / user / "mhc_boundary_cache"


def disk_cache_enabled() -> bool:
    """Whether compiled kernels are stored on disk ($MHC_BOUNDARY_DISK_CACHE=0 turns it off)."""
    return os.environ.get("MHC_BOUNDARY_DISK_CACHE", "1") != "0"


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of the kernel sources, the Python minor version, the host's machine type (a cache folder shared by
    x86_64 and aarch64 hosts holds one object per machine) and the DSL / TVM-FFI versions."""
    h = hashlib.sha256()
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor};{platform.machine()}".encode())
    h.update(f"cutlass={cutlass.__version__};tvm_ffi={tvm_ffi.__version__}".encode())
    for src in sorted(_KERNEL_DIR.rglob("*.py")):
        h.update(src.relative_to(_KERNEL_DIR).as_posix().encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:24]


class _FileLock:
    """An advisory flock on a lock file: the kernel drops it when its holder exits, killed or not, so a lock is never
    stale. Blocking; `waiting(holder)` is called once if another process holds it (its pid, read from the file)."""

    def __init__(self, path: Path, waiting: Callable[[str], None] | None = None) -> None:
        self.path, self.waiting = path, waiting
        self.fd = -1

    def __enter__(self) -> _FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if self.waiting is not None:
                self.waiting(os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


@dataclass
class CacheStats:
    """Counts of how compiled kernels were obtained in this process."""

    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    compile_processes: int = 0  # started by this process's warmups


STATS = CacheStats()
# A compile process of a warmup (_worker_main) only fills the disk cache: it loads nothing it compiles.
_EXPORT_ONLY = False


def _load(path: Path) -> Callable[..., Any]:
    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]


def jit_cache(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Cache a tensor-free compile function in memory and as exported .o files on disk.

    The key is the call's arguments bound to `fn`'s signature, defaults filled in, under a fingerprint of the
    kernel sources and the DSL version, so an edited kernel never loads a stale object, and every spelling of one
    call (a default left out or passed, positionally or by name) is one kernel: a warmup that launched it has
    loaded what the call runs (a second object of the same kernel would load its module at its first launch,
    which can wait for a spinning peer boundary until its timeout).
    """
    memory: dict[tuple, Callable[..., Any]] = {}  # by canonical key
    spelled: dict[tuple, Callable[..., Any]] = {}  # by the call's own spelling: a hit costs no signature binding
    signature = inspect.signature(fn)

    def canonical(args: tuple, kwargs: dict[str, Any]) -> tuple:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return (fn.__qualname__, tuple(bound.arguments.items()))

    def object_path(key: tuple) -> tuple[Path, str]:
        folder = cache_dir() / source_fingerprint()
        digest = hashlib.sha256(pickle.dumps(key)).hexdigest()[:32]
        return folder / f"{fn.__name__}-{digest}.o", digest

    def ready(*args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments needs no compile: in memory, or on disk."""
        key = canonical(args, kwargs)
        return key in memory or (disk_cache_enabled() and object_path(key)[0].exists())

    @functools.wraps(fn)
    def cached(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        spelling = (args, tuple(kwargs.items()))
        hit = spelled.get(spelling)
        if hit is None:
            hit = memory.get(canonical(args, kwargs))
            if hit is not None:
                spelled[spelling] = hit
        if hit is not None:
            STATS.memory_hits += 1
            return hit
        compiled = _compiled(args, kwargs)
        if compiled is not None:  # None: a compile process's export only
            spelled[spelling] = compiled
        return compiled

    def _compiled(args: tuple, kwargs: dict[str, Any]) -> Callable[..., Any]:
        key = canonical(args, kwargs)
        if not disk_cache_enabled():
            STATS.compiles += 1
            memory[key] = compiled = fn(*args, **kwargs)
            return compiled
        obj, digest = object_path(key)
        folder = obj.parent
        folder.mkdir(parents=True, exist_ok=True)
        # One compile per key on the host: a process that finds the lock held waits for the object, then loads it.
        with _FileLock(folder / f"{digest}.lock"):
            compiled = None
            if obj.exists():
                if _EXPORT_ONLY:
                    return None  # type: ignore[return-value]
                try:
                    compiled = _load(obj)
                    STATS.disk_hits += 1
                except Exception:  # a truncated or foreign object: rebuild it
                    obj.unlink(missing_ok=True)
            if compiled is None:
                STATS.compiles += 1
                compiled = fn(*args, **kwargs)
                tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
                compiled.export_to_c(object_file_path=str(tmp), function_name=EXPORT_NAME)
                os.replace(tmp, obj)
                if _EXPORT_ONLY:
                    return None  # type: ignore[return-value]
                # Serve the loaded object, not the in-process JIT result, so that a cache hit
                # and a miss run the very same code path.
                compiled = _load(obj)
        memory[key] = compiled
        return compiled

    def cache_clear() -> None:
        memory.clear()
        spelled.clear()

    cached.cache_clear = cache_clear  # type: ignore[attr-defined]
    cached.ready = ready  # type: ignore[attr-defined]
    cached.key = lambda *args, **kwargs: canonical(args, kwargs)  # type: ignore[attr-defined]
    return cached


_CU_MODULE_LAZY_LOADING = 2  # CUmoduleLoadingMode (cuda.h)


def lazy_module_loading() -> bool:
    """Whether this process's CUDA loads kernels lazily, at their first launch (the driver's default)."""
    # The driver's own entry point: cuda.bindings' first driver call resolves its whole table through
    # cuGetProcAddress, whose misses memcheck reports as API errors (34 on the H200's driver).
    mode = ctypes.c_int()
    err = ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode))
    if err != 0:
        raise RuntimeError(f"cuModuleGetLoadingMode failed: CUresult {err}")
    return mode.value == _CU_MODULE_LAZY_LOADING


# The compiled functions that have launched in this process, by id and device, each held here: a jit_cache's
# cache_clear drops its objects, and a new object must never inherit a dropped one's id, and with it "launched". CUDA
# loads a module onto a GPU (its context) at its function's first launch there, and a load may wait for every running
# kernel of the context: a kernel that spins on its peers (CONTRACT §7) must not meet one.
_LAUNCHED: dict[tuple[int, tuple[str, int]], Callable[..., Any]] = {}


_CONTEXTS: dict[torch.device, tuple[str, int]] = {}  # an indexed device's key (reading a device's fields is slow)


def _context(device: Any) -> tuple[str, int]:
    """The device whose CUDA context a module loads into (None or "cuda": the current one)."""
    key = _CONTEXTS.get(device) if type(device) is torch.device else None
    if key is not None:
        return key
    d = torch.device("cuda" if device is None else device)
    if d.index is not None:
        if type(device) is torch.device:
            _CONTEXTS[device] = (d.type, d.index)
        return d.type, d.index
    if d.index is not None:
        return d.type, d.index
    return d.type, torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0


def mark_launched(fn: Callable[..., Any], device: Any = None) -> None:
    """Record that `fn` has launched on `device` in this process (its module is loaded there)."""
    _LAUNCHED[(id(fn), _context(device))] = fn


def launched(fn: Callable[..., Any], device: Any = None) -> bool:
    """Whether `fn` has launched on `device` in this process."""
    return _LAUNCHED.get((id(fn), _context(device))) is fn


@dataclass(frozen=True)
class WarmupJob:
    """One compile an engine needs before CUDA-graph capture, and how to load its kernel onto a GPU."""

    name: str
    compile_fn: Callable[..., Any]
    args: tuple
    kwargs: tuple = ()
    # Launches the compiled function once on scratch buffers of its own (fn, device): CUDA loads its module then.
    load: Callable[[Callable[..., Any], Any], None] | None = None

    def run(self) -> Callable[..., Any]:
        """Compile (or load) the kernel of this job."""
        return self.compile_fn(*self.args, **dict(self.kwargs))

    def ready(self) -> bool:
        """Whether the compiled kernel is in memory or on disk already (no compile needed)."""
        return self.compile_fn.ready(*self.args, **dict(self.kwargs))


def default_workers() -> int:
    """Compile processes for a warmup: the CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def warmup(
    jobs: Iterable[WarmupJob],
    *,
    progress: bool = True,
    desc: str = "compiling mHC kernels",
    workers: int | None = None,
    device: Any = None,
) -> int:
    """Compile or load every job, with a progress bar on stderr; returns how many ran.

    The jobs not yet in the disk cache compile in `workers` spawned processes (default: the cores available),
    which leave their objects in the cache; this process then loads them. One process on the host compiles at a
    time (a lock on the cache folder, dropped by the kernel if its holder dies): the ranks of a TP group that warm
    up together compile each kernel once, with the cores used once, and the others load what it left. With
    `device`, every kernel then launches once on scratch buffers, so that CUDA has loaded every module before any
    boundary spins.
    """
    jobs = list(jobs)
    workers = default_workers() if workers is None else workers
    start = time.perf_counter()
    # Only a jit_cache compile leaves its object where this process finds it.
    missing = [job for job in jobs if hasattr(job.compile_fn, "ready") and not job.ready()]
    where = "here, while loading"
    if missing and disk_cache_enabled():  # a warm cache takes no lock: nothing to wait for
        folder = cache_dir() / source_fingerprint()
        folder.mkdir(parents=True, exist_ok=True)

        def waiting(holder: str) -> None:
            log.info("%s: process %s is compiling into %s; waiting to load what it leaves", desc, holder, folder)
            if progress:
                print(f"{desc}: process {holder} is compiling into {folder}; waiting for it", file=sys.stderr)

        with _FileLock(folder / "warmup.lock", waiting):
            missing = [job for job in missing if not job.ready()]  # what another process compiled meanwhile is ready
            if workers > 1 and len(missing) > 1:
                _compile_in_processes(missing, min(workers, len(missing)), progress, desc)
                where = f"in {min(workers, len(missing))} processes: {time.perf_counter() - start:.1f} s"
            elif missing:
                _progress(missing, progress, desc + " (compiling)", lambda job: job.run())
                where = f"here: {time.perf_counter() - start:.1f} s"
    compiled = time.perf_counter()
    if device is None:
        _progress(jobs, progress, desc, lambda job: job.run())
    else:
        import torch

        with torch.cuda.device(device):
            _progress(jobs, progress, desc + " (loading onto the GPU)", lambda job: _load_onto(job, device))
            torch.cuda.synchronize(device)
    loaded = "loaded and launched once on the GPU" if device is not None else "loaded"
    log.info(
        "%s: %d jobs, %d compiled %s; %s: %.1f s",
        desc,
        len(jobs),
        len(missing),
        where,
        loaded,
        time.perf_counter() - compiled,
    )
    return len(jobs)


def _compile_in_processes(jobs: list[WarmupJob], workers: int, progress: bool, desc: str) -> None:
    """Compile `jobs` into the disk cache in `workers` fresh interpreters (not multiprocessing: that would re-run a
    caller's unguarded main script in every worker). Each gets the job list once, then the index of its next job
    whenever it finishes one (a shared queue: the jobs' costs differ by up to 10x); a progress bar counts them."""
    import struct
    import subprocess
    import threading

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(_KERNEL_DIR.parent), os.environ.get("PYTHONPATH", "")) if p),
    )
    logs = [tempfile.TemporaryFile() for _ in range(workers)]
    STATS.compile_processes += workers
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import cute_kernels.compile as c; c._worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
        for log in logs
    ]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(jobs),
            desc=f"{desc} (compiling {len(jobs)} in {workers} processes)",
            unit="kernel",
            file=sys.stderr,
        )
    lock = threading.Lock()
    pending = iter(range(len(jobs)))
    payload = pickle.dumps(jobs)

    def send_next(proc: subprocess.Popen) -> None:
        with lock:
            index = next(pending, -1)
        proc.stdin.write(struct.pack("<i", index))
        proc.stdin.flush()

    def serve(proc: subprocess.Popen) -> None:
        try:
            proc.stdin.write(struct.pack("<q", len(payload)) + payload)
            send_next(proc)
            for line in proc.stdout:  # one line per compiled job (its name): hand it the next
                if bar is not None:
                    with lock:
                        bar.set_postfix_str(line.decode(errors="replace").strip(), refresh=False)
                        bar.update(1)
                send_next(proc)
        except (BrokenPipeError, OSError):  # the worker died: its log says why
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    servers = [threading.Thread(target=serve, args=(proc,), daemon=True) for proc in procs]
    for server in servers:
        server.start()
    failed = []
    for proc, server, log in zip(procs, servers, logs):
        server.join()
        if proc.wait() != 0:
            log.seek(0)
            failed.append(log.read().decode(errors="replace")[-4000:])
        log.close()
    if bar is not None:
        bar.close()
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {workers} compile processes failed; the last lines of the first:\n{failed[0]}"
        )


def _worker_main() -> None:
    """A compile process of `_compile_in_processes`: reads the pickled job list, then compiles the job of each index
    it is sent (-1, or its parent gone, ends), writing a line to stdout after each. It loads nothing."""
    import struct

    global _EXPORT_ONLY
    _EXPORT_ONLY = True
    stdin = sys.stdin.buffer
    (size,) = struct.unpack("<q", stdin.read(8))
    jobs = pickle.loads(stdin.read(size))
    while True:
        data = stdin.read(4)
        if len(data) < 4:  # the warmup that started this process died: its lock is free, another process goes on
            return
        (index,) = struct.unpack("<i", data)
        if index < 0:
            return
        jobs[index].run()
        sys.stdout.write(jobs[index].name + "\n")
        sys.stdout.flush()


def _load_onto(job: WarmupJob, device: Any) -> None:
    fn = job.run()
    if job.load is not None and not launched(fn, device):
        job.load(fn, device)
        mark_launched(fn, device)


def _progress(items: list, progress: bool, desc: str, step: Callable[[Any], object]) -> None:
    bar = None
    if progress and items:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=desc, unit="kernel", file=sys.stderr)
    for item in items:
        if bar is not None and isinstance(item, WarmupJob):
            bar.set_postfix_str(item.name, refresh=False)
        step(item)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
