"""Loading before the wait (#46, step 3), an A/B: the default boundary waits for its predecessor grid (PDL) before
any load; the early form (`BoundaryAllReduce(early_loads=True)`) issues the first row's streams and coefficients
before `griddepcontrol.wait` and only the partial after it, as SGLang's V4.1 boundary does. Safe only when the
streams and coefficients are complete before the predecessor starts (CONTRACT §7's precondition).

The chain times what an engine's step would see: STEPS repeats of (a sublayer's last kernel, the boundary) in one
CUDA graph. The stand-in for the sublayer's last kernel (`LastKernel`) waits for the boundary before it (PDL), reads
`--read-mb` MB of weights from a buffer far larger than L2 (each step its own slice: 14.7 MB is DeepSeek-V3's o_proj
at TP 8 and FP8), then writes the boundary's partial x. It triggers its dependents at its start (`start`: the
boundary launches at once and its early loads overlap the weight read) or never (`end`: the boundary launches as the
last CTAs exit, so there is little to overlap). The boundary is the one-rank bf16 layer-input variant; R
double-buffered. Per boundary: (chain - the same chain without boundaries) / STEPS, plain and early; the two chains'
final streams and layer inputs must agree bit for bit.

    python -m bench.experiments.early_loads_ab [--hidden 7168] [--rows 1 4 16 64] [--read-mb 14.7]
"""

from __future__ import annotations

import argparse
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32, const_expr

from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary.api import compile_boundary_kernel, fused_boundary
from cute_kernels.boundary.args import BoundaryVariant
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device, compile_kernel, fake_stream, fake_tensor

STEPS = 16
THREADS = 256
UNROLL = 4  # 16-byte loads in flight per thread per trip
VARIANT = BoundaryVariant("x", False, True)  # a ready partial, the bf16 layer input


class LastKernel:
    """A sublayer's last kernel: waits for its predecessor (PDL), triggers its dependents at its start or never,
    reads `words` 32-bit words from `mWords` at `offset`, then copies mSrc into mX (the boundary's partial)."""

    def __init__(self, trigger: str) -> None:
        self.trigger = trigger

    @cute.jit
    def __call__(
        self,
        mWords: cute.Tensor,
        mSrc: cute.Tensor,
        mX: cute.Tensor,
        mSink: cute.Tensor,
        offset: Int64,
        words: Int32,
        blocks: Int32,
        stream: Any,
    ) -> None:
        self.kernel(mWords, mSrc, mX, mSink, offset, words).launch(
            grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self, mWords: cute.Tensor, mSrc: cute.Tensor, mX: cute.Tensor, mSink: cute.Tensor, offset: Int64, words: Int32
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()
        if const_expr(self.trigger == "start"):
            cute.arch.griddepcontrol_launch_dependents()
        stride = nblk * THREADS
        gid = bidx * THREADS + tidx
        base = mWords.iterator.toint() + offset * 4
        vectors = words // 4
        acc = Uint32(0)
        for trip in cutlass.range(0, cute.ceil_div(vectors, stride * UNROLL), 1):
            got = []
            for u in cutlass.range_constexpr(UNROLL):
                v = (trip * UNROLL + u) * stride + gid
                got.append(ptx.ld_global_v4_pred(base + Int64(v) * 16, v < vectors))
            for u in cutlass.range_constexpr(UNROLL):
                acc = acc ^ got[u][0] ^ got[u][1] ^ got[u][2] ^ got[u][3]
        src, dst = mSrc.iterator.toint(), mX.iterator.toint()
        copies = cute.size(mX) // 8
        for v in cutlass.range(gid, copies, stride):
            w = ptx.ld_global_v4_pred(src + Int64(v) * 16, v < copies)
            ptx.st_global_v4_b32(dst + Int64(v) * 16, w[0], w[1], w[2], w[3])
        if acc == Uint32(0x9E3779B9):  # never, in practice: keeps the reads
            mSink[bidx] = Int32(acc)


def compile_last(arch: str) -> dict[str, Any]:
    """The stand-in, triggering at its start and never, compiled for `arch`."""
    n, t, h = cute.sym_int(), cute.sym_int(), cute.sym_int()
    args = (
        fake_tensor(cutlass.Int32, (n,), divisibility=4),
        fake_tensor(cutlass.BFloat16, (t, h), divisibility=8),
        fake_tensor(cutlass.BFloat16, (t, h), divisibility=8),
        fake_tensor(cutlass.Int32, (cute.sym_int(),), divisibility=1),
        Int64(0),
        Int32(0),
        Int32(1),
    )
    return {trig: compile_kernel(LastKernel(trig), *args, fake_stream(), arch=arch) for trig in ("start", "end")}


def compile_boundaries(H: int, arch: str) -> dict[str, Any]:
    """The plain (shipped) and early boundary kernels of VARIANT at one rank, uncached."""
    config = default_config(H, arch)
    out = {}
    for name, early in (("plain", False), ("early", True)):
        kernel = FusedBoundaryKernel(H, config, y_source="x", shared=False, pre=True, early_loads=early)
        out[name] = compile_boundary_kernel(kernel, H, VARIANT._replace(early_loads=early), 1, arch=arch)
    return out


class Chain:
    """STEPS x (last kernel, boundary) on one device's buffers at `rows` rows."""

    def __init__(self, H: int, rows: int, read_words: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(rows)
        self.H, self.rows, self.read_words = H, rows, read_words
        self.words = torch.zeros(STEPS * read_words + 64, dtype=torch.int32, device=device)
        self.src = [(torch.randn(rows, H, generator=g, device=device) * 0.5).bfloat16() for _ in range(STEPS)]
        self.x = torch.empty(rows, H, dtype=torch.bfloat16, device=device)
        self.sink = torch.zeros(4096, dtype=torch.int32, device=device)
        self.r0 = torch.randn(rows, 4, H, generator=g, device=device).bfloat16()
        self.r = [torch.empty_like(self.r0), torch.empty_like(self.r0)]
        self.post = torch.rand(rows, 4, generator=g, device=device) + 0.5
        self.comb = torch.softmax(torch.randn(rows, 4, 4, generator=g, device=device), -1)
        self.pre = torch.softmax(torch.randn(rows, 4, generator=g, device=device), -1)
        self.norm_weight = (torch.rand(H, generator=g, device=device) + 0.5).bfloat16()
        self.out = torch.empty(rows, H, dtype=torch.bfloat16, device=device)
        self.blocks = 132 * 4

    def run(self, last: Any, boundary: Any | None, arch: str) -> None:
        """The chain once, on the current stream (boundary None: the last kernels alone)."""
        self.r[0].copy_(self.r0)
        for step in range(STEPS):
            last(self.words, self.src[step], self.x, self.sink, step * self.read_words, self.read_words, self.blocks)
            if boundary is not None:
                fused_boundary(
                    VARIANT,
                    residual=self.r[step % 2],
                    post=self.post,
                    comb=self.comb,
                    pre=self.pre,
                    norm_weight=self.norm_weight,
                    norm_eps=1e-6,
                    x=self.x,
                    new_residual=self.r[(step + 1) % 2],
                    out=self.out,
                    compiled=boundary,
                    arch=arch,
                )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--read-mb", type=float, default=14.7, help="weight MB the last kernel reads per step")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    lasts = compile_last(arch)
    read_words = int(args.read_mb * 1e6) // 16 * 4
    print(f"early loads A/B: {torch.cuda.get_device_name()}, {STEPS} steps a graph, {args.read_mb} MB read a step")
    print("   H rows trigger | last only | plain   /bnd | early   /bnd | gain/bnd | exact")
    for H in args.hidden:
        boundaries = compile_boundaries(H, arch)
        for rows in args.rows:
            chain = Chain(H, rows, read_words, device)
            for trig in ("start", "end"):
                last = lasts[trig]
                alone = timer.per_call_us([lambda c=chain, k=last: c.run(k, None, arch)], STEPS)
                got, finals = {}, {}
                for name in ("plain", "early"):
                    got[name] = timer.per_call_us(
                        [lambda c=chain, k=last, b=boundaries[name]: c.run(k, b, arch)], STEPS
                    )
                    chain.run(last, boundaries[name], arch)
                    torch.cuda.synchronize()
                    finals[name] = (chain.r[STEPS % 2].clone(), chain.out.clone())
                exact = all(torch.equal(a, b) for a, b in zip(finals["plain"], finals["early"]))
                plain, early = got["plain"] - alone, got["early"] - alone
                print(
                    f"{H:5d} {rows:4d} {trig:>7} | {alone:9.2f} | {got['plain']:6.2f} {plain:5.2f} | "
                    f"{got['early']:6.2f} {early:5.2f} | {plain - early:8.2f} | {exact}"
                )


if __name__ == "__main__":
    main()
