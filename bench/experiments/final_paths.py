"""A/B of DeepSeek-V4's `final` in its two paths (#47), GPU us per call (one CUDA graph of calls, L2 flushed before
each replay: bench.timing.GraphTimer, the bench's method):

- one launch: the fused boundary that computes hc_head's weights from its new streams, then collapses and normalises
  (at one rank its fn values in registers: `default_config(..., own_pre=True)`);
- two launches: the residual-only boundary, then one coefficients call (hc_head's weights, collapse, norm).

    python -m bench.experiments.final_paths [--hidden 4096 7168] [--rows 64 128 256 512] [--replays 7]

What it decides: `OWN_PRE_FINAL_MAX_ELEMENTS`, the rows x H up to which `V4Boundaries.final` takes one launch.
"""

from __future__ import annotations

from unittest import mock

import torch

from bench.experiments import shape_parser, shapes
from bench.kernels import CALLS_PER_GRAPH
from bench.timing import GraphTimer
from bench.v4 import _final, _inputs
from boundary import BoundaryAllReduce, V4Boundaries
from boundary import v4 as v4_module
from boundary.toy import ToyConfig, ToyModel
from cute_kernels.boundary.config import own_pre_final


def measure(timer: GraphTimer, hidden: int, rows: int) -> dict[str, float]:
    """us per `final` call on each path at one shape."""
    device = timer.device
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
    b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
    b.warmup(rows, quantize=(), progress=False)
    sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
    us = {}
    for name, one in (("one", True), ("two", False)):
        with mock.patch.object(v4_module, "own_pre_final", lambda r, h, one=one: one):
            us[name] = timer.per_call_us([_final(b, model, s) for s in sets])
    return us


def main(argv: list[str] | None = None) -> None:
    ap = shape_parser(__doc__, rows=[64, 128, 256, 512])
    args = ap.parse_args(argv)
    timer = GraphTimer(torch.device("cuda"), replays=args.replays)
    print(f"{'H':>5} {'rows':>4} | {'one':>7} {'two':>7} | shipped   (GPU us per final call)")
    for hidden, rows in shapes(args):
        us = measure(timer, hidden, rows)
        shipped = "one" if own_pre_final(rows, hidden) else "two"
        print(f"{hidden:>5} {rows:>4} | {us['one']:7.2f} {us['two']:7.2f} | {shipped}", flush=True)


if __name__ == "__main__":
    main()
