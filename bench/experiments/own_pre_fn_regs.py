"""A/B (#47): the own-pre boundary with its fn values in registers, loaded before the PDL wait, against fn from L2.

The boundary that computes its own pre (DeepSeek-V4's `final`, one launch up to 512 x 4096 elements of a stream;
CONTRACT §4d) needs its CTA's columns of fn (4 rows x 4 streams x its chunk, fp32: 64 KB a CTA at H 4096 and 7168).
Before (main, 2026-12-04): prefetched into L2 before the wait and loaded from L2 per row after it. Now
(`BoundaryConfig.fn_in_registers`, which `default_config(..., own_pre=True)` sets at one rank): each thread loads its
128 values into registers before the wait and keeps them across its rows, at two CTAs per SM (255 registers). The
same operations in the same order: the bits must be equal.

    python -m bench.experiments.own_pre_fn_regs [--hidden 4096 7168] [--rows 1 4 16 64 128] [--replays 7]

What it decides: whether the own pre's weights belong in registers (the #47 targets: `final` <= 3 us at <= 16 rows,
today 3.77-4.74; the own boundary 3.76-4.81), and whether `final` then takes one launch at more rows.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bench.experiments import shape_parser, shapes
from cute_kernels.boundary.api import compile_boundary_kernel
from cute_kernels.boundary.args import BoundaryArgs, BoundaryVariant
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel

VARIANT = BoundaryVariant(pre=True, own_pre=True)  # a ready partial, bf16 layer input, the pre computed here


@functools.cache
def compiled(H: int, fn_in_registers: bool, arch: str = "sm_90a") -> Any:
    """The own-pre boundary at one rank with fn in registers (the shipped default_config(own_pre=True): two CTAs per
    SM) or prefetched into L2 and loaded per row (the V4.1 kernels' config, as shipped before)."""
    config = default_config(H, arch, own_pre=fn_in_registers)
    assert config.fn_in_registers == fn_in_registers
    kernel = FusedBoundaryKernel(H, config, pre=True, own_pre=True)
    return compile_boundary_kernel(kernel, H, VARIANT, 1, arch=arch)


def measure(timer: Any, hidden: int, rows: int) -> dict[str, Any]:
    """Bit equality of the two forms on every input set, then GPU us per call of each (the bench's graph method)."""
    from bench.kernels import CALLS_PER_GRAPH
    from bench.v4 import _inputs
    from boundary import mhc
    from boundary.toy import ToyConfig, ToyModel

    device = timer.device
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
    layer = model.layers[0]
    mix = mhc.mix_weights(
        layer.hc_attn_fn[:4], layer.hc_attn_scale[:1], layer.hc_attn_base[:4], layer.rms_norm_eps, layer.hc_eps
    )
    weight, eps = layer.attn_norm.weight, float(layer.attn_norm.variance_epsilon)
    sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]

    def call(inp: dict[str, Any], fn_in_registers: bool):
        outs = dict(
            residual=torch.empty_like(inp["residual"]),
            pre=torch.empty(rows, 4, dtype=torch.float32, device=device),
            out=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
        )
        inp[fn_in_registers] = outs
        args = BoundaryArgs(
            inp["residual"],
            inp["post"],
            inp["comb"],
            pre=outs["pre"],
            norm_weight=weight,
            x=inp["y"],
            new_residual=outs["residual"],
            out=outs["out"],
            mix_fn=mix.fn,
            mix_params=mix.params,
            eps=eps,
        )
        fn = compiled(hidden, fn_in_registers)
        return lambda: fn(*args)

    shipped = [call(s, False) for s in sets]
    regs = [call(s, True) for s in sets]
    for a, b in zip(shipped, regs):
        a()
        b()
    torch.cuda.synchronize()
    differ = {}
    for inp in sets:
        for name, ref in inp[False].items():
            got = inp[True][name]
            differ[name] = differ.get(name, 0) + int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
    return {"shipped": timer.per_call_us(shipped), "fn in registers": timer.per_call_us(regs), "differ": differ}


def main(argv: list[str] | None = None) -> None:
    ap = shape_parser(__doc__, rows=[1, 4, 16, 64, 128])
    ap.add_argument("--compile-only", action="store_true", help="compile both forms for sm_90a and stop (no GPU)")
    args = ap.parse_args(argv)
    if args.compile_only:
        for hidden in args.hidden:
            for regs in (False, True):
                compiled(hidden, regs)
                print(f"compiled H={hidden} fn_in_registers={regs}", flush=True)
        return
    from bench.timing import GraphTimer

    timer = GraphTimer(torch.device("cuda"), replays=args.replays)
    print(f"{'H':>5} {'rows':>4} | {'shipped':>8} {'fn in regs':>10} | bytes that differ per output")
    for hidden, rows in shapes(args):
        r = measure(timer, hidden, rows)
        differ = " ".join(f"{name} {n}" for name, n in r["differ"].items())
        print(f"{hidden:>5} {rows:>4} | {r['shipped']:8.2f} {r['fn in registers']:10.2f} | {differ}", flush=True)


if __name__ == "__main__":
    main()
