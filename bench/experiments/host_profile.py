"""Where a boundary call's host time goes: the public call taken apart, piece by piece, and profiled.

`python -m bench.experiments.host_profile [--hidden 7168] [--rows 4]` times (median µs per call, inputs made, as
`make bench`'s host part): one `torch.add` (the yardstick), the public `BoundaryAllReduce` call, the custom op, and
the pieces of the public call on their own: its full input checks and the one-pass test that stands for them on a
well-formed call, its two output allocations (and the same outputs as views of one), building the kernel's
argument record, the compiled-kernel lookup, the TVM-FFI launch of the compiled kernel with its arguments ready, and
`fused_boundary` (lookup + launch); the route the public call took before its launches were kept (`_fits`, then
`_kernel`), and the floor (two allocations and the launch). Then cProfile's top functions over the public call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from bench.host import _op
from bench.kernels import boundary_inputs, fused_call
from bench.timing import host_us_per_call
from boundary import BoundaryAllReduce
from cute_kernels.boundary import api


def one_buffer(rows: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two outputs (new streams [T, 4, H], layer input [T, H]) as views of one allocation: what #45's host cost
    would save against two allocations (`two_empty`)."""
    buf = torch.empty(5 * rows * hidden, dtype=torch.bfloat16, device="cuda")
    return buf[: 4 * rows * hidden].view(rows, 4, hidden), buf[4 * rows * hidden :].view(rows, hidden)


def pieces(ar: BoundaryAllReduce, inp: dict[str, torch.Tensor]) -> dict[str, float]:
    """µs per call of the public call and of each of its pieces."""
    rows, hidden = inp["x"].shape
    epilogue = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6)
    variant = api.BoundaryVariant("x", False, True, False, False)
    fn = api.compiled_boundary(hidden, variant, arch=ar.arch)
    args = api.BoundaryArgs(
        residual=inp["residual"],
        post=inp["post"],
        comb=inp["comb"],
        pre=inp["pre"],
        norm_weight=inp["norm_weight"],
        x=inp["x"],
        new_residual=inp["new_residual"],
        out=inp["out"],
        eps=1e-6,
    )

    def checks() -> None:
        residual = ar._check_residual(inp["residual"])
        ar._check_epilogue(residual.shape[0], *epilogue[1:], None, None, None)

    scratch = torch.empty_like(inp["x"])
    return {
        "torch_add": host_us_per_call(lambda: torch.add(inp["x"], inp["x"], out=scratch)),
        "public_call": host_us_per_call(lambda: ar(inp["x"], *epilogue, None)),
        # The public call's route before its launches were kept per call form (v38): _fits, then _kernel.
        "kernel_path": host_us_per_call(
            lambda: (
                ar._fits(inp["residual"], inp["post"], inp["pre"], inp["norm_weight"], 1e-6, None)
                and ar._kernel(*epilogue, None, None, None, x=inp["x"])
            )
        ),
        # What no Python call path can go below: the two outputs allocated as the ready path does, and the launch.
        "floor": host_us_per_call(lambda: (torch.empty_like(inp["residual"]), torch.empty_like(inp["x"]), fn(*args))),
        "custom_op": host_us_per_call(lambda: _op(ar, inp, inp["residual"])),
        "checks": host_us_per_call(checks),
        "fast_checks": host_us_per_call(
            lambda: ar._fits(inp["residual"], inp["post"], inp["pre"], inp["norm_weight"], 1e-6, None)
        ),
        "two_empty": host_us_per_call(
            lambda: (torch.empty_like(inp["residual"]), torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda"))
        ),
        "one_empty_two_views": host_us_per_call(lambda: one_buffer(rows, hidden)),
        "args_record": host_us_per_call(lambda: api.BoundaryArgs(*args)),
        "kernel_lookup": host_us_per_call(lambda: api.compiled_boundary(hidden, variant, arch=ar.arch)),
        "tvm_ffi_launch": host_us_per_call(lambda: fn(*args)),
        "fused_boundary": host_us_per_call(fused_call(inp, ar.arch, None)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.host_profile", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, default=4)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    for hidden in args.hidden:
        inp = boundary_inputs(args.rows, hidden, device, seed=0)
        ar = BoundaryAllReduce(hidden, max_rows=args.rows, device=device)
        ar.warmup(progress=False, quantize=())
        us = pieces(ar, inp)
        print(f"H {hidden}, {args.rows} rows, host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()))
        epilogue = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            ar(inp["x"], *epilogue, None)
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        print(text.getvalue())


if __name__ == "__main__":
    main()
