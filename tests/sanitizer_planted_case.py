"""A planted out-of-bounds store for compute-sanitizer memcheck: the negative control of
tests/test_peer_sanitizer.py (the sanitizer, run as that test runs it, must report it).

Run as `compute-sanitizer --tool memcheck python -m tests.sanitizer_planted_case`.
"""

from __future__ import annotations

import sys

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from cute_kernels import ptx
from cute_kernels.compile import arch_for_device, compile_kernel, fake_stream, fake_tensor

PAST_THE_END = 1 << 34  # bytes past the buffer: 16 GiB, outside any allocation of this process


class PlantedStore:
    """Thread 0 stores one word PAST_THE_END bytes past `x`."""

    @cute.jit
    def __call__(self, x: cute.Tensor, stream) -> None:
        self.kernel(x).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            ptx.st_global_b32(x.iterator.toint() + Int64(PAST_THE_END), Uint32(1))


def compile_planted(arch: str):
    """The compiled planted store."""
    return compile_kernel(PlantedStore(), fake_tensor(Int32, (32,)), fake_stream(), arch=arch)


def main() -> int:
    device = torch.device("cuda", torch.cuda.current_device())
    fn = compile_planted(arch_for_device(device))
    x = torch.zeros(32, dtype=torch.int32, device=device)
    fn(x)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
