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
from cutlass import Uint32, const_expr

from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import Fp8GroupWriter

SETS = 20
DROPS = ("shuffles", "rcp", "scale stores", "data stores")


class AblatedWriter(Fp8GroupWriter):
    """The shipped writer with the stage `drop` left out."""

    def __init__(self, H: int, drop: str) -> None:
        super().__init__(H, ue8m0=False)
        self.drop = drop

    @cute.jit
    def group_amax(self, words: list) -> Uint32:
        if const_expr(self.drop != "shuffles"):
            return super().group_amax(words)
        amax = Uint32(0)  # this lane's own 8 values only
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        return amax

    @cute.jit
    def scale(self, amax: Uint32) -> tuple:
        sf, inverse = super().scale(amax)
        if const_expr(self.drop == "rcp"):
            inverse = ptx.rcp_approx(sf)  # rcp.rn left to dead-code elimination
        return sf, inverse

    @cute.jit
    def store_data(self, q_addr, q_lo, q_hi):
        if const_expr(self.drop == "data stores"):
            ptx.st_global_b32(q_addr, q_lo ^ q_hi)  # 4 bytes where 8 went: keeps the data live
        else:
            super().store_data(q_addr, q_lo, q_hi)

    @cute.jit
    def store_scale(self, scale_addr, sf_bits, lane, row, rows, padded):
        if const_expr(self.drop != "scale stores"):
            super().store_scale(scale_addr, sf_bits, lane, row, rows, padded)


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
        fp8_data=s["fp8_data"] if fp8 else None,
        fp8_scale=s["fp8_scale"] if fp8 else None,
        eps=1e-20,
    )
    return lambda: fn(*args)


def time_rounds(timer: GraphTimer, fns: dict, forms: list, H: int, rows: int, rounds: int, call_of) -> None:
    """Print `rounds` interleaved rounds of µs per call of each form's kernel at H x rows (SETS input sets each)."""
    sets = [boundary_inputs(rows, H, timer.device, seed) for seed in range(SETS)]
    for r in range(rounds):
        us = [timer.per_call_us([call_of(fns[f], s, f) for s in sets]) for f in forms]
        print(f"H {H} rows {rows} round {r}: " + "  ".join(f"{f}={u:.3f}" for f, u in zip(forms, us)))


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
            time_rounds(timer, fns, forms, H, rows, args.rounds, call)


if __name__ == "__main__":
    main()
