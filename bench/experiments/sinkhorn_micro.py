"""What one Sinkhorn repeat of the coefficients epilogue costs, in SM cycles:
`python -m bench.experiments.sinkhorn_micro`.

One CTA of one warp; its `lanes` first threads (all 32 for the bodies that shuffle) each hold a
4 x 4 matrix in registers and run a loop body n times between two %clock64 reads. Cycles per
iteration = (cycles at n = 1 + N - cycles at n = 1) / N, so the loads, the stores, the clock reads
and whatever the compiler moves across them cancel. Bodies:
- `step`: the epilogue role's own `sinkhorn_step` (a row and a column normalisation of the matrix,
  each sum 3 FADD + eps, rcp.approx, FMULs), one lane per matrix as the kernel runs it;
- `rcp1`: the repeat with one reciprocal per normalisation (1/s_a from 1/(s0 s1 s2 s3));
- `unroll2`: two repeats per loop iteration (half the loop overhead);
- `vectors`: the repeat in scaling-vector form, C = diag(r) K diag(c) with K fixed: a row
  normalisation is r_a *= 1 / (r_a (K c)_a + eps) (28 instructions, FMA trees), a column one alike;
- latency probes: dependent chains of 1 and 8 FADD, 8 FMUL, 4 `rcp.approx` per iteration; one
  and four independent chains of FADD + `rcp.approx`; 8 independent `rcp.approx` (MUFU issue
  interval); a chain of `shfl.bfly` (+ FADD).
The matrix spread over 2 or 4 lanes (the removed `comb_lanes` knob, 140 / 166 cycles against 136-138
for one lane) is in docs/perf-log.md v5.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import ptx as prim
from cute_kernels.coefficients.config import HC
from cute_kernels.coefficients.epilogue import EpilogueRole
from cute_kernels.compile import arch_for_device, compile_kernel, fake_stream, fake_tensor

BODIES = (
    "step", "rcp1", "unroll2", "vectors",
    "fadd_chain", "fadd_chain8", "fmul_chain8", "rcp_chain", "rcp_chain4", "rcp_dep4", "rcp_indep8", "shfl_chain",
)  # fmt: skip
WHOLE_WARP = ("shfl_chain",)  # bodies that shuffle: every lane takes part


class SinkhornMicro:
    """One warp timing `body` n times on a register 4 x 4 matrix per active lane."""

    def __init__(self, body: str, lanes: int) -> None:
        if body not in BODIES:
            raise ValueError(f"body must be one of {BODIES}, got {body!r}")
        self.body = body
        self.lanes = 32 if body in WHOLE_WARP else lanes
        # sinkhorn_step reads no shape of the role: any K, repeat, CTA and split will do.
        self.epilogue = EpilogueRole(K=4 * 4096, sinkhorn_repeat=20, threads=32, groups=1)

    @cute.jit
    def __call__(
        self, mIn: cute.Tensor, mOut: cute.Tensor, mCycles: cute.Tensor, n: Int32, eps: Float32, stream: cuda.CUstream
    ):
        self.kernel(mIn, mOut, mCycles, n, eps).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor, mCycles: cute.Tensor, n: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        rC = cute.make_rmem_tensor((HC * HC,), Float32)
        for k in cutlass.range_constexpr(HC * HC):
            rC[k] = mIn[tidx * HC * HC + k]
        rV = cute.make_rmem_tensor((2 * HC,), Float32)  # the vectors body's r and c
        for k in cutlass.range_constexpr(2 * HC):
            rV[k] = Float32(1.0)
        t0 = Int64(0)
        t1 = Int64(0)
        if tidx < self.lanes:
            t0 = prim.clock64()
            for _ in cutlass.range(n, unroll=1):
                self.step(rC, rV, eps)
            t1 = prim.clock64()
        for k in cutlass.range_constexpr(HC * HC):
            mOut[tidx * HC * HC + k] = rC[k] * rV[k // HC] * rV[HC + k % HC]
        mCycles[tidx] = t1 - t0

    @cute.jit
    def step(self, rC: cute.Tensor, rV: cute.Tensor, eps: Float32):
        """One iteration of the chosen body."""
        if const_expr(self.body == "step"):
            self.epilogue.sinkhorn_step(rC, eps)
        elif const_expr(self.body == "vectors"):
            K = [[rC[a * HC + b] for b in range(HC)] for a in range(HC)]
            r = [rV[a] for a in range(HC)]
            c = [rV[HC + b] for b in range(HC)]
            for a in cutlass.range_constexpr(HC):
                u = (K[a][0] * c[0] + K[a][1] * c[1]) + (K[a][2] * c[2] + K[a][3] * c[3])
                r[a] = r[a] * prim.rcp_approx(r[a] * u + eps)
            for b in cutlass.range_constexpr(HC):
                v = (K[0][b] * r[0] + K[1][b] * r[1]) + (K[2][b] * r[2] + K[3][b] * r[3])
                c[b] = c[b] * prim.rcp_approx(c[b] * v + eps)
            for k in cutlass.range_constexpr(HC):
                rV[k] = r[k]
                rV[HC + k] = c[k]
        elif const_expr(self.body == "rcp1"):
            c = [[rC[a * HC + b] for b in range(HC)] for a in range(HC)]
            inv = one_rcp([(c[a][0] + c[a][1]) + (c[a][2] + c[a][3]) + eps for a in range(HC)])
            c = [[c[a][b] * inv[a] for b in range(HC)] for a in range(HC)]
            inv = one_rcp([(c[0][b] + c[1][b]) + (c[2][b] + c[3][b]) + eps for b in range(HC)])
            for a in cutlass.range_constexpr(HC):
                for b in cutlass.range_constexpr(HC):
                    rC[a * HC + b] = c[a][b] * inv[b]
        elif const_expr(self.body == "unroll2"):
            self.epilogue.sinkhorn_step(rC, eps)
            self.epilogue.sinkhorn_step(rC, eps)
        elif const_expr(self.body == "fadd_chain8"):
            x = rC[0]
            for _ in cutlass.range_constexpr(8):
                x = x + eps
            rC[0] = x
        elif const_expr(self.body == "fmul_chain8"):
            x = rC[0]
            for _ in cutlass.range_constexpr(8):
                x = x * rC[1]
            rC[0] = x
        elif const_expr(self.body == "rcp_dep4"):
            x = rC[0]
            for _ in cutlass.range_constexpr(4):
                x = prim.rcp_approx(x)
            rC[0] = x
        elif const_expr(self.body == "rcp_indep8"):
            for k in cutlass.range_constexpr(8):
                rC[k] = prim.rcp_approx(rC[k])
        elif const_expr(self.body == "rcp_chain"):
            rC[0] = prim.rcp_approx(rC[0] + eps)
        elif const_expr(self.body == "rcp_chain4"):
            for k in cutlass.range_constexpr(4):
                rC[k] = prim.rcp_approx(rC[k] + eps)
        elif const_expr(self.body == "fadd_chain"):
            rC[0] = rC[0] + eps
        else:
            rC[0] = cute.arch.shuffle_sync_bfly(rC[0], offset=1) + eps


@cute.jit
def one_rcp(s: list) -> list:
    """1/s_a for 4 values from one reciprocal of their product."""
    p01 = s[0] * s[1]
    p23 = s[2] * s[3]
    r = prim.rcp_approx(p01 * p23)
    return [r * (s[1] * p23), r * (s[0] * p23), r * (s[3] * p01), r * (s[2] * p01)]


def compile_micro(body: str, lanes: int, arch: str) -> Callable[..., Any]:
    """The compiled micro kernel (no disk cache: this file is not in the kernel fingerprint)."""
    return compile_kernel(
        SinkhornMicro(body, lanes),
        fake_tensor(Float32, (32 * HC * HC,)),
        fake_tensor(Float32, (32 * HC * HC,)),
        fake_tensor(Int64, (32,)),
        Int32(1),
        Float32(1e-6),
        fake_stream(),
        arch=arch,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.sinkhorn_micro", description=__doc__.splitlines()[0])
    p.add_argument("--bodies", nargs="+", default=list(BODIES), choices=BODIES)
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 32], help="active lanes of the one-lane bodies")
    p.add_argument("--iterations", type=int, default=200)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    gen = torch.Generator().manual_seed(0)
    # A softmaxed-looking positive matrix per lane.
    x = torch.rand(32, HC, HC, generator=gen) + 0.1
    x = (x / x.sum(-1, keepdim=True)).flatten().to(device)
    out = torch.empty_like(x)
    cycles = torch.zeros(32, dtype=torch.int64, device=device)
    print(
        f"{torch.cuda.get_device_name(device)}: cycles per iteration (median over lanes), {args.iterations} iterations"
    )
    print(
        f"  {'body':<12} " + " ".join(f"{f'{n} active':>10}" for n in args.lanes) + "   (shuffling bodies: 32 always)"
    )
    for body in args.bodies:
        cells = []
        for lanes in args.lanes:
            lanes = 32 if body in WHOLE_WARP else lanes
            fn = compile_micro(body, lanes, arch)
            per = []
            for n in (1, 1 + args.iterations):
                runs = []
                for _ in range(5):
                    fn(x, out, cycles, n, 1e-6)
                    torch.cuda.synchronize()
                    runs.append(float(cycles[:lanes].double().median()))
                per.append(min(runs))
            it = (per[1] - per[0]) / args.iterations
            cells.append(f"{it:8.1f}")
        print(f"  {body:<12} " + " ".join(f"{c:>10}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
