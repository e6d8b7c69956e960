"""What a boundary costs on a step's critical path (#46): the V3 weight-read step (bench.weight_reads: each sublayer
takes a real layer's time at few rows) with our boundaries, against the same step whose boundaries only write their
outputs (`OutputCopies`). Their difference over the step's boundaries is how much later, on average, each next
sublayer starts because of its boundary: the kernel's own time, the launch gaps and joins around it, and what its
side-stream coefficients take from the sublayers they overlap. Reported with the side streams on (the engine's join
right before each boundary, or before each sublayer's last kernel: `EarlyJoin`) and off; and for DeepSeek-V4's scheme
(`V4Boundaries` in the toy V4 step, whose coefficients are on the critical path by design) against `OutputCopiesV4`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from boundary import Boundaries, BoundaryState, DecodeStep, V4Boundaries
from boundary.toy import ToyModel, decode_step_v4, random_tokens
from boundary.types import MHCLayer, QuantizedActivation, empty_quantized


class OutputCopies:
    """Stands in for `Boundaries` in the toy step: every boundary only writes its outputs, copies of tensors made once
    (the new streams [T, 4, H] and the layer input [T, H]: one copy kernel each), so that a step of it costs its
    sublayers, its model code and the boundaries' least output writes. The mixes a state carries are made once too;
    an MXFP8 or aux output asked for is a buffer allocated, not written."""

    def __init__(self, rows: int, hidden: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(rows)
        self.streams = torch.randn(rows, 4, hidden, generator=g, device=device).to(torch.bfloat16)
        self.layer_input = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
        self.post = torch.rand(rows, 4, generator=g, device=device) * 2
        self.comb = torch.softmax(torch.randn(rows, 4, 4, generator=g, device=device), -1)
        self.pre_mix = torch.rand(rows, 4, generator=g, device=device)
        self.rows, self.hidden, self.device = rows, hidden, device

    def _state(self) -> BoundaryState:
        return BoundaryState(self.streams.clone(), self.post, self.comb, self.pre_mix)

    def first(self, layer: MHCLayer, x: Tensor, step: DecodeStep) -> tuple[BoundaryState, Tensor]:
        """The model entry: the streams and the layer input written."""
        return self._state(), self.layer_input.clone()

    def pre(
        self, layer: MHCLayer, residual: Tensor, state: BoundaryState, step: DecodeStep
    ) -> tuple[BoundaryState, Tensor]:
        """An Engram layer's entry: the streams and the layer input written."""
        return self._state(), self.layer_input.clone()

    def sublayer(
        self,
        layer: MHCLayer,
        ffn: bool,
        state: BoundaryState,
        step: DecodeStep,
        *,
        quantize: bool | str | None = False,
        capture_aux: bool = False,
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | None, Tensor | None]:
        """A boundary: the new streams and the layer input written (an MXFP8 or aux output only allocated)."""
        quantized = empty_quantized(self.rows, self.hidden, self.device) if quantize else None
        aux = torch.empty(self.rows, self.hidden, dtype=torch.bfloat16, device=self.device) if capture_aux else None
        return self._state(), self.layer_input.clone(), quantized, aux

    def post_only(self, state: BoundaryState) -> Tensor:
        """The residual-only boundary: the new streams written."""
        return self.streams.clone()

    def join(self, layer: MHCLayer, step: DecodeStep) -> None:
        """No side stream to wait for."""

    def final(self, state: BoundaryState, norm: Any, eps: float | None = None) -> Tensor:
        """The final boundary: the final hidden state written."""
        return self.layer_input.clone()


class OutputCopiesV4(OutputCopies):
    """OutputCopies in V4Boundaries' protocol (the toy V4 step): `sublayer` gives (state, layer input, quantized) and
    `final` takes hc_head's holder and the final norm."""

    def sublayer(  # type: ignore[override]
        self, layer: MHCLayer, ffn: bool, state: BoundaryState, step: DecodeStep, *, quantize: bool | str | None = False
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | None]:
        """A boundary: the new streams and the layer input written (an MXFP8 output only allocated)."""
        new, layer_input, quantized, _ = super().sublayer(layer, ffn, state, step, quantize=quantize)
        return new, layer_input, quantized

    def final(self, state: BoundaryState, head: Any, norm: Any, eps: float | None = None) -> Tensor:  # type: ignore[override]
        """The final boundary: the final hidden state written."""
        return self.layer_input.clone()


def v4_step_call(model: ToyModel, boundaries: V4Boundaries | OutputCopiesV4, rows: int) -> Callable[[], object]:
    """One toy V4 step (decode_step_v4, no side stream) of `rows` tokens driven by `boundaries`."""
    tokens = random_tokens(model, rows, 0)
    step = DecodeStep(rows=rows, side_stream=False)
    return lambda: decode_step_v4(model, boundaries, tokens, step)  # type: ignore[arg-type]


class EarlyJoin:
    """Our `Boundaries` with the engine's side-stream join placed before each sublayer's last kernel instead of right
    before the boundary: the step's own `join` calls do nothing, and the sublayer calls `before_last(layer)` between
    its kernels (bench.weight_reads), which joins there. The boundary then has one graph parent, the sublayer's last
    kernel, and still runs after the coefficients it reads (through that kernel)."""

    def __init__(self, boundaries: Boundaries, step: DecodeStep) -> None:
        self.boundaries, self.step = boundaries, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.boundaries, name)

    def join(self, layer: MHCLayer, step: DecodeStep) -> None:
        """Joined already, before the sublayer's last kernel."""

    def before_last(self, layer: MHCLayer) -> None:
        """The join, where the sublayer's last kernel is about to be launched."""
        self.boundaries.join(layer, self.step)


MODES = ("side", "early", "inline")


def add_critical_path(row: dict[str, Any], boundaries: int) -> None:
    """The per-boundary critical-path cost of a step row that has the V3 step with side streams (joined on the
    boundary, and early), inline and with output copies only; and of the V4 step over its own copies, where timed."""
    for mode in MODES:
        row[f"critical_{mode}_us"] = (row[f"v3_{mode}_us"] - row["v3_copies_us"]) / boundaries
    if "v3_v4_us" in row:
        row["critical_v4_us"] = (row["v3_v4_us"] - row["v3_v4_copies_us"]) / boundaries


def print_critical_path(rows: list[dict]) -> None:
    """The critical-path tables: the V3 weight-read step with our boundaries and with output copies only (TP 1), and
    the boundaries-only step of simulated ranks likewise."""
    print_simulated([r for r in rows if "copies_us" in r])
    rows = [r for r in rows if "v3_copies_us" in r]
    if not rows:
        return
    print(
        "\nboundaries on the critical path (V3 weight-read step, TP 1, one CUDA graph, L2 flushed; H 5120: V3's reads x "
        "5120/7168), GPU us"
    )
    head = (
        f"{'H':>5} {'rows':>4} {'bnd':>3} | {'side':>8} {'early':>8} {'inline':>8} {'copies':>8} | "
        f"{'/bnd side':>9} {'/bnd early':>10} {'/bnd inline':>11} | {'V4':>8} {'V4 cop':>8} {'/bnd V4':>8}"
    )
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in rows:
        print(
            f"{r['H']:>5} {r['rows']:>4} {r['boundaries']:>3} | {r['v3_side_us']:8.1f} {r['v3_early_us']:8.1f} "
            f"{r['v3_inline_us']:8.1f} {r['v3_copies_us']:8.1f} | {r['critical_side_us']:9.2f} "
            f"{r['critical_early_us']:10.2f} {r['critical_inline_us']:11.2f} | {r.get('v3_v4_us', nan):8.1f} "
            f"{r.get('v3_v4_copies_us', nan):8.1f} {r.get('critical_v4_us', nan):8.2f}"
        )
    print(
        "side: our boundaries with the coefficients on side streams, joined right before each boundary; early: joined "
        "before each sublayer's last kernel (EarlyJoin); inline: the coefficients inline; copies: every boundary only "
        "writes its outputs (bench.critical_path.OutputCopies); /bnd: (ours - copies) / boundaries, how much later each "
        "next sublayer starts because of its boundary; V4: the toy DeepSeek-V4 step (V4Boundaries: each boundary "
        "computes its own pre, so its coefficients are on the critical path) on the same sublayers, against its own "
        "copies step (OutputCopiesV4)"
    )


def print_simulated(rows: list[dict]) -> None:
    """The simulated ranks' critical path: (their boundaries-only step - the same with output copies) / boundaries."""
    if not rows:
        return
    print("\nboundaries on the critical path, SIMULATED TP ranks on one GPU (boundaries-only step), GPU us")
    head = f"{'H':>5} {'TP':>2} {'rows':>4} {'bnd':>3} | {'copies':>8} | {'/bnd side':>9} {'/bnd inline':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['H']:>5} {r['tp']:>2} {r['rows']:>4} {r['boundaries']:>3} | {r['copies_us']:8.1f} | "
            f"{r['critical_side_us']:9.2f} {r['critical_inline_us']:11.2f}"
        )
    print(
        "copies: every rank's step with boundaries that only write their outputs, each rank on its own stream; /bnd: "
        "(ours - copies) / boundaries with the coefficients on side streams / inline; W ranks share one GPU's SMs and "
        "HBM: not a TP step's cost"
    )
