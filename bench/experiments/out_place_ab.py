"""The layer input's bf16 store with its address made before the RMS wait, against the shipped one, in one run:
`python -m bench.experiments.out_place_ab`.

The FP8 1x128 writer gained 0.03-0.07 us at <= 16 rows from making its addresses and store predicates while the RMS
sums cross the cluster (docs/PERF.md decisions: Fp8GroupWriter.place). The shipped epilogue still makes the bf16
`out` store's address after the values (a tensor view, its parameter loads on the row's tail). The candidate makes it
before the wait and stores with one predicated 16-byte store. Forms: bf16 only and with FP8 1x128, each shipped and
`early`. The bytes of `out` (and FP8) are checked equal first, then the forms are timed as bench/timing.py times (a
CUDA graph of 20 calls on rotating inputs, L2 flushed, median of replays), in interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import VEC, ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.epilogue import Epilogue, unpack
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device

FORMS = ("bf16", "bf16 early", "fp8", "fp8 early")
SETS = 20  # input sets per graph, as bench/timing.py


class EarlyOutEpilogue(Epilogue):
    """The shipped epilogue whose `out` addresses are made before the RMS wait."""

    @cute.jit
    def finish_row(self, ctx, row: Int32, rC: cute.Tensor, sumsq: Float32, stage: int, phase: Int32):
        vpt = const_expr(self.vpt)
        self.send_warp_sum(sumsq, ctx.sRed, ctx.mbar, ctx.cta, stage)
        places = []
        outs = []
        for v in cutlass.range_constexpr(vpt):
            outs.append(ctx.mOut.iterator.toint() + (Int64(row) * self.H + Int64(ctx.vcols[v] * VEC)) * 2)
            if const_expr(self.fp8 is not None):
                places.append(self.fp8.place(ctx.mQ8, ctx.mScale8, row, ctx.rows, ctx.vcols[v]))
        total = self.gather_sum(ctx.sRed, ctx.mbar, stage, phase)
        inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + ctx.eps)
        for v in cutlass.range_constexpr(vpt):
            rw = cute.recast_tensor(ctx.rW[v, None], Uint32)
            packed = [ptx.opaque_u32(rw[i]) for i in range(VEC // 2)]
            wf = [unpack(packed, e) for e in range(VEC)]
            words = [ptx.cvt_bf16x2(rC[v, e] * inv * wf[e], rC[v, e + 1] * inv * wf[e + 1]) for e in range(0, VEC, 2)]
            ptx.st_global_v4_pred(outs[v], words[0], words[1], words[2], words[3], ctx.valid[v])
            if const_expr(self.fp8 is not None):
                self.fp8.quantize_vector(words, places[v], ctx.valid[v])


def compiled(H: int, arch: str, form: str) -> object:
    """The one-rank kernel of `form` (FORMS)."""
    config = default_config(H, arch)
    fp8 = "fp8_1x128" if form.startswith("fp8") else None
    v = api.BoundaryVariant(fp8=fp8)
    if not form.endswith("early"):
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    kernel = FusedBoundaryKernel(H, config, fp8=fp8)
    kernel.epilogue = EarlyOutEpilogue(
        H, config.cluster_n, config.threads, kernel.vpt, pre=True, mxfp8=False, aux=False, fp8=fp8
    )
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`."""
    fp8 = form.startswith("fp8")
    args = api.launch_args(
        residual=s["residual"],
        post=s["post"],
        comb=s["comb"],
        pre=s["pre"],
        norm_weight=s["norm_weight"],
        x=s["x"],
        new_residual=s["new_residual"],
        out=s["out"],
        fp8_data=s["fp8_data"] if fp8 else None,
        fp8_scale=s["fp8_scale"] if fp8 else None,
        eps=1e-20,
    )
    return lambda: fn(*args)


def same_bytes(fns: dict, H: int, rows: int, device: torch.device) -> bool:
    """Whether each early form writes its shipped form's bytes (out, new streams, FP8 data and scales)."""
    s = boundary_inputs(rows, H, device, seed=7)
    got = {}
    for form in FORMS:
        for k in ("out", "new_residual", "fp8_data", "fp8_scale"):
            s[k].view(torch.uint8).fill_(0x55)
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        got[form] = [s[k].view(torch.uint8).clone() for k in ("out", "new_residual", "fp8_data", "fp8_scale")]
    return all(torch.equal(a, b) for a, b in zip(got["bf16"][:2], got["bf16 early"][:2])) and all(
        torch.equal(a, b) for a, b in zip(got["fp8"], got["fp8 early"])
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.out_place_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 128, 512])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph, {args.rounds} interleaved rounds")
    print(f"{'H':>5} {'rows':>4} | " + " ".join(f"{f:>10}" for f in FORMS) + " | fp8 adds (shipped / early)")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in FORMS}
        for rows in args.rows:
            if not same_bytes(fns, H, rows, device):
                raise SystemExit(f"H {H} rows {rows}: an early form's bytes differ from its shipped form's")
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            us = {f: [] for f in FORMS}
            for _ in range(args.rounds):
                for f in FORMS:
                    us[f].append(timer.per_call_us([call(fns[f], s, f) for s in sets]))
            med = {f: statistics.median(v) for f, v in us.items()}
            print(
                f"{H:>5} {rows:>4} | "
                + " ".join(f"{med[f]:10.3f}" for f in FORMS)
                + f" | {med['fp8'] - med['bf16']:+.3f} / {med['fp8 early'] - med['bf16 early']:+.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
