"""The FP8 1x128 writer's last-row store, v24's against the shipped one, in one run: `python -m bench.experiments.fp8_pad_ab`.

v24's writer stored the last row's scale and zeroed the padding rows after it with a 4-byte store each in a loop,
except where that row starts its chunk of 4 (one 16-byte store). The shipped writer stores the scale and the padding
with one store of 16 bytes, or 8, or 4 + 8, by the row's place in its chunk, with no loop (docs/PERF.md decisions:
`Fp8GroupWriter.store`). This checks that both write the same bytes (data, scales and the padding, over a poisoned
buffer, a NaN group and an all-zero one included), then times bf16 only, v24's writer and the shipped one as
bench/timing.py times (a CUDA graph of 20 calls on rotating inputs, L2 flushed, median of replays), in interleaved
rounds. The rows put the last row at each place of its chunk: 1 and 5 first, 2 and 6 second, 3 third, 16 last.
"""

from __future__ import annotations

import argparse
import statistics

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import FP8_GROUP_LANES, Fp8GroupWriter

FORMS = ("bf16", "fp8 v24", "fp8")
SETS = 20  # input sets per graph, as bench/timing.py


class V24Writer(Fp8GroupWriter):
    """The writer with v24's last-row store (fp32 scales)."""

    def __init__(self, H: int) -> None:
        super().__init__(H, ue8m0=False)

    @cute.jit
    def store_scale(self, scale_addr: Int64, sf_bits: Uint32, lane: Int32, row: Int32, rows: Int32):
        if lane % FP8_GROUP_LANES == 0:
            padded = (rows + 3) // 4 * 4
            if row == rows - 1 and row % 4 == 0:
                ptx.st_global_v4_b32(scale_addr, sf_bits, Uint32(0), Uint32(0), Uint32(0))
            else:
                ptx.st_global_b32(scale_addr, sf_bits)
                if row == rows - 1:
                    for p in cutlass.range(rows, padded):
                        ptx.st_global_b32(scale_addr + Int64(p - row) * 4, Uint32(0))


def compiled(H: int, arch: str, form: str) -> object:
    """The one-rank kernel of `form` (FORMS)."""
    config = default_config(H, arch)
    v = api.BoundaryVariant(fp8=None if form == "bf16" else "fp8_1x128")
    if form != "fp8 v24":
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    kernel = FusedBoundaryKernel(H, config, fp8="fp8_1x128")
    kernel.epilogue.fp8 = V24Writer(H)
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`: bf16 only, or with FP8 1x128."""
    fp8 = form != "bf16"
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
    """Whether v24's writer and the shipped one write the same FP8 bytes (data and every scale, padding too)."""
    s = boundary_inputs(rows, H, device, seed=7)
    s["x"][0, :128] = float("nan")  # a NaN group, and an all-zero one
    s["x"][-1, 128:256] = 0
    outputs = []
    for form in ("fp8 v24", "fp8"):
        s["fp8_data"].fill_(0x55)
        s["fp8_scale"].fill_(7.0)  # poison: the padding must be zeroed
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        outputs.append((s["fp8_data"].view(torch.uint8).clone(), s["fp8_scale"].view(torch.int32).clone()))
    return all(torch.equal(a, b) for a, b in zip(*outputs))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.fp8_pad_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 6, 16])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph, {args.rounds} interleaved rounds")
    print(f"{'H':>5} {'rows':>4} | {'bf16':>6} {'v24':>6} {'fp8':>6} | {'v24 adds':>8} {'fp8 adds':>8} | per round")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in FORMS}
        for rows in args.rows:
            if not same_bytes(fns, H, rows, device):
                raise SystemExit(f"H {H} rows {rows}: the shipped writer's bytes differ from v24's")
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            us = {f: [] for f in FORMS}
            for _ in range(args.rounds):
                for f in FORMS:
                    us[f].append(timer.per_call_us([call(fns[f], s, f) for s in sets]))
            med = {f: statistics.median(v) for f, v in us.items()}
            rounds = " ".join(f"{a - b:+.2f}/{c - b:+.2f}" for a, b, c in zip(us["fp8 v24"], us["bf16"], us["fp8"]))
            print(
                f"{H:>5} {rows:>4} | {med['bf16']:6.2f} {med['fp8 v24']:6.2f} {med['fp8']:6.2f} | "
                f"{med['fp8 v24'] - med['bf16']:+8.2f} {med['fp8'] - med['bf16']:+8.2f} | {rounds}"
            )


if __name__ == "__main__":
    main()
