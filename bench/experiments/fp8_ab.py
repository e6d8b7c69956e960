"""The FP8 1x128 writer against its v21 form, in one run: `python -m bench.experiments.fp8_ab` (about 1 min).

v23 gave the writer three remedies for its few-row cost (docs/PERF.md decisions: `Fp8GroupWriter.*`): the group amax
by two full-warp `redux.sync` (v21: 4 dependent butterfly shuffles), 1/sf by rcp.approx and one Newton FMA (v21:
rcp.rn), and the last row's scale with its padding in one 16-byte store (v21: a 4-byte store each). This rebuilds the
v21 writer, checks that both write the same bytes (data, scales, padding; a NaN group and an all-zero one included),
then times bf16 only, the v21 writer and the shipped one as bench/timing.py times (a CUDA graph of 20 calls on
rotating inputs, L2 flushed, median of replays), in interleaved rounds.
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from bench.experiments.fp8_ablation import SETS, time_rounds
from bench.experiments.fp8_ablation import call as ablation_call
from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import FP8_GROUP_LANES, Fp8GroupWriter

FORMS = ("bf16", "fp8 v21", "fp8")


class V21Writer(Fp8GroupWriter):
    """The writer as v21 shipped it (fp32 scales)."""

    def __init__(self, H: int) -> None:
        super().__init__(H, ue8m0=False)

    @cute.jit
    def group_amax(self, words: list) -> Uint32:
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        for off in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        return amax

    @cute.jit
    def scale(self, amax: Uint32) -> tuple:
        sf, _ = super().scale(amax)
        return sf, ptx.rcp_rn(sf)

    @cute.jit
    def store_scale(self, scale_addr: Int64, sf_bits: Uint32, lane: Int32, row: Int32, rows: Int32, padded: Int32):
        if lane % FP8_GROUP_LANES == 0:
            ptx.st_global_b32(scale_addr, sf_bits)
            if row == rows - 1:
                for p in cutlass.range(rows, padded):
                    ptx.st_global_b32(scale_addr + Int64(p - row) * 4, Uint32(0))


def compiled(H: int, arch: str, form: str) -> object:
    """The kernel of `form` (FORMS)."""
    config = default_config(H, arch)
    v = api.BoundaryVariant(fp8=None if form == "bf16" else "fp8_1x128")
    if form != "fp8 v21":
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    kernel = FusedBoundaryKernel(H, config, fp8="fp8_1x128")
    kernel.epilogue.fp8 = V21Writer(H)
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`: bf16 only, or with FP8 1x128."""
    return ablation_call(fn, s, "bf16" if form == "bf16" else "fp8")


def same_bytes(fns: dict, H: int, rows: int, device: torch.device) -> bool:
    """Whether the v21 writer and the shipped one write the same FP8 bytes (data and every scale, padding too)."""
    s = boundary_inputs(rows, H, device, seed=7)
    s["x"][0, :128] = float("nan")  # a NaN group, and an all-zero one
    s["x"][-1, 128:256] = 0
    outputs = []
    for form in ("fp8 v21", "fp8"):
        s["fp8_data"].fill_(0x55)
        s["fp8_scale"].fill_(7.0)  # poison: the padding must be zeroed
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        outputs.append((s["fp8_data"].view(torch.uint8).clone(), s["fp8_scale"].view(torch.int32).clone()))
    return all(torch.equal(a, b) for a, b in zip(*outputs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 128, 512])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph; columns: {list(FORMS)}")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in FORMS}
        for rows in args.rows:
            if not same_bytes(fns, H, rows, device):
                raise SystemExit(f"H {H} rows {rows}: the shipped writer's bytes differ from v21's")
            time_rounds(timer, fns, list(FORMS), H, rows, args.rounds, call)


if __name__ == "__main__":
    main()
