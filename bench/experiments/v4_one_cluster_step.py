"""The one-launch V4 boundary (bench/experiments/v4_one_cluster.py) on a step's critical path (#47), an experiment.

The toy DeepSeek-V4 step (boundary.toy.decode_step_v4) on the V3 weight-read model (bench.weight_reads: each sublayer
first reads a V3 layer's weight bytes, times H / 7168 below H 7168, so the GPU is full and every layer's fn comes from
HBM), every sublayer's partial ready (the MoE's finalized once beforehand, so that every arm takes the same input),
timed three ways, one CUDA graph each, L2 flushed:

  shipped:     V4Boundaries;
  one launch:  the same, but each `sublayer` call is one launch of the experiment's exact variant (W = 1, its MXFP8
               form where the step asks for it); first, pre, post_only and final stay the shipped ones;
  copies:      boundaries that only write their outputs (bench.critical_path.OutputCopiesV4).

Prints us per step, per boundary over the copies step, and what the one launch saves per sublayer call; and how many
words of every sublayer call's outputs (R', post, comb, pre, layer input, MXFP8) differ between the two steps, run
once eagerly (the exact variant's claim: none).

    python -m bench.experiments.v4_one_cluster_step [--hidden 4096 7168] [--rows 1 4 16] [--layers 4] [--prefetch]
        [--max-clusters 4] [--replays 7]
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch
from torch import Tensor

from bench.experiments.v4_one_cluster import CLUSTERS, compile_one_cluster
from boundary import BoundaryState, DecodeStep, V4Boundaries
from boundary.types import QuantizedActivation, empty_layer_input_form


class Recorded:
    """V4Boundaries (or OneLaunchV4) whose `sublayer` outputs are kept, every call's: (R', post, comb, pre, layer
    input, then the quantized form's data and scales), for a word-for-word comparison of two steps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.outputs: list[tuple[Tensor, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sublayer(self, layer: Any, ffn: bool, state: BoundaryState, step: DecodeStep, **kwargs: Any) -> Any:
        new, li, quantized = self.inner.sublayer(layer, ffn, state, step, **kwargs)
        kept = (new.residual, new.post, new.comb, new.pre, li)
        self.outputs.append(kept + (() if quantized is None else (quantized.data, quantized.scale)))
        return new, li, quantized


class OneLaunchV4:
    """V4Boundaries whose `sublayer` is one launch of the experiment's exact kernel (a ready partial, W = 1, bf16 or
    MXFP8); every other call is V4Boundaries'. `calls` counts the sublayer calls."""

    def __init__(self, inner: V4Boundaries, compiled: dict[str | None, Any]) -> None:
        self.inner = inner
        self.compiled = compiled  # None: bf16 only; "mxfp8": with the MXFP8 form
        self.calls = 0
        self._params: dict[int, tuple[Tensor, Tensor]] = {}  # id(fn) -> (fn, scale and base in one tensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _param(self, fn: Tensor, scale: Tensor, base: Tensor) -> Tensor:
        """The kernel's [27] mix parameters (scale, base) of a layer's site, made once (a step graph makes none)."""
        hit = self._params.get(id(fn))
        if hit is None or hit[0] is not fn:
            hit = (fn, torch.cat([scale.float(), base.float()]).contiguous())
            self._params[id(fn)] = hit
        return hit[1]

    def sublayer(
        self, layer: Any, ffn: bool, state: BoundaryState, step: DecodeStep, *, quantize: bool | str | None = False
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | None]:
        """The V4 boundary in one launch on state.pending (a ready partial, consumed)."""
        y = state.pending
        if not isinstance(y, Tensor):
            raise TypeError(f"the one-launch sublayer takes a ready partial, got {type(y).__name__}")
        if quantize not in (False, None, "mxfp8"):
            raise ValueError(f"the one-launch sublayer writes bf16 or MXFP8, not {quantize!r}")
        site = "ffn" if ffn else "attn"
        fn, scale, base = (getattr(layer, f"hc_{site}_{name}") for name in ("fn", "scale", "base"))
        norm = getattr(layer, f"{site}_norm")
        residual = state.residual
        rows, hc, hidden = residual.shape
        new, li = torch.empty_like(residual), torch.empty_like(y)
        post = torch.empty(rows, hc, device=y.device)
        comb = torch.empty(rows, hc, hc, device=y.device)
        pre = torch.empty(rows, hc, device=y.device)
        quantized = empty_layer_input_form(quantize or None, rows, hidden, y.device)
        data, sf = (None, None) if quantized is None else (quantized.data, quantized.scale)
        self.compiled[quantize or None](
            residual, y, state.post, state.comb, fn, self._param(fn, scale, base), norm.weight, new, li, post, comb,
            pre, data, sf, layer.rms_norm_eps, layer.hc_eps, layer.hc_eps, layer.hc_post_alpha, norm.variance_epsilon,
        )  # fmt: skip
        state.pending = None
        self.calls += 1
        return BoundaryState(new, post, comb, pre), li, quantized  # type: ignore[return-value]


def ready_model(free: Any, rows: int) -> Any:
    """A copy of a boundaries-only toy model whose MoE returns its partial finalized (once, here), as attention does."""
    from bench.step import _finalized

    x = torch.zeros(rows, free.config.hidden_size, dtype=torch.bfloat16, device=free.device)
    finalized = {layer.index: _finalized(free, layer, x) for layer in free.layers}
    ready = copy.copy(free)
    ready.moe = lambda layer, x: finalized[layer.index]
    return ready


def words_differ(a: Recorded, b: Recorded) -> int:
    """Words (bf16, fp32, e4m3 or scale bytes) that differ between two recorded steps' sublayer outputs, over every
    call; raises if the steps made different calls."""
    if [len(o) for o in a.outputs] != [len(o) for o in b.outputs]:
        raise ValueError(f"the steps made different sublayer calls: {len(a.outputs)} and {len(b.outputs)}")
    differ = 0
    for outs_a, outs_b in zip(a.outputs, b.outputs, strict=True):
        for x, y in zip(outs_a, outs_b, strict=True):
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
            differ += int((x.reshape(-1).view(as_int) != y.reshape(-1).view(as_int)).sum())
    return differ


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168], choices=sorted(CLUSTERS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-clusters", type=int, default=4)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--prefetch", action="store_true", help="the one launch asks its fn lines into L2 first")
    args = ap.parse_args(argv)
    from bench import weight_reads
    from bench.timing import GraphTimer
    from boundary.toy import ToyConfig, ToyModel

    device = torch.device("cuda")
    timer = GraphTimer(device, replays=args.replays)
    reads = weight_reads.WeightReads(device, max(args.rows))
    print("H rows sublayers/step | us per step: shipped, one launch, copies | per boundary over copies: shipped, one")
    print("launch | one launch saves per sublayer call | words of the sublayers' outputs that differ", flush=True)
    for hidden in args.hidden:
        model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=args.layers), device=device)
        boundaries = 2 * args.layers  # as bench.step.boundaries_per_step
        compiled = {
            quant: compile_one_cluster(
                hidden, CLUSTERS[hidden], args.max_clusters, model.config.hc_sinkhorn_iters, "sm_90a", True, kernel,
                False, args.prefetch,
            )
            for quant, kernel in ((None, None), ("mxfp8", "mxfp8"))
        }  # fmt: skip
        for rows in args.rows:
            try:
                measure(hidden, rows, model, compiled, reads, timer, boundaries)
            except Exception as exc:  # noqa: BLE001 - one shape's failure must not cost the others their numbers
                print(f"{hidden} {rows} | failed: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.empty_cache()


def measure(hidden: int, rows: int, model: Any, compiled: dict, reads: Any, timer: Any, boundaries: int) -> None:
    """One (H, rows) line: the three steps' us, and the words the two steps' sublayer outputs differ by."""
    from bench import critical_path, weight_reads
    from bench.step import boundaries_only
    from boundary import BoundaryAllReduce

    device = torch.device("cuda")
    shipped = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
    one = OneLaunchV4(shipped, compiled)
    v3 = reads.model(ready_model(boundaries_only(model, rows), rows), rows, scale=hidden / weight_reads.HIDDEN)
    # Once eagerly, every sublayer call's outputs kept, then compared word for word.
    recorded = [Recorded(shipped), Recorded(one)]
    for b in recorded:
        critical_path.v4_step_call(v3, b, rows)()  # type: ignore[arg-type]
    torch.cuda.synchronize()
    differ = words_differ(*recorded)
    sublayers, one.calls = one.calls, 0
    del recorded
    copies = critical_path.OutputCopiesV4(rows, hidden, device)
    calls = [critical_path.v4_step_call(v3, b, rows) for b in (shipped, one, copies)]  # type: ignore[arg-type]
    us = [timer.per_call_us([call]) for call in calls]
    per = [(t - us[2]) / boundaries for t in us[:2]]
    print(
        f"{hidden} {rows} {sublayers} | {us[0]:.1f}, {us[1]:.1f}, {us[2]:.1f} | {per[0]:.2f}, {per[1]:.2f} | "
        f"{(us[0] - us[1]) / sublayers:.2f} | {differ}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
