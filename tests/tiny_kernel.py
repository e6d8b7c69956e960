"""A tiny CuTe DSL kernel that the compile-cache tests compile (kernels must live in importable files)."""

from __future__ import annotations

import os
import time

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from cute_kernels.compile import compile_kernel, fake_stream, fake_tensor, jit_cache


class AddScalar:
    """y = x + s over [T, N] bf16, one CTA per row."""

    def __init__(self, n: int) -> None:
        self.n = n

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, s: Float32, stream) -> None:
        self.kernel(x, y, s).launch(grid=[x.shape[0], 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, y: cute.Tensor, s: Float32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        for i in cutlass.range(tidx, self.n, 128):
            y[row, i] = (x[row, i].to(Float32) + s).to(BFloat16)


_slept = False  # this process has made its first compile


def _note(line: str) -> None:
    """Append a line to $TINY_COMPILE_LOG (the compile-cache tests count compiles across processes by it)."""
    path = os.environ.get("TINY_COMPILE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@jit_cache
def compile_tiny(n: int, *, arch: str):
    """The compiled AddScalar for width n (each real compile noted in $TINY_COMPILE_LOG; a process's first one
    stretched by $TINY_COMPILE_SLEEP seconds, so that a test can kill a process in the middle of it)."""
    global _slept
    _note(f"start {n} {os.getpid()} {os.getppid()}")
    if not _slept:
        _slept = True
        time.sleep(float(os.environ.get("TINY_COMPILE_SLEEP", "0")))
    rows = cute.sym_int()
    compiled = compile_kernel(
        AddScalar(n),
        fake_tensor(BFloat16, (rows, n)),
        fake_tensor(BFloat16, (rows, n)),
        Float32(0),
        fake_stream(),
        arch=arch,
    )
    _note(f"done {n} {os.getpid()}")
    return compiled
