"""Where the FP8 1x128 form's cost at few rows goes: `python -m bench.experiments.fp8_ablation` (about 1 min).

The one-rank fused boundary with the FP8 1x128 writer as shipped, and with one stage of it left out at a time (the
group's amax shuffles, the reciprocal, the scale stores, the data stores), beside bf16 only and MXFP8, at few rows;
each timed as bench/timing.py times (a CUDA graph of 20 calls on rotating inputs, L2 flushed, median of replays),
in two interleaved rounds. The ablated kernels write wrong bytes: they only place the time.
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int64, Uint32, const_expr

from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import FP8_GROUP_LANES, Fp8GroupWriter, amax_over_e4m3_max

SETS = 20
DROPS = ("shuffles", "rcp", "scale stores", "data stores")


class AblatedWriter(Fp8GroupWriter):
    """The shipped writer with the stage `drop` left out."""

    def __init__(self, H: int, drop: str) -> None:
        super().__init__(H, ue8m0=False)
        self.drop = drop

    @cute.jit
    def quantize_vector(self, words, mQ, mScale, row, rows, vcol, valid):
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        if const_expr(self.drop != "shuffles"):
            for off in cutlass.range_constexpr(4):
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        a = ptx.f32_from_bits(amax << 16)
        a = Float32(cutlass.select_(a < Float32(1e-4), Float32(1e-4), a))
        sf = amax_over_e4m3_max(a, amax >= Uint32(0x7F80))
        inverse = ptx.rcp_approx(sf) if const_expr(self.drop == "rcp") else ptx.rcp_rn(sf)
        q = []
        for i in cutlass.range_constexpr(8):
            x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
            q.append(ptx.mul_rn(x, inverse))
        q_lo = ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3])
        q_hi = ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * 8))
        padded = mScale.shape[1]
        scale_addr = mScale.iterator.toint() + (Int64(vcol // FP8_GROUP_LANES) * Int64(padded) + Int64(row)) * 4
        if const_expr(self.drop != "data stores"):
            ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
        else:  # keep the data live without storing it
            ptx.st_global_b32(scale_addr, q_lo ^ q_hi)
        if const_expr(self.drop != "scale stores"):
            if cute.arch.lane_idx() % FP8_GROUP_LANES == 0:
                ptx.st_global_b32(scale_addr, ptx.f32_bits(sf))
                if row == rows - 1:
                    for p in cutlass.range(rows, padded):
                        ptx.st_global_b32(scale_addr + Int64(p - row) * 4, Uint32(0))


def compiled(H: int, arch: str, form: str) -> object:
    """The kernel of `form`: "bf16", "mxfp8", "fp8" (shipped) or "fp8 -<stage>" (AblatedWriter)."""
    config = default_config(H, arch)
    if form in ("bf16", "mxfp8", "fp8"):
        v = api.BoundaryVariant(mxfp8=form == "mxfp8", fp8="fp8_1x128" if form == "fp8" else None)
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    v = api.BoundaryVariant(fp8="fp8_1x128")
    kernel = FusedBoundaryKernel(H, config, fp8="fp8_1x128")
    kernel.epilogue.fp8 = AblatedWriter(H, form.split(" -", 1)[1])
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    mx, fp8 = form == "mxfp8", form.startswith("fp8")
    args = (s["residual"], s["post"], s["comb"], s["pre"], s["norm_weight"], s["x"], None, None, None, None,
            s["new_residual"], s["out"], s["mxfp8_data"] if mx else None, s["mxfp8_scale"] if mx else None,
            s["fp8_data"] if fp8 else None, s["fp8_scale"] if fp8 else None, None, None, None, None, None, 1e-20)  # fmt: skip
    return lambda: fn(*args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    forms = ["bf16", "mxfp8", "fp8"] + [f"fp8 -{d}" for d in DROPS]
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph; columns: {forms}")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in forms}
        for rows in args.rows:
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            for r in range(args.rounds):
                us = [timer.per_call_us([call(fns[f], s, f) for s in sets]) for f in forms]
                print(f"H {H} rows {rows} round {r}: " + "  ".join(f"{f}={u:.3f}" for f, u in zip(forms, us)))


if __name__ == "__main__":
    main()
