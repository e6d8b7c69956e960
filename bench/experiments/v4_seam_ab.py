"""A/B of DeepSeek-V4's seam in its two forms (#47), GPU us per call (one CUDA graph of calls, L2 flushed before each
replay: bench.timing.GraphTimer, the bench's method):

- shipped: `V4Boundaries.sublayer`, the residual-only fused boundary, then the coefficients kernel's own-pre
  variant (the mixes of R' and the layer input collapsed with their pre);
- own boundary: the fused boundary that computes its own pre from R' (`BoundaryAllReduce(..., mix=)`): the layer
  input after one launch, post and comb not computed;
- own boundary + mixes: that, then the coefficients kernel's mixes of R' (the post and comb the next boundary needs)
  in the same stream: the seam's whole work in that form;
- final: `V4Boundaries.final` (the own boundary with hc_head's weights: one launch).

    python -m bench.experiments.v4_seam_ab [--hidden 4096 7168] [--rows 1 4 16 128] [--replays 7]

What it decides: whether a V4 sublayer should take the own boundary (its layer input one launch earlier, post and
comb free to move beside the next sublayer) at no cost in one stream.
"""

from __future__ import annotations

import torch

from bench.experiments import shape_parser, shapes
from bench.kernels import CALLS_PER_GRAPH
from bench.timing import GraphTimer
from bench.v4 import _final, _inputs, _ours
from boundary import BoundaryAllReduce, DecodeStep, V4Boundaries, mhc
from boundary.params import MHCParams
from boundary.toy import ToyConfig, ToyModel


def measure(timer: GraphTimer, hidden: int, rows: int) -> dict[str, float]:
    """us per call of each form at one shape."""
    device = timer.device
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
    layer = model.layers[0]
    ar = BoundaryAllReduce(hidden, max_rows=rows, device=device)
    b = V4Boundaries(ar)
    b.warmup(rows, quantize=(), progress=False)
    step = DecodeStep(rows=rows, side_stream=False)
    sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
    fn, scale, base = layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base
    params = MHCParams(
        fn, scale, base, layer.rms_norm_eps, layer.hc_eps, layer.hc_eps, layer.hc_post_alpha, layer.hc_sinkhorn_iters
    )
    mix = mhc.mix_weights(fn[:4], scale[:1], base[:4], layer.rms_norm_eps, layer.hc_eps)  # built once, out of the graph
    weight, eps = layer.attn_norm.weight, layer.attn_norm.variance_epsilon

    def own(inp: dict, mixes: bool):
        pre = torch.empty(rows, 4, device=device)

        def call() -> None:
            new, out = ar(
                inp["y"], inp["residual"], inp["post"], inp["comb"], None, weight, eps, None, mix=mix, pre_out=pre
            )
            inp["outputs"] = (new, out, mhc.mixes(new, params) if mixes else None)

        return call

    return {
        "shipped": timer.per_call_us([_ours(b, layer, s, step, False) for s in sets]),
        "own": timer.per_call_us([own(s, False) for s in sets]),
        "own+mixes": timer.per_call_us([own(s, True) for s in sets]),
        "final": timer.per_call_us([_final(b, model, s) for s in sets]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = shape_parser(__doc__, rows=[1, 4, 16, 128])
    args = ap.parse_args(argv)
    timer = GraphTimer(torch.device("cuda"), replays=args.replays)
    print(f"{'H':>5} {'rows':>4} | {'shipped':>8} {'own':>8} {'own+mixes':>10} {'final':>8}   (GPU us per call)")
    for hidden, rows in shapes(args):
        us = measure(timer, hidden, rows)
        cells = " ".join(f"{us[k]:{w}.2f}" for k, w in (("shipped", 8), ("own", 8), ("own+mixes", 10), ("final", 8)))
        print(f"{hidden:>5} {rows:>4} | {cells}", flush=True)


if __name__ == "__main__":
    main()
