"""The side streams under lateness (#46): a boundary never reads coefficients its side stream has not written yet,
whether the engine joins right before the boundary or before the sublayer's last kernel; the negative control, with
no join at all, reads them early and gets other bits, so the test can fail."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from boundary import Boundaries, BoundaryAllReduce, DecodeStep
from boundary.toy import ToyConfig, ToyModel, compare, decode_step, random_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

H, ROWS = 4096, 4
LATE_CYCLES = 20_000_000  # ~10 ms of device time on every side stream before its coefficients


class LateSideStreams:
    """Our Boundaries, with every boundary's side stream asleep before the call enqueues its coefficients there, and
    the engine's join at `placement`: "boundary" (the step's own join calls), "early" (inside the sublayer, before
    its last kernel: `model_with_early_join`) or "missing" (no join: the negative control)."""

    def __init__(self, boundaries: Boundaries, placement: str) -> None:
        self.boundaries, self.placement = boundaries, placement

    def __getattr__(self, name: str) -> Any:
        return getattr(self.boundaries, name)

    def _late(self, layer: Any) -> None:
        with torch.cuda.stream(layer.mhc_stream):
            torch.cuda._sleep(LATE_CYCLES)

    def first(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        self._late(layer)
        return self.boundaries.first(layer, *args, **kwargs)

    def pre(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        self._late(layer)
        return self.boundaries.pre(layer, *args, **kwargs)

    def sublayer(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        self._late(layer)
        return self.boundaries.sublayer(layer, *args, **kwargs)

    def join(self, layer: Any, step: DecodeStep) -> None:
        if self.placement == "boundary":
            self.boundaries.join(layer, step)


def model_with_early_join(model: ToyModel, boundaries: Boundaries, step: DecodeStep) -> ToyModel:
    """`model` whose attention and MoE join the layer's side stream before a last kernel of their own."""
    import copy

    early = copy.copy(model)

    def ending(sublayer: Any) -> Any:
        def run(layer: Any, x: torch.Tensor) -> Any:
            out = sublayer(layer, x)
            boundaries.join(layer, step)
            torch.cuda._sleep(1000)  # the sublayer's last kernel, after the join
            return out

        return run

    early.attention = ending(model.attention)  # type: ignore[method-assign]
    early.moe = ending(model.moe)  # type: ignore[method-assign]
    return early


@pytest.fixture(scope="module")
def setup() -> tuple[ToyModel, Boundaries]:
    model = ToyModel(ToyConfig(hidden_size=H, num_layers=3), device="cuda")
    ar = BoundaryAllReduce(H, max_rows=8, device="cuda")
    ar.warmup(progress=False, quantize=("mxfp8",))
    return model, Boundaries(ar)


def _late_step(model: ToyModel, boundaries: Boundaries, placement: str, tokens: torch.Tensor) -> Any:
    step = DecodeStep(rows=ROWS, side_stream=True)
    late = LateSideStreams(boundaries, placement)
    if placement == "early":
        model = model_with_early_join(model, boundaries, step)
    out = decode_step(model, late, tokens, step)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("placement", ["boundary", "early"])
def test_a_late_side_stream_never_lets_a_boundary_read_stale_coefficients(
    setup: tuple[ToyModel, Boundaries], placement: str
) -> None:
    model, boundaries = setup
    tokens = random_tokens(model, ROWS, 0)
    on_time = decode_step(model, boundaries, tokens, DecodeStep(rows=ROWS, side_stream=True))
    torch.cuda.synchronize()
    decode_step(model, boundaries, random_tokens(model, ROWS, 1), DecodeStep(rows=ROWS, side_stream=True))
    assert compare(_late_step(model, boundaries, placement, tokens), on_time)["bitwise"]


def test_the_negative_control_without_a_join_reads_them_early(setup: tuple[ToyModel, Boundaries]) -> None:
    """The same late side streams with no join: the boundaries run ahead of their coefficients and the step's bits
    differ, so the test above would catch a missing wait."""
    model, boundaries = setup
    tokens = random_tokens(model, ROWS, 0)
    on_time = decode_step(model, boundaries, tokens, DecodeStep(rows=ROWS, side_stream=True))
    torch.cuda.synchronize()
    # Another step first, so that a coefficients buffer the allocator hands out again holds other tokens' values.
    decode_step(model, boundaries, random_tokens(model, ROWS, 1), DecodeStep(rows=ROWS, side_stream=True))
    assert not compare(_late_step(model, boundaries, "missing", tokens), on_time)["bitwise"]
