"""Where a boundary call's host time goes: the public call taken apart, piece by piece, and profiled.

`python -m bench.experiments.host_profile [--hidden 7168] [--rows 4]` times (median µs per call, inputs made, as
`make bench`'s host part): one `torch.add` (the yardstick), the public `BoundaryAllReduce` call, the custom op, and
the pieces of the public call on their own: its full input checks and the one-pass test that stands for them on a
well-formed call, its two output allocations (and the same outputs as views of one), building the kernel's
argument record, the compiled-kernel lookup, the TVM-FFI launch of the compiled kernel with its arguments ready, the
kept launch the public call takes (the C entry: both outputs allocated and the launch in one call) and its Python
form, `fused_boundary` (lookup + launch); the route the public call took before its launches were kept (`_fits`,
then `_kernel`), and the Python floor (two allocations and the TVM-FFI launch). Then cProfile's top functions over
the public call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from bench.host import _op
from bench.kernels import boundary_inputs, fused_call
from bench.timing import host_us_interleaved
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
    ar(inp["x"], *epilogue, None)  # keeps this form's launch
    kept = ar._ready[(rows, False, True)]
    kept_args = (*epilogue[:5], inp["x"], None, None, 1e-6)
    # The same kept launch in Python (a stand-in that is not a TVM-FFI function takes ready_launch's Python form).
    python_kept = api.ready_launch(lambda *a: fn(*a), None, None, None, None, layer_input=True)
    # Timed in interleaved rounds (as the bench's host part), so that a slow phase of the host weighs on all alike.
    return host_us_interleaved(
        {
            "torch_add": lambda: torch.add(inp["x"], inp["x"], out=scratch),
            "public_call": lambda: ar(inp["x"], *epilogue, None),
            # The public call's route before its launches were kept per call form (v38): _fits, then _kernel.
            "kernel_path": lambda: (
                ar._fits(inp["residual"], inp["post"], inp["pre"], inp["norm_weight"], 1e-6, None)
                and ar._kernel(*epilogue, None, None, None, x=inp["x"])
            ),
            # What no Python call path can go below: the two outputs allocated as the ready path does, and the launch.
            "floor": lambda: (torch.empty_like(inp["residual"]), torch.empty_like(inp["x"]), fn(*args)),
            "custom_op": lambda: _op(ar, inp, inp["residual"]),
            "checks": checks,
            "fast_checks": lambda: ar._fits(inp["residual"], inp["post"], inp["pre"], inp["norm_weight"], 1e-6, None),
            "two_empty": lambda: (torch.empty_like(inp["residual"]), torch.empty_like(inp["x"])),
            "one_empty_two_views": lambda: one_buffer(rows, hidden),
            "args_record": lambda: api.BoundaryArgs(*args),
            "kernel_lookup": lambda: api.compiled_boundary(hidden, variant, arch=ar.arch),
            "tvm_ffi_launch": lambda: fn(*args),
            # The kept launch the public call takes (api.ready_launch: the C entry that allocates both outputs and
            # launches), and its Python form (two torch.empty_like, the TVM-FFI call).
            "kept_launch": lambda: kept(*kept_args),
            "python_kept_launch": lambda: python_kept(*kept_args),
            "fused_boundary": fused_call(inp, ar.arch, None),
        }
    )


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
