"""Where MXFP8's cost in DeepSeek-V4's boundary goes (#47): `V4Boundaries.sublayer` with quantize="mxfp8", GPU us per
call in a CUDA graph (L2 flushed), with one piece of the MXFP8 writer (`cute_kernels.quant.Mxfp8Writer`) taken out at
a time, beside bf16 and FP8 1x128 in the same process. Each ablation writes wrong bytes: timing only.

    python -m bench.experiments.mxfp8_ablation [--hidden 4096 7168] [--rows 1 16] [--ablation shipped no_padding ...]

Ablations (each in its own process, compiled cold into its own cache folder, since the patch is not in the sources
the kernel cache keys on):
  shipped        the shipped writer
  no_padding     the scale padding rows left unwritten (zero_padding does nothing)
  no_scale       the scale word neither gathered nor stored (data stores only)
  no_amax_shfl   each lane's scale from its own 8 values (no amax shuffles)
  no_quant       nothing quantised or stored (the MXFP8 form's cost beyond bf16 is then the variant's other work)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint32

from bench.experiments import shape_parser
from bench.timing import GraphTimer
from bench.v4 import CALLS_PER_GRAPH, _inputs, _ours
from boundary import BoundaryAllReduce, DecodeStep, V4Boundaries
from boundary.toy import ToyConfig, ToyModel
from cute_kernels import ptx
from cute_kernels.quant import Mxfp8Writer

ABLATIONS = ("shipped", "no_padding", "no_scale", "no_amax_shfl", "no_quant")
FORMS = (("bf16", False), ("mxfp8", "mxfp8"), ("fp8_1x128", "fp8_1x128"))


@cute.jit
def _no_padding(self, mScale, rows, cta, tidx, cluster, clusters):
    pass


@cute.jit
def _data_only_store(self, place, q_lo, q_hi, word):
    ptx.st_global_v2_b32(place[0], q_lo, q_hi)


@cute.jit
def _no_quant(self, words, place, valid):
    pass


@cute.jit
def _local_amax(self, words) -> Uint32:
    # Mxfp8Writer.block_amax without its two shuffles: this lane's 8 values only.
    amax = Uint32(0)
    for i in cutlass.range_constexpr(4):
        amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
    return amax


def _patch(ablation: str) -> None:
    """Take the ablation's piece out of Mxfp8Writer (before anything compiles)."""
    if ablation == "no_padding":
        Mxfp8Writer.zero_padding = _no_padding
    elif ablation == "no_scale":
        Mxfp8Writer.store = _data_only_store
    elif ablation == "no_amax_shfl":
        Mxfp8Writer.block_amax = _local_amax
    elif ablation == "no_quant":
        Mxfp8Writer.quantize_vector = _no_quant
    elif ablation != "shipped":
        raise ValueError(f"unknown ablation {ablation!r}; one of {ABLATIONS}")


def measure(ablation: str, hiddens: list[int], rows_list: list[int], replays: int) -> list[dict[str, Any]]:
    """us per call of MXFP8 (with the ablation) at each shape, and of bf16 and FP8 1x128 beside the shipped one."""
    _patch(ablation)
    device = torch.device("cuda")
    timer = GraphTimer(device, replays=replays)
    out = []
    for hidden in hiddens:
        for rows in rows_list:
            model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
            b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
            step = DecodeStep(rows=rows, side_stream=False)
            sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
            row = {"ablation": ablation, "H": hidden, "rows": rows}
            forms = FORMS if ablation == "shipped" else FORMS[1:2]  # the other forms do not change
            for form, quantize in forms:
                row[form] = timer.per_call_us([_ours(b, model.layers[0], s, step, quantize) for s in sets])
            out.append(row)
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = shape_parser(__doc__, rows=[1, 16])
    ap.add_argument("--ablation", nargs="+", default=list(ABLATIONS), choices=ABLATIONS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # a child: one ablation, its rows as JSON lines
        for row in measure(args.ablation[0], args.hidden, args.rows, args.replays):
            print("ROW " + json.dumps(row), flush=True)
        return
    print(
        f"{'ablation':>13} {'H':>5} {'rows':>4} | {'MXFP8':>6} {'+MX':>6} | bf16, FP8 1x128 (shipped)  (GPU us per call)"
    )
    shape = ["--hidden", *map(str, args.hidden), "--rows", *map(str, args.rows), "--replays", str(args.replays)]
    bf16: dict[tuple[int, int], float] = {}
    for ablation in args.ablation:
        env = dict(os.environ, MHC_BOUNDARY_CACHE_DIR=tempfile.mkdtemp(prefix=f"mx_{ablation}_"))
        cmd = [sys.executable, "-m", "bench.experiments.mxfp8_ablation", "--one", "--ablation", ablation, *shape]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            print(f"{ablation}: rc {done.returncode}\n{done.stderr[-2000:]}", flush=True)
        for line in done.stdout.splitlines():
            if not line.startswith("ROW "):
                continue
            r = json.loads(line[4:])
            key = (r["H"], r["rows"])
            bf16.setdefault(key, r.get("bf16", float("nan")))
            extra = f"{r['bf16']:.2f}, {r['fp8_1x128']:.2f}" if "bf16" in r else ""
            print(
                f"{ablation:>13} {r['H']:>5} {r['rows']:>4} | {r['mxfp8']:6.2f} {r['mxfp8'] - bf16[key]:+6.2f} | {extra}",
                flush=True,
            )


if __name__ == "__main__":
    main()
