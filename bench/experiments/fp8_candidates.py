"""Candidates for the FP8 1x128 writer's cost at few rows (#29: +0.21-0.25 us over bf16 only at <= 16 rows, the
target 0.15): `python -m bench.experiments.fp8_candidates` (about 2 min on the H200).

- "redux": the group's amax by two full-warp `redux.sync.max.u32` (one per half-warp's group, the other half's
  lanes giving 0) where the shipped writer runs 4 dependent butterfly shuffles (the ablation put 0.04-0.09 us on them);
- "pad v4": the last row's scale and its column's padding zeros in one 16-byte store where that row starts a
  4-row chunk (rows 1, 5, 9, ...: the 1-row call writes 1 store per group where it wrote 4);
- "rcp newton": 1/sf by rcp.approx and one Newton FMA step where the shipped writer runs rcp.rn (the ablation put
  0.02-0.06 us on it). rcp.approx is within 1 ulp (the PTX ISA), so the refined value is within 1.5 * 2^-46 of
  1/sf before its rounding: it rounds as rcp.rn does for every sf whose 1/sf lies farther than that from a rounding
  midpoint. `--prove-rcp` checks every sf the kernel can make (a bf16 amax >= 1e-4 or the floor, over 448), with
  exact rational arithmetic, on the CPU;
- the candidates together.

Each candidate's bytes (data, scales, padding) must equal the shipped writer's on the same inputs (checked first, at
every hidden size and row count); then each is timed beside bf16 only and the shipped FP8 form as bench/timing.py
times (a CUDA graph of 20 calls on rotating inputs, L2 flushed, median of replays), in two interleaved rounds.
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from bench.experiments.fp8_ablation import SETS
from bench.experiments.fp8_ablation import call as ablation_call
from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import FP8_GROUP_LANES, Fp8GroupWriter

CANDIDATES = ("redux", "pad v4", "rcp newton", "redux + pad v4 + rcp newton")


class CandidateWriter(Fp8GroupWriter):
    """The shipped writer with the changes `candidate` names."""

    def __init__(self, H: int, candidate: str) -> None:
        super().__init__(H, ue8m0=False)
        self.redux = "redux" in candidate
        self.pad_v4 = "pad v4" in candidate
        self.newton = "rcp newton" in candidate

    @cute.jit
    def group_amax(self, words: list) -> Uint32:
        if const_expr(not self.redux):
            return super().group_amax(words)
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        # A group is 16 aligned lanes: each half-warp's max from one full-warp reduction that the other half joins
        # with 0 (every magnitude pattern is >= 0, so 0 never wins over a real amax).
        low = cute.arch.lane_idx() < FP8_GROUP_LANES
        m_lo = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, amax, Uint32(0))), "umax")
        m_hi = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, Uint32(0), amax)), "umax")
        return Uint32(cutlass.select_(low, m_lo, m_hi))

    @cute.jit
    def scale(self, amax: Uint32) -> tuple:
        sf, inverse = super().scale(amax)
        if const_expr(self.newton):
            y0 = ptx.rcp_approx(sf)
            e = ptx.fma_rn(-sf, y0, Float32(1.0))
            # Inf: rcp.approx gives rcp.rn's 0, the step would give NaN; NaN stays NaN either way.
            inverse = Float32(cutlass.select_(amax >= Uint32(0x7F80), y0, ptx.fma_rn(y0, e, y0)))
        return sf, inverse

    @cute.jit
    def store_scale(self, scale_addr: Int64, sf_bits: Uint32, lane: Int32, row: Int32, rows: Int32, padded: Int32):
        if const_expr(not self.pad_v4):
            super().store_scale(scale_addr, sf_bits, lane, row, rows, padded)
        else:
            if lane % FP8_GROUP_LANES == 0:
                if row == rows - 1 and row % 4 == 0 and padded == row + 4:
                    # The chunk of 4 starts here (16-byte aligned: T_pad is a multiple of 4) and ends the column.
                    ptx.st_global_v4_b32(scale_addr, sf_bits, Uint32(0), Uint32(0), Uint32(0))
                else:
                    ptx.st_global_b32(scale_addr, sf_bits)
                    if row == rows - 1:
                        for p in cutlass.range(rows, padded):
                            ptx.st_global_b32(scale_addr + Int64(p - row) * 4, Uint32(0))


def compiled(H: int, arch: str, form: str) -> object:
    """The kernel of `form`: "bf16", "fp8" (shipped) or a CANDIDATES entry."""
    config = default_config(H, arch)
    if form in ("bf16", "fp8"):
        v = api.BoundaryVariant(fp8="fp8_1x128" if form == "fp8" else None)
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    v = api.BoundaryVariant(fp8="fp8_1x128")
    kernel = FusedBoundaryKernel(H, config, fp8="fp8_1x128")
    kernel.epilogue.fp8 = CandidateWriter(H, form)
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`: bf16 only, or (shipped or candidate) with FP8 1x128."""
    return ablation_call(fn, s, "bf16" if form == "bf16" else "fp8")


def same_bytes(fns: dict, H: int, rows: int, device: torch.device) -> list[str]:
    """The candidates whose FP8 bytes (data and every scale, padding included) differ from the shipped writer's."""
    s = boundary_inputs(rows, H, device, seed=7)
    s["x"][0, :128] = float("nan")  # a NaN group, and an all-zero one
    s["x"][-1, 128:256] = 0
    outputs = {}
    for form in ("fp8",) + CANDIDATES:
        s["fp8_data"].fill_(0x55)
        s["fp8_scale"].fill_(7.0)  # poison: the padding must be zeroed
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        outputs[form] = (s["fp8_data"].view(torch.uint8).clone(), s["fp8_scale"].view(torch.int32).clone())
    want = outputs["fp8"]
    return [f for f in CANDIDATES if not all(torch.equal(a, b) for a, b in zip(outputs[f], want))]


def prove_rcp() -> int:
    """Every sf the kernel makes whose 1/sf lies within 2^-44 (relative) of an fp32 rounding midpoint: there
    rcp.approx + one Newton step could round otherwise than rcp.rn. Prints the count; 0 means the candidate is exact."""
    from fractions import Fraction

    import numpy as np

    magnitudes = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    amaxes = np.concatenate([magnitudes[magnitudes >= np.float32(1e-4)], [np.float32(1e-4)]])
    close = []
    for a in amaxes:
        sf = np.divide(a, np.float32(448.0), dtype=np.float32)  # the kernel's sf (proven equal: test_fp8_group.py)
        exact = 1 / Fraction(float(sf))
        below = np.float32(float(exact))
        if Fraction(float(below)) > exact:
            below = np.nextafter(below, np.float32(0))
        midpoint = (Fraction(float(below)) + Fraction(float(np.nextafter(below, np.float32(np.inf))))) / 2
        if abs(exact - midpoint) <= exact / 2**44:
            close.append(float(sf))
    print(f"{len(amaxes)} scales; within 2^-44 of a rounding midpoint: {len(close)} {close[:5]}")
    return len(close)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prove-rcp", action="store_true", help="the CPU proof of the rcp newton candidate, then exit")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 128, 512])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.prove_rcp:
        raise SystemExit(1 if prove_rcp() else 0)
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    forms = ["bf16", "fp8", *CANDIDATES]
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph; columns: {forms}")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in forms}
        for rows in args.rows:
            wrong = same_bytes(fns, H, rows, device)
            print(f"H {H} rows {rows}: bytes as shipped: {'all' if not wrong else 'NOT ' + ', '.join(wrong)}")
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            for r in range(args.rounds):
                us = [timer.per_call_us([call(fns[f], s, f) for s in sets]) for f in forms]
                print(f"H {H} rows {rows} round {r}: " + "  ".join(f"{f}={u:.3f}" for f, u in zip(forms, us)))


if __name__ == "__main__":
    main()
