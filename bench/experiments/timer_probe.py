"""What one %globaltimer read (or nothing, or a 64-bit RED.MAX) costs in SM cycles, per thread, many times:
`python -m bench.experiments.timer_probe` (a diagnostic of docs/perf-log.md v19)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, const_expr

from cute_kernels import ptx

OPS = ("none", "globaltimer", "red")
SLOW_CYCLES = 1000


class Probe:
    """`iters` timed rounds per thread of `op` between two %clock64 reads; per thread: worst, slow count, sum."""

    def __init__(self, op: str, iters: int) -> None:
        assert op in OPS
        self.op, self.iters = op, iters

    @cute.jit
    def __call__(self, out: cute.Tensor, scratch: cute.Tensor, blocks: cutlass.Constexpr):
        self.kernel(out, scratch).launch(grid=[blocks, 1, 1], block=[128, 1, 1])

    @cute.kernel
    def kernel(self, out: cute.Tensor, scratch: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        worst, slow, total, acc = Int64(0), Int64(0), Int64(0), Int64(0)
        for i in cutlass.range(self.iters):
            c0 = ptx.clock64()
            if const_expr(self.op == "globaltimer"):
                acc = acc + ptx.globaltimer()
            if const_expr(self.op == "red"):
                cute.arch.atomic_max(scratch.iterator + (bx * 4 + tidx // 32), Int32(i), sem="relaxed", scope="gpu")
            d = ptx.clock64() - c0
            worst = cutlass.max(worst, d)
            slow = slow + Int64(cutlass.select_(d > Int64(SLOW_CYCLES), Int64(1), Int64(0)))
            total = total + d
        g = bx * 128 + tidx
        out[g, 0], out[g, 1], out[g, 2], out[g, 3] = worst, slow, total, acc


def main() -> int:
    dev = torch.device("cuda")
    iters = 20000
    for blocks in (8, 132):
        for op in OPS:
            out = torch.zeros(blocks * 128, 4, dtype=torch.int64, device=dev)
            scratch = torch.zeros(blocks * 4, dtype=torch.int32, device=dev)
            args = (cute.runtime.from_dlpack(out), cute.runtime.from_dlpack(scratch))
            fn = cute.compile(Probe(op, iters), *args, blocks)
            for _ in range(2):  # the second launch is the one read
                fn(*args)
                torch.cuda.synchronize()
            o = out.cpu().double()
            n = blocks * 128 * iters
            print(f"blocks {blocks:3d} op {op:12s} mean cycles {o[:, 2].sum() / n:8.1f}  max {int(o[:, 0].max()):8d}  "
                  f"frac>{SLOW_CYCLES}cyc {o[:, 1].sum() / n:.2e}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
