"""DeepSeek-V4's boundary on SIMULATED ranks (#47): W `V4Boundaries` ranks on one GPU (`BoundaryAllReduce.simulated`:
the residual-only boundary with the all-reduce inside on the peer path, then the own-pre coefficients call), GPU us
per call in a CUDA graph (each rank's calls back to back on its own stream, L2 flushed before each replay), beside W
one-rank V4 boundaries on W streams (what W ranks cost this GPU before any byte is exchanged) and one on one stream.
SIMULATED: the ranks share one GPU's SMs and HBM; never NVLink numbers.

    python -m bench.experiments.v4_simulated [--world 2 4] [--hidden 7168] [--rows 1 16] [--calls 8]
"""

from __future__ import annotations

from typing import Any

import torch

from bench.experiments import shape_parser, shapes
from bench.timing import GraphTimer, on_streams
from bench.v4 import _inputs
from boundary import BoundaryAllReduce, BoundaryState, DecodeStep, V4Boundaries
from boundary.toy import ToyConfig, ToyModel


def rank_inputs(world: int, rows: int, hidden: int, calls: int, device: torch.device) -> list[list[dict[str, Any]]]:
    """`calls` input sets, each with one partial per rank and the streams and carried mixes every rank shares."""
    sets = []
    for seed in range(calls):
        shared = _inputs(rows, hidden, device, seed)
        g = torch.Generator(device=device).manual_seed(1000 + seed)
        ys = [torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16) for _ in range(world)]
        sets.append([dict(shared, y=y) for y in ys])
    return sets


def sublayer(b: V4Boundaries, layer: Any, s: dict[str, Any], step: DecodeStep) -> None:
    """One V4 boundary on a pending partial (its outputs kept until the set's next call)."""
    s["outputs"] = None
    state = BoundaryState(s["residual"], s["post"], s["comb"], None, pending=s["y"])  # type: ignore[arg-type]
    s["outputs"] = b.sublayer(layer, False, state, step)


def measure(timer: GraphTimer, world: int, hidden: int, rows: int, calls: int) -> dict[str, float]:
    """us per call: W simulated ranks, W one-rank boundaries on W streams, one on one stream."""
    device = timer.device
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=rows, device=device)
    V4Boundaries(ranks[0]).warmup(rows, quantize=(), progress=False)
    boundaries = [V4Boundaries(ar) for ar in ranks]
    layers = [
        ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), rank=r, world_size=world, device=device).layers[
            0
        ]
        for r in range(world)
    ]
    # One one-rank boundary object a stream: each has its own coefficients workspace.
    singles = [V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device)) for _ in range(world)]
    for single in singles:
        single.warmup(rows, quantize=(), progress=False)
    step = DecodeStep(rows=rows, side_stream=False)
    sets = rank_inputs(world, rows, hidden, calls, device)
    streams = [torch.cuda.Stream(device) for _ in range(world)]

    def simulated() -> None:
        def rank(ar: BoundaryAllReduce) -> None:
            for s in sets:
                sublayer(boundaries[ar.rank], layers[ar.rank], s[ar.rank], step)

        BoundaryAllReduce.run_simulated(ranks, [rank] * world)

    def one_rank(n: int) -> None:
        work = [lambda i=i: [sublayer(singles[i], layers[0], s[i], step) for s in sets] for i in range(n)]
        on_streams(streams[:n], work)

    us = {
        "simulated": timer.per_call_us([simulated], calls_each=calls),
        "w_one_rank": timer.per_call_us([lambda: one_rank(world)], calls_each=calls),
        "one_rank": timer.per_call_us([lambda: one_rank(1)], calls_each=calls),
    }
    for ar in ranks:
        ar.check()  # no rank gave up waiting
    return us


def main(argv: list[str] | None = None) -> None:
    ap = shape_parser(__doc__, rows=[1, 16], hidden=[7168])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--calls", type=int, default=8, help="boundary calls per rank in one graph")
    args = ap.parse_args(argv)
    timer = GraphTimer(torch.device("cuda"), replays=args.replays)
    print(f"{'W':>2} {'H':>5} {'rows':>4} | {'SIMULATED':>9} {'W one-rank':>10} {'one rank':>8}   (GPU us per call)")
    for world in args.world:
        for hidden, rows in shapes(args):
            us = measure(timer, world, hidden, rows, args.calls)
            print(
                f"{world:>2} {hidden:>5} {rows:>4} | {us['simulated']:9.2f} {us['w_one_rank']:10.2f} "
                f"{us['one_rank']:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
