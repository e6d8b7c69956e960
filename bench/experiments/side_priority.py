"""Why the side streams lose in the V3 weight-read step (#46): the critical path per boundary (bench.critical_path)
with the layers' side stream at the default and at the highest priority, the join on the boundary and early, against
inline and output copies, all in one run.

`python -m bench.experiments.side_priority --rows 1 4 16 64 128 --replays 15`
"""

from __future__ import annotations

import argparse

import torch

from bench import critical_path, weight_reads
from bench.step import _step_call, boundaries_only, boundaries_per_step
from bench.timing import GraphTimer
from boundary import Boundaries, BoundaryAllReduce, DecodeStep
from boundary.toy import ToyConfig, ToyModel


def _set_side_stream(model: ToyModel, stream: torch.cuda.Stream) -> None:
    for layer in model.layers:
        layer.mhc_stream = stream


def main(argv: list[str] | None = None) -> None:
    """Print one line per row count."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    timer = GraphTimer(device, replays=args.replays)
    hidden = weight_reads.HIDDEN
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=args.layers), device=device)
    ours = BoundaryAllReduce(hidden, max_rows=max(args.rows), device=device)
    ours.warmup(progress=False, quantize=("mxfp8",))
    b = Boundaries(ours)
    reads = weight_reads.WeightReads(device, max(args.rows))
    low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    streams = {"default": torch.cuda.Stream(device), "high": torch.cuda.Stream(device, priority=high)}
    print(
        f"stream priorities: default {streams['default'].priority}, high {streams['high'].priority} (range {low}..{high})"
    )
    n = boundaries_per_step(model.config)
    print(
        f"{'rows':>4} | {'side':>6} {'side hi':>7} {'early':>6} {'early hi':>8} {'inline':>6} | us per boundary over copies"
    )
    for rows in args.rows:
        free = boundaries_only(model, rows)
        t: dict[str, float] = {}
        for name, stream in streams.items():
            _set_side_stream(free, stream)
            suffix = "" if name == "default" else " hi"
            t["side" + suffix] = timer.per_call_us([_step_call(reads.model(free, rows), b, rows, True)])
            early = critical_path.EarlyJoin(b, DecodeStep(rows=rows, side_stream=True))
            v3_early = reads.model(free, rows, before_last=early.before_last)
            t["early" + suffix] = timer.per_call_us([_step_call(v3_early, early, rows, True)])  # type: ignore[arg-type]
        t["inline"] = timer.per_call_us([_step_call(reads.model(free, rows), b, rows, False)])
        copies = critical_path.OutputCopies(rows, hidden, device)
        base = timer.per_call_us([_step_call(reads.model(free, rows), copies, rows, False)])  # type: ignore[arg-type]
        per = {k: (v - base) / n for k, v in t.items()}
        print(
            f"{rows:>4} | {per['side']:6.2f} {per['side hi']:7.2f} {per['early']:6.2f} {per['early hi']:8.2f} "
            f"{per['inline']:6.2f} | copies step {base:.1f} us"
        )


if __name__ == "__main__":
    main()
