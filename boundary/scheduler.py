"""The boundary scheduler: Boundaries, BoundaryState, DecodeStep and the overlap threshold."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from boundary import checks, mhc
from boundary.all_reduce import BoundaryAllReduce
from boundary.types import MHCLayer, MoEOutput, QuantizedActivation, UnfinalizedMoEOutput, empty_quantized_layer_input

# Measured on the H200 with the toy decode step (docs/PERF.md, v8-v11): the side stream pays 2-5 % of
# the whole step up to 128 rows; from 256 rows inline is 0.8-1.6 % faster.
MEASURED_OVERLAP_MAX_ROWS = 128


def _overlap_max_rows_default() -> int:
    raw = os.environ.get("MHC_OVERLAP_MAX_ROWS")
    if raw is None:
        return MEASURED_OVERLAP_MAX_ROWS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"MHC_OVERLAP_MAX_ROWS must be an int, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"MHC_OVERLAP_MAX_ROWS must be >= 0, got {value}")
    return value


MHC_OVERLAP_MAX_ROWS: int = _overlap_max_rows_default()
"""Steps of at most this many rows compute the coefficients on the layers' side streams."""


@dataclass
class DecodeStep:
    """One decode step's settings, made by the engine."""

    rows: int
    side_stream: bool

    @classmethod
    def for_rows(cls, rows: int, overlap_max_rows: int | None = None) -> DecodeStep:
        """The step for `rows` rows: coefficients on side streams when CUDA is present and rows are few."""
        checks.positive_int("rows", rows)
        limit = MHC_OVERLAP_MAX_ROWS if overlap_max_rows is None else overlap_max_rows
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"overlap_max_rows must be a non-negative int, got {limit!r}")
        return cls(rows=rows, side_stream=torch.cuda.is_available() and rows <= limit)


@dataclass
class BoundaryState:
    """The hc residual streams and the mixes carried to the next boundary."""

    residual: Tensor
    post: Tensor
    comb: Tensor
    pre: Tensor
    pending: Tensor | MoEOutput | None = None


class Boundaries:
    """Drives the boundaries of a decode step: the fused kernel on the main stream, the mixes beside it."""

    def __init__(self, all_reduce: BoundaryAllReduce) -> None:
        if not isinstance(all_reduce, BoundaryAllReduce):
            raise TypeError(f"all_reduce must be a BoundaryAllReduce, got {type(all_reduce).__name__}")
        self.all_reduce = all_reduce
        # The mHC ops follow the boundary's path: torch ops beside the reference, kernels otherwise.
        self.backend = "reference" if all_reduce.path == "reference" else "kernel"

    def first(self, layer: MHCLayer, x: Tensor, step: DecodeStep) -> tuple[BoundaryState, Tensor]:
        """The model entry: streams = the embedding broadcast to hc; input = RMSNorm(stream 0)."""
        self._check_step(step)
        hidden, dev = self.all_reduce.hidden_size, self.all_reduce.device
        checks.tensor("x", x, dtype=torch.bfloat16, shape=(step.rows, hidden), device=dev)
        if layer.hc_attn_fn_broadcast is None:
            raise ValueError("layer.hc_attn_fn_broadcast is None: the first layer needs the [24, H] broadcast fn")
        residual = x.unsqueeze(1).expand(-1, layer.hc_mult, -1).contiguous()
        return self._enter(layer, residual, None, layer.hc_attn_fn_broadcast, x, step)

    def pre(
        self, layer: MHCLayer, residual: Tensor, state: BoundaryState, step: DecodeStep
    ) -> tuple[BoundaryState, Tensor]:
        """An Engram layer's attention entry on injected streams: mixes, collapse with state.pre, norm."""
        self._check_step(step)
        self._check_state(state, step, pending=False)
        hidden, dev = self.all_reduce.hidden_size, self.all_reduce.device
        checks.tensor("residual", residual, dtype=torch.bfloat16, shape=(step.rows, layer.hc_mult, hidden), device=dev)
        return self._enter(layer, residual, state.pre, layer.hc_attn_fn, None, step)

    def sublayer(
        self,
        layer: MHCLayer,
        ffn: bool,
        state: BoundaryState,
        step: DecodeStep,
        *,
        quantize: bool = False,
        capture_aux: bool = False,
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | None, Tensor | None]:
        """The fused boundary on state.pending, then the mixes of the sublayer it prepares.

        Returns the new state, the bf16 layer input, its MXFP8 form with `quantize` and, with
        `capture_aux`, the mean of the new streams (valid after `join`).
        """
        self._check_step(step)
        self._check_state(state, step, pending=True)
        norm = layer.ffn_norm if ffn else layer.attn_norm
        fn, scale, base = (
            (layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base)
            if ffn
            else (layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base)
        )
        rows, hidden, dev = step.rows, self.all_reduce.hidden_size, self.all_reduce.device
        quantized = empty_quantized_layer_input(rows, hidden, dev) if quantize else None
        aux = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev) if capture_aux else None
        residual, layer_input = self._reduce(state, state.pre, norm.weight, norm.variance_epsilon, quantized, aux)
        post, comb, _, pre = self._mixes(layer, residual, fn, scale, base, None, step, layer_input)
        return BoundaryState(residual, post, comb, pre), layer_input, quantized, aux

    def post_only(self, state: BoundaryState) -> Tensor:
        """The residual-only boundary on state.pending: the new streams, with no layer input."""
        if not isinstance(state, BoundaryState):
            raise TypeError(f"state must be a BoundaryState, got {type(state).__name__}")
        self._check_state(state, None, pending=True)
        residual, _ = self._reduce(state, None, None, 0.0, None, None)
        return residual

    def join(self, layer: MHCLayer, step: DecodeStep) -> None:
        """Make the current stream wait for the layer's side stream (only when the step uses it; a no-op on the CPU)."""
        self._check_step(step)
        if self._side(step):
            torch.cuda.current_stream(self.all_reduce.device).wait_stream(layer.mhc_stream)

    def _enter(
        self, layer: MHCLayer, residual: Tensor, pre_mix: Tensor | None, fn: Tensor, x: Tensor | None,
        step: DecodeStep,
    ) -> tuple[BoundaryState, Tensor]:  # fmt: skip
        """Mixes and layer input of a sublayer entered without a reduction (first layer, Engram seam)."""
        norm = layer.attn_norm
        post, comb, layer_input, pre = self._mixes(
            layer, residual, fn, layer.hc_attn_scale, layer.hc_attn_base, pre_mix, step, None, x=x,
            norm_weight=norm.weight, norm_eps=norm.variance_epsilon,
        )  # fmt: skip
        return BoundaryState(residual, post, comb, pre), layer_input

    def _mixes(
        self, layer: MHCLayer, residual: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
        pre_mix: Tensor | None, step: DecodeStep, layer_input: Tensor | None, *, x: Tensor | None = None,
        norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        """post, comb, layer input, next pre: on the side stream for small steps, inline otherwise."""
        args = (
            residual, fn, scale, base, layer.rms_norm_eps, layer.hc_eps, layer.hc_eps, layer.hc_post_alpha,
            layer.hc_sinkhorn_iters, pre_mix, x, norm_weight, norm_eps,
        )  # fmt: skip
        if self._side(step):
            if not isinstance(layer.mhc_stream, torch.cuda.Stream):
                raise ValueError("step.side_stream is set but layer.mhc_stream is not a torch.cuda.Stream")
            return mhc.mhc_pre_delayed_overlap(*args, stream=layer.mhc_stream, layer_input=layer_input,
                                               backend=self.backend)  # fmt: skip
        if layer_input is not None:
            return mhc.mhc_pre_delayed_overlap(*args, stream=None, layer_input=layer_input, backend=self.backend)
        return mhc.mhc_pre_delayed(*args, backend=self.backend)

    def _reduce(
        self, state: BoundaryState, pre: Tensor | None, norm_weight: Tensor | None, norm_eps: float,
        quantized: QuantizedActivation | None, aux: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """The fused boundary on whatever the sublayer left pending."""
        ar, pending = self.all_reduce, state.pending
        common = (state.residual, state.post, state.comb, pre, norm_weight, norm_eps, quantized)
        if isinstance(pending, Tensor):
            return ar(pending, *common, aux_out=aux)
        routed = pending.routed
        if isinstance(routed, UnfinalizedMoEOutput):
            return ar.finalize(
                routed.gemm2_permuted, routed.expert_weights, routed.expanded_idx_to_permuted_idx,
                pending.shared_output, *common, aux_out=aux,
            )  # fmt: skip
        return ar(routed, *common, shared_output=pending.shared_output, aux_out=aux)

    def _side(self, step: DecodeStep) -> bool:
        """Whether this step's mixes run on side streams: they fall away on a CPU boundary."""
        return step.side_stream and self.all_reduce.device.type == "cuda"

    def _check_step(self, step: object) -> None:
        if not isinstance(step, DecodeStep):
            raise TypeError(f"step must be a DecodeStep, got {type(step).__name__}")

    def _check_state(self, state: object, step: DecodeStep | None, *, pending: bool) -> None:
        if not isinstance(state, BoundaryState):
            raise TypeError(f"state must be a BoundaryState, got {type(state).__name__}")
        if step is not None and state.residual.shape[0] != step.rows:
            raise ValueError(f"state.residual has {state.residual.shape[0]} rows but step.rows is {step.rows}")
        if pending:
            if state.pending is None:
                raise ValueError("state.pending is None: set it to the sublayer's output before the boundary")
            if not isinstance(state.pending, (Tensor, MoEOutput)):
                raise TypeError(f"state.pending must be a Tensor or a MoEOutput, got {type(state.pending).__name__}")
            if isinstance(state.pending, MoEOutput) and not isinstance(
                state.pending.routed, (Tensor, UnfinalizedMoEOutput)
            ):
                raise TypeError("state.pending.routed must be a Tensor or an UnfinalizedMoEOutput")
