"""The MXFP8 writer with its addresses made before the RMS wait, against the shipped one, in one run:
`python -m bench.experiments.mxfp8_place_ab`.

The FP8 1x128 writer gained 0.04-0.08 us at <= 16 rows from making its addresses and store predicates while the RMS
sums cross the cluster (docs/PERF.md decisions: Fp8GroupWriter.place). The shipped MXFP8 writer still computes its
data and swizzled scale addresses after the values and stores the scale word under a branch. The candidate makes both
addresses and the first-lane predicate before the wait and stores the scale word predicated. Forms: bf16 only, MXFP8
shipped, MXFP8 early. Bytes (out, MXFP8 data and scales over a poisoned buffer, NaN / Inf / zero blocks) are checked
equal first, then the forms are timed as bench/timing.py times (a CUDA graph of 20 calls on rotating inputs, L2
flushed, median of replays), in interleaved rounds.
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
from cute_kernels import E4M3_MAX, MXFP8_BLOCK, VEC, ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.epilogue import Epilogue, unpack
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import E4M3_NAN_WORD, Mxfp8Writer

FORMS = ("bf16", "mxfp8", "mxfp8 early")
SETS = 20  # input sets per graph, as bench/timing.py


class EarlyMxfp8Writer(Mxfp8Writer):
    """The MXFP8 writer whose addresses and scale-store predicate are made ahead of the values."""

    @cute.jit
    def place(self, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, vcol: Int32) -> tuple:
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * 8))
        scale_addr = mScale.iterator.toint() + self.scale_offset(row, vcol * 8 // MXFP8_BLOCK)
        return q_addr, scale_addr, cutlass.Boolean(cute.arch.lane_idx() % 16 == 0)

    @cute.jit
    def quantize_placed(self, words: list, place: tuple, valid: cutlass.Boolean | None):
        """quantize_vector's arithmetic (the shipped lines), stored at `place`."""
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        for off in cutlass.range_constexpr(2):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        abits = amax << 16
        ea = Int32(abits >> 23)
        rounded_up = Int32(cutlass.select_((abits & Uint32(0x7FFFFF)) > Uint32(0x600000), Int32(1), Int32(0)))
        e = cutlass.max(ea - 8 + rounded_up, Int32(0))
        e = Int32(cutlass.select_(abits == Uint32(0x7F800000), Int32(254), e))
        e = Int32(cutlass.select_(abits > Uint32(0x7F800000), Int32(255), e))
        m1 = ptx.f32_from_bits(Uint32(cutlass.max(254 - e, Int32(1))) << 23)
        m1 = Float32(cutlass.select_(e == 0, Float32(1.0), m1))
        m1 = Float32(cutlass.select_(e == 254, Float32(2.0**-64), m1))
        m2 = Float32(cutlass.select_(e == 254, Float32(2.0**-63), Float32(1.0)))
        q = []
        for i in cutlass.range_constexpr(8):
            x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
            x = x * m1 * m2
            q.append(cute.arch.fmax(cute.arch.fmin(x, Float32(E4M3_MAX)), Float32(-E4M3_MAX)))
        q_lo = ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3])
        q_hi = ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])
        nan_block = e == 255
        q_lo = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_lo))
        q_hi = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_hi))
        lane = cute.arch.lane_idx()
        word = Uint32(e) << Uint32(8 * ((lane >> 2) & 3))
        word = word | cute.arch.shuffle_sync_bfly(word, offset=4)
        word = word | cute.arch.shuffle_sync_bfly(word, offset=8)
        q_addr, scale_addr, first = place
        if const_expr(valid is None):
            ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
            ptx.st_global_b32(scale_addr, word, first)
        else:
            if valid:
                ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
                ptx.st_global_b32(scale_addr, word, first)


class EarlyMxfp8Epilogue(Epilogue):
    """The shipped epilogue whose MXFP8 places are made before the RMS wait."""

    @cute.jit
    def finish_row(self, ctx, row: Int32, rC: cute.Tensor, sumsq: Float32, stage: int, phase: Int32):
        vpt = const_expr(self.vpt)
        self.send_warp_sum(sumsq, ctx.sRed, ctx.mbar, ctx.cta, stage)
        places = []
        for v in cutlass.range_constexpr(vpt):
            places.append(self.quant.place(ctx.mQ, ctx.mScale, row, ctx.vcols[v]))
        total = self.gather_sum(ctx.sRed, ctx.mbar, stage, phase)
        inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + ctx.eps)
        for v in cutlass.range_constexpr(vpt):
            rw = cute.recast_tensor(ctx.rW[v, None], Uint32)
            packed = [ptx.opaque_u32(rw[i]) for i in range(VEC // 2)]
            wf = [unpack(packed, e) for e in range(VEC)]
            words = [ptx.cvt_bf16x2(rC[v, e] * inv * wf[e], rC[v, e + 1] * inv * wf[e + 1]) for e in range(0, VEC, 2)]
            self.store_words(words, cute.local_tile(ctx.mOut[row, None], (VEC,), (ctx.vcols[v],)), ctx.valid[v])
            self.quant.quantize_placed(words, places[v], ctx.valid[v])


def compiled(H: int, arch: str, form: str) -> object:
    """The one-rank kernel of `form` (FORMS)."""
    config = default_config(H, arch)
    v = api.BoundaryVariant(mxfp8=form != "bf16")
    if form != "mxfp8 early":
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    kernel = FusedBoundaryKernel(H, config, mxfp8=True)
    kernel.epilogue = EarlyMxfp8Epilogue(
        H, config.cluster_n, config.threads, kernel.vpt, pre=True, mxfp8=True, aux=False, fp8=None
    )
    kernel.epilogue.quant = EarlyMxfp8Writer(H, H // config.cluster_n, config.threads)
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`."""
    mx = form != "bf16"
    args = api.launch_args(
        residual=s["residual"],
        post=s["post"],
        comb=s["comb"],
        pre=s["pre"],
        norm_weight=s["norm_weight"],
        x=s["x"],
        new_residual=s["new_residual"],
        out=s["out"],
        mxfp8_data=s["mxfp8_data"] if mx else None,
        mxfp8_scale=s["mxfp8_scale"] if mx else None,
        eps=1e-20,
    )
    return lambda: fn(*args)


def same_bytes(fns: dict, H: int, rows: int, device: torch.device) -> bool:
    """Whether the early writer writes the shipped one's bytes (out, MXFP8 data and every scale byte)."""
    s = boundary_inputs(rows, H, device, seed=7)
    s["x"][0, :32] = float("nan")  # a NaN block, an Inf one, an all-zero one
    s["x"][rows // 2, 64] = float("inf")
    s["x"][-1, 128:160] = 0
    s["residual"][-1, :, 128:160] = 0
    got = []
    for form in ("mxfp8", "mxfp8 early"):
        for k in ("out", "mxfp8_data", "mxfp8_scale"):
            s[k].view(torch.uint8).fill_(0x55)
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        got.append([s[k].view(torch.uint8).clone() for k in ("out", "mxfp8_data", "mxfp8_scale")])
    return all(torch.equal(a, b) for a, b in zip(*got))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.mxfp8_place_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 128, 512])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph, {args.rounds} interleaved rounds")
    print(f"{'H':>5} {'rows':>4} | " + " ".join(f"{f:>11}" for f in FORMS) + " | MXFP8 adds (shipped / early)")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in FORMS}
        for rows in args.rows:
            if not same_bytes(fns, H, rows, device):
                raise SystemExit(f"H {H} rows {rows}: the early writer's bytes differ from the shipped one's")
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            us = {f: [] for f in FORMS}
            for _ in range(args.rounds):
                for f in FORMS:
                    us[f].append(timer.per_call_us([call(fns[f], s, f) for s in sets]))
            med = {f: statistics.median(v) for f, v in us.items()}
            print(
                f"{H:>5} {rows:>4} | "
                + " ".join(f"{med[f]:11.3f}" for f in FORMS)
                + f" | {med['mxfp8'] - med['bf16']:+.3f} / {med['mxfp8 early'] - med['bf16']:+.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
