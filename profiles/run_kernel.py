"""Launches one kernel a few times for a profiler: warm-up calls, then one call between profiler start and stop.

python profiles/run_kernel.py --kernel boundary --hidden 7168 --rows 16 [--mxfp8]
python profiles/run_kernel.py --kernel coefficients --hidden 7168 --rows 512 [--variant broadcast|inline]
    [--knobs rows_per_tile=64 push_vec=True]   (CoefficientsConfig fields over the default config)
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import boundary_inputs, coefficient_inputs, coefficients_call, fused_call  # noqa: E402
from cute_kernels.coefficients import CoefficientsConfig, coefficients_config  # noqa: E402
from cute_kernels.compile import arch_for_device  # noqa: E402


def knob(text: str) -> tuple[str, object]:
    """One `field=value` of --knobs: the value as a Python literal, else as a string."""
    field, sep, value = text.partition("=")
    if not sep or field not in CoefficientsConfig.__dataclass_fields__:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with a CoefficientsConfig field, got {text!r}")
    try:
        return field, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return field, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=("boundary", "coefficients"), required=True)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--mxfp8", action="store_true", help="boundary: also write the MXFP8 layer input")
    p.add_argument("--variant", choices=("standard", "broadcast", "inline"), default="standard")
    p.add_argument("--calls", type=int, default=3, help="warm-up calls before the profiled one")
    p.add_argument("--knobs", type=knob, nargs="*", default=[], help="coefficients: config fields, e.g. push_vec=True")
    args = p.parse_args()
    if args.knobs and args.kernel != "coefficients":
        p.error("--knobs applies to --kernel coefficients only")
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    if args.kernel == "boundary":
        call = fused_call(boundary_inputs(args.rows, args.hidden, device, 0), arch, "mxfp8" if args.mxfp8 else None)
    else:
        config = None
        if args.knobs:
            broadcast = args.variant == "broadcast"
            inline = args.variant == "inline"
            config = replace(
                coefficients_config(args.hidden, broadcast, args.rows, inline, arch=arch), **dict(args.knobs)
            )
        inp = coefficient_inputs(args.rows, args.hidden, device, 0)
        call = coefficients_call(inp, arch, args.variant, config)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one {args.kernel} call: H={args.hidden} rows={args.rows} knobs={dict(args.knobs)}")


if __name__ == "__main__":
    main()
