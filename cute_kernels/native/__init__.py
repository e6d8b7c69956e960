"""The C launch entry (`launch.c`): built once per source, Python and TVM-FFI version into the kernel cache folder,
then loaded. A kept launch through it allocates its outputs and calls the kernel's TVM-FFI entry in one C call."""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import tvm_ffi
import tvm_ffi.libinfo

from cute_kernels.compile import _FileLock, cache_dir

log = logging.getLogger("boundary")
SOURCE = Path(__file__).with_name("launch.c")
MODULE = "_mhc_launch"


class NativeBuildError(RuntimeError):
    """The C launch entry could not be built or loaded (the message holds the compiler's command and output)."""


def _command(src: Path, out: Path) -> list[str]:
    """The compiler command that builds the extension (`$CC`, else `cc`)."""
    tvm_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    return [
        *shlex.split(os.environ.get("CC", "cc")),
        "-O2",
        "-shared",
        "-fPIC",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{tvm_ffi.libinfo.find_include_path()}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
        str(src),
        "-o",
        str(out),
        f"-L{tvm_lib}",
        "-ltvm_ffi",
        f"-Wl,-rpath,{tvm_lib}",
    ]


def library_path() -> Path:
    """Where the built extension lives: keyed by its source, this Python and the TVM-FFI version."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{sys.implementation.cache_tag};{sysconfig.get_platform()};tvm_ffi={tvm_ffi.__version__}".encode())
    return cache_dir() / "native" / f"{MODULE}-{h.hexdigest()[:20]}.so"


def build(path: Path) -> None:
    """Compile launch.c to `path` (atomically: a process that loads it never sees half a file)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp.so")
    cmd = _command(SOURCE, tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise NativeBuildError(f"cannot run the C compiler ({shlex.join(cmd)}): {e}") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    os.replace(tmp, path)


@functools.lru_cache(maxsize=1)
def module() -> ModuleType:
    """The loaded `_mhc_launch` extension, built on first use (one build per host, under a file lock)."""
    path = library_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with _FileLock(path.with_suffix(".lock")):
            if not path.exists():
                log.info("building the C launch entry: %s", path)
                build(path)
    spec = importlib.util.spec_from_file_location(
        MODULE, path, loader=importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    )
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the C launch entry is built and loaded; if not, says why once (a warning), and launches stay Python's."""
    try:
        module()
    except Exception as e:  # noqa: BLE001 - any build or load failure leaves the Python launch, said out loud
        log.warning("the C launch entry is not available, kept launches stay in Python (about 2 us more a call): %s", e)
        return False
    return True


def launch(fn: Any, plan: tuple, outputs: int) -> Callable[..., tuple] | None:
    """A C launch of `fn` (a compiled kernel's TVM-FFI function) by `plan` (launch.c's header): a call returns a
    tuple of `outputs` entries, its new outputs then None. None where `fn` is not a TVM-FFI function (a test's
    stand-in) or the entry is not available."""
    if not isinstance(fn, tvm_ffi.Function) or not available():
        return None
    return module().Launch(fn, plan, torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor, outputs)
