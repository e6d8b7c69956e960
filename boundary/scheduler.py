"""The boundary scheduler: Boundaries, BoundaryState, DecodeStep and the overlap threshold."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from boundary import checks
from boundary.all_reduce import BoundaryAllReduce
from boundary.calls import DirectCalls, OpCalls
from boundary.params import MHCParams
from boundary.reference import MIX_WIDTH
from boundary.types import (
    Fp8GroupActivation,
    MHCLayer,
    MoEOutput,
    Norm,
    QuantizedActivation,
    UnfinalizedMoEOutput,
    empty_layer_input_form,
)
from cute_kernels.boundary import api as boundary_api
from cute_kernels.hardware import env_int

# Measured on the H200 in the V3 weight-read step (docs/PERF.md "The boundaries on the critical path", perf-log v32):
# with sublayers that fill the GPU, the coefficients inline cost each boundary 0.2-3.3 us less than on a side stream
# at every row count from 1 to 128, whichever node the engine joins on; so no step row count gets the side stream.
MEASURED_OVERLAP_MAX_ROWS = 0


_OVERLAP_ENV = env_int("MHC_OVERLAP_MAX_ROWS", 0)
MHC_OVERLAP_MAX_ROWS: int = MEASURED_OVERLAP_MAX_ROWS if _OVERLAP_ENV is None else _OVERLAP_ENV
"""Steps of at most this many rows compute the coefficients on the layers' side streams."""

QUANTIZE = tuple(boundary_api.QUANTIZE_FORMS)
"""The named forms `sublayer(quantize=)` writes the layer input in beside bf16 (CONTRACT §4, §4b); True is "mxfp8"
(the module's flag), False or None bf16 only."""


@dataclass
class DecodeStep:
    """One decode step's settings, made by the engine."""

    rows: int
    side_stream: bool

    def __post_init__(self) -> None:
        self.rows = checks.positive_int("DecodeStep.rows", self.rows)
        checks.flag("DecodeStep.side_stream", self.side_stream)

    @classmethod
    def for_rows(cls, rows: int, overlap_max_rows: int | None = None) -> DecodeStep:
        """The step for `rows` rows: coefficients on side streams when CUDA is present and rows are few."""
        rows = checks.positive_int("rows", rows)
        limit = (
            MHC_OVERLAP_MAX_ROWS
            if overlap_max_rows is None
            else checks.non_negative_int("overlap_max_rows", overlap_max_rows)
        )
        return cls(rows=rows, side_stream=torch.cuda.is_available() and rows <= limit)


@dataclass
class BoundaryState:
    """The hc residual streams and the mixes carried to the next boundary."""

    residual: Tensor
    post: Tensor
    comb: Tensor
    pre: Tensor
    pending: Tensor | MoEOutput | None = None


class _Reads(NamedTuple):
    """The layer attributes (CONTRACT §5) that entering one sublayer reads, in the order `_mixes` unpacks them,
    and one getter of them all."""

    names: tuple[str, ...]
    get: Callable[[Any], tuple[Any, ...]]


def _reads(fn: str, kind: str) -> _Reads:
    scale, base, norm = f"hc_{kind}_scale", f"hc_{kind}_base", f"{kind}_norm"
    names = (
        fn,
        scale,
        base,
        f"{norm}.weight",
        f"{norm}.variance_epsilon",
        "rms_norm_eps",
        "hc_eps",
        "hc_post_alpha",
        "hc_sinkhorn_iters",
        "hc_mult",
    )

    # A plain function rather than operator.attrgetter: as fast, and torch.compile traces it.
    def get(layer: Any) -> tuple[Any, ...]:
        n = getattr(layer, norm)
        return (
            getattr(layer, fn),
            getattr(layer, scale),
            getattr(layer, base),
            n.weight,
            n.variance_epsilon,
            layer.rms_norm_eps,
            layer.hc_eps,
            layer.hc_post_alpha,
            layer.hc_sinkhorn_iters,
            layer.hc_mult,
        )

    return _Reads(names, get)


FIRST = _reads("hc_attn_fn_broadcast", "attn")
ATTN = _reads("hc_attn_fn", "attn")
FFN = _reads("hc_ffn_fn", "ffn")


def _layer_names(reads: _Reads) -> dict[str, str]:
    """The mHC op and boundary arguments that `reads` fill, each mapped to the layer attribute (for messages)."""
    fn, scale, base, weight, eps, rms, hc_eps, alpha, iters, _ = (f"layer.{a}" for a in reads.names)
    return {
        "fn": fn,
        "hc_scale": scale,
        "hc_base": base,
        "norm_weight": weight,
        "norm_eps": eps,
        "rms_eps": rms,
        "hc_pre_eps": hc_eps,
        "hc_sinkhorn_eps": hc_eps,
        "hc_post_mult_value": alpha,
        "sinkhorn_repeat": iters,
    }


def _mhc_fits(
    fn: Any, scale: Any, base: Any, rms: float, hc_eps: float, alpha: float, iters: int, width: int, dev: int
) -> bool:
    """Whether the layer's mHC arguments pass checks.mhc_params (a few compares; False: run it to say why). `dev`:
    the boundary's device index (Tensor.get_device: -1 on the CPU)."""
    try:
        return (
            0.0 <= rms < math.inf
            and 0.0 <= hc_eps < math.inf
            and -math.inf < alpha < math.inf
            and iters >= 1
            and fn.dtype is scale.dtype is base.dtype is torch.float32
            and fn.shape == (MIX_WIDTH, width)
            and scale.shape == (3,)
            and base.shape == (MIX_WIDTH,)
            and fn.get_device() == scale.get_device() == base.get_device() == dev
            and (dev >= 0 or not (fn.is_meta or scale.is_meta or base.is_meta))  # get_device(): -1 on meta and CPU
            and fn.is_contiguous()
            and scale.is_contiguous()
            and base.is_contiguous()
        )
    except (AttributeError, TypeError):
        return False


def _scalars(values: tuple[Any, ...], reads: _Reads) -> tuple[Any, ...]:
    """The layer's eps values, post multiplier and Sinkhorn count as a float and an int, or an error naming the
    attribute: the custom ops' dispatcher refuses a str or None with a message that names none (numpy scalars and
    ints are converted, as the direct path converts them)."""
    names = [f"layer.{a}" for a in reads.names]
    eps, rms, hc_eps, alpha = (
        checks.finite_float(names[i], values[i], minimum=None if i == 7 else 0.0) for i in (4, 5, 6, 7)
    )
    return (*values[:4], eps, rms, hc_eps, alpha, checks.positive_int(names[8], values[8]), values[9])


def _state_names(state: BoundaryState) -> dict[str, str]:
    """The boundary arguments that a state fills, each mapped to the state field (for messages)."""
    names = {"residual": "state.residual", "post": "state.post", "comb": "state.comb", "pre": "state.pre"}
    pending = state.pending
    if isinstance(pending, Tensor):
        names["x"] = "state.pending"
    elif isinstance(pending, MoEOutput):
        names["shared_output"] = "state.pending.shared_output"
        if isinstance(pending.routed, Tensor):
            names["x"] = "state.pending.routed"
        else:
            for field in ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx"):
                names[field] = f"state.pending.routed.{field}"
    return names


def final_norm(norm: Norm | Tensor, eps: float | None) -> tuple[Tensor, float | None]:
    """The final norm's weight and eps: from the norm object (its .weight and .variance_epsilon), or the weight and
    eps as given (`final(state, norm_weight, eps)`)."""
    if eps is not None or isinstance(norm, Tensor):
        return norm, eps  # type: ignore[return-value]
    try:
        return norm.weight, norm.variance_epsilon
    except AttributeError:
        raise TypeError(
            f"norm must be the final norm (with .weight and .variance_epsilon) or its weight tensor followed by eps, "
            f"got {type(norm).__name__}"
        ) from None


def _missing(layer: Any, attrs: tuple[str, ...]) -> None:
    """Raise a TypeError naming the first of `attrs` (dotted paths) that `layer` lacks; return if it has them all."""
    for path in attrs:
        obj = layer
        for part in path.split("."):
            if not hasattr(obj, part):
                raise TypeError(
                    f"layer.{path} is missing (the layer is a {type(layer).__name__}): a layer provides the mHC "
                    "attributes of CONTRACT §5 (boundary.types.MHCLayer; boundary/toy.py's ToyLayer has them all)"
                )
            obj = getattr(obj, part)


class Boundaries:
    """Drives the boundaries of a decode step: the fused kernel on the main stream, the mixes beside it.

    A boundary consumes the state it reduces: `sublayer` and `post_only` set `state.pending` to None, so that
    the same partial cannot be reduced twice; carry on with the state they return.
    """

    def __init__(self, all_reduce: BoundaryAllReduce, *, custom_ops: bool = False) -> None:
        if not isinstance(all_reduce, BoundaryAllReduce):
            raise TypeError(f"all_reduce must be a BoundaryAllReduce, got {type(all_reduce).__name__}")
        self.all_reduce = all_reduce
        # custom_ops: every boundary and coefficients call goes through torch.ops.mhc_boundary (torch.compile traces
        # them), with the coefficients inline on the current stream.
        self.custom_ops = checks.flag("custom_ops", custom_ops)
        # The mHC ops follow the boundary's path: torch ops beside the reference, kernels otherwise.
        self.backend = "reference" if all_reduce.path == "reference" else "kernel"
        # Simulated ranks run their steps at once on one GPU: each rank's coefficients need a workspace of its own.
        owner = all_reduce.rank if all_reduce.simulated_ranks else None
        self._calls = (OpCalls if self.custom_ops else DirectCalls)(all_reduce, self.backend, owner)

    def first(self, layer: MHCLayer, x: Tensor, step: DecodeStep) -> tuple[BoundaryState, Tensor]:
        """The model entry: streams = the embedding broadcast to hc; input = RMSNorm(stream 0)."""
        self._check_step(step)
        ar = self.all_reduce
        checks.tensor("x", x, dtype=torch.bfloat16, shape=(step.rows, ar.hidden_size), device=ar.device)
        values = self._layer(layer, FIRST)
        if values[0] is None:
            raise ValueError("layer.hc_attn_fn_broadcast is None: the first layer needs the [24, H] broadcast fn")
        residual = x.unsqueeze(1).expand(-1, ar.hc_mult, -1).contiguous()
        return self._enter(layer, values, FIRST, residual, None, x, step)

    def pre(
        self, layer: MHCLayer, residual: Tensor, state: BoundaryState, step: DecodeStep
    ) -> tuple[BoundaryState, Tensor]:
        """An Engram layer's attention entry on injected streams: mixes, collapse with state.pre, norm."""
        self._check_step(step)
        self._check_state(state, step, pending=False)
        values = self._layer(layer, ATTN)
        ar = self.all_reduce
        checks.tensor(
            "residual", residual, dtype=torch.bfloat16, shape=(step.rows, ar.hc_mult, ar.hidden_size), device=ar.device
        )
        return self._enter(layer, values, ATTN, residual, state.pre, None, step)

    def sublayer(
        self,
        layer: MHCLayer,
        ffn: bool,
        state: BoundaryState,
        step: DecodeStep,
        *,
        quantize: bool | str | None = False,
        capture_aux: bool = False,
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | Fp8GroupActivation | None, Tensor | None]:
        """The fused boundary on state.pending (which it consumes), then the mixes of the sublayer it prepares.

        Returns the new state, the bf16 layer input, its `quantize` form (True or "mxfp8": a QuantizedActivation;
        "fp8_1x128" / "fp8_1x128_ue8m0": an Fp8GroupActivation; False or None: none) and, with `capture_aux`, the
        mean of the new streams.
        """
        self._check_step(step)
        if not (type(ffn) is type(capture_aux) is bool):  # one test when both are bools
            checks.flag("ffn", ffn)
            checks.flag("capture_aux", capture_aux)
        if quantize is not False:
            quantize = checks.quantize_form("quantize", quantize, QUANTIZE)
        self._check_state(state, step, pending=True)
        reads = FFN if ffn else ATTN
        values = self._layer(layer, reads)
        rows, hidden, dev = step.rows, self.all_reduce.hidden_size, self.all_reduce.device
        # The form is decided here, once: each buffer goes to its own argument.
        quantized = empty_layer_input_form(quantize or None, rows, hidden, dev)
        mxfp8 = quantized if isinstance(quantized, QuantizedActivation) else None
        fp8 = quantized if isinstance(quantized, Fp8GroupActivation) else None
        aux = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev) if capture_aux else None
        try:
            residual, layer_input = self._calls.boundary(state, state.pre, values[3], values[4], mxfp8, fp8, aux)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _layer_names(reads), converted_at_load=True)
            checks.rename(exc, _state_names(state))
            raise
        state.pending = None
        post, comb, _, pre = self._mixes(layer, values, reads, residual, None, step, layer_input)
        return BoundaryState(residual, post, comb, pre), layer_input, mxfp8 if fp8 is None else fp8, aux

    def post_only(self, state: BoundaryState) -> Tensor:
        """The residual-only boundary on state.pending (which it consumes): the new streams, with no layer input."""
        self._check_state(state, None, pending=True)
        return self._post(state)

    def _post(self, state: BoundaryState) -> Tensor:
        """post_only on a checked state: the residual-only boundary, state.pending consumed."""
        try:
            residual, _ = self._calls.boundary(state, None, None, 0.0, None, None, None)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _state_names(state))
            raise
        state.pending = None
        return residual

    def final(self, state: BoundaryState, norm: Norm | Tensor, eps: float | None = None) -> Tensor:
        """The last boundary (CONTRACT §4c) on state.pending (which it consumes): RMSNorm(collapse(streams, pre)).

        `final(state, norm)` takes the model's final norm (its `.weight` and `.variance_epsilon`), as the module
        spells it; `final(state, norm_weight, eps)` the same two values.
        """
        if not isinstance(state, BoundaryState):
            raise TypeError(f"state must be a BoundaryState, got {type(state).__name__}")
        norm_weight, eps = final_norm(norm, eps)
        if eps is None and isinstance(norm, Tensor):
            raise TypeError("final(state, norm_weight, eps): eps is missing after the norm weight")
        # Here: the custom op's dispatcher would refuse a str or None naming no argument.
        eps = checks.finite_float("eps" if isinstance(norm, Tensor) else "norm.variance_epsilon", eps, minimum=0.0)
        self._check_state(state, None, pending=True)
        # The fused boundary with the final norm's weight: the residual-only reduction, the collapse with state.pre
        # and the norm in one call (one launch on the kernels, which also store the new streams that final drops).
        try:
            hidden = self._calls.final(state, norm_weight, eps)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, {"norm_eps": "eps"})
            checks.rename(exc, _state_names(state))
            raise
        state.pending = None
        return hidden

    def join(self, layer: MHCLayer, step: DecodeStep) -> None:
        """Make the current stream wait for the layer's side stream (only when the step uses it; a no-op on the CPU)."""
        self._check_step(step)
        if self._side(step):
            torch.cuda.current_stream(self.all_reduce.device).wait_stream(self._stream(layer))

    def _layer(self, layer: Any, reads: _Reads) -> tuple[Any, ...]:
        """The values of `reads` on `layer`, with layer.hc_mult checked (its last)."""
        try:
            values = reads.get(layer)
        except AttributeError:
            _missing(layer, reads.names)
            raise
        _, _, _, _, eps, rms, hc_eps, alpha, iters, hc = values
        if not (type(eps) is type(rms) is type(hc_eps) is type(alpha) is float and type(iters) is int):
            values = _scalars(values, reads)
        if type(hc) is not int or hc != self.all_reduce.hc_mult:
            hc = checks.integer("layer.hc_mult", hc)
            if hc != self.all_reduce.hc_mult:
                raise ValueError(f"layer.hc_mult is {hc}, but the boundary serves hc_mult={self.all_reduce.hc_mult}")
        # The mHC arguments too, before a boundary consumes state.pending (nothing half-written: CONTRACT §5 Errors);
        # the coefficients call that reads them checks them again, as its own public edge.
        fn, scale, base, _, _, rms, hc_eps, alpha, iters, _ = values
        ar = self.all_reduce
        width = ar.hidden_size * (1 if reads is FIRST else ar.hc_mult)
        if fn is not None and not _mhc_fits(fn, scale, base, rms, hc_eps, alpha, iters, width, ar._device_index):
            try:
                checks.mhc_params(MHCParams(fn, scale, base, rms, hc_eps, hc_eps, alpha, iters), hc, width, ar.device)
            except (TypeError, ValueError) as exc:
                checks.rename(exc, _layer_names(reads), converted_at_load=True)
                raise
        return values

    def _stream(self, layer: Any) -> Any:
        try:
            return layer.mhc_stream
        except AttributeError:
            _missing(layer, ("mhc_stream",))
            raise

    def _enter(
        self,
        layer: MHCLayer,
        values: tuple[Any, ...],
        reads: _Reads,
        residual: Tensor,
        pre_mix: Tensor | None,
        x: Tensor | None,
        step: DecodeStep,
    ) -> tuple[BoundaryState, Tensor]:
        """Mixes and layer input of a sublayer entered without a reduction (first layer, Engram seam)."""
        post, comb, layer_input, pre = self._mixes(layer, values, reads, residual, pre_mix, step, None, x=x)
        return BoundaryState(residual, post, comb, pre), layer_input

    def _mixes(
        self,
        layer: MHCLayer,
        values: tuple[Any, ...],
        reads: _Reads,
        residual: Tensor,
        pre_mix: Tensor | None,
        step: DecodeStep,
        layer_input: Tensor | None,
        *,
        x: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """post, comb, layer input, next pre: on the side stream for small steps, inline otherwise. Without
        `layer_input` the layer input is computed here, with the sublayer's norm."""
        fn, scale, base, weight, eps, rms_eps, hc_eps, alpha, iters, _ = values
        params = MHCParams(fn, scale, base, rms_eps, hc_eps, hc_eps, alpha, iters)
        norm_weight, norm_eps = (weight, eps) if layer_input is None else (None, 1e-6)
        try:
            stream = None
            if self._side(step):
                stream = self._stream(layer)
                if not isinstance(stream, torch.cuda.Stream):
                    raise ValueError("step.side_stream is set but layer.mhc_stream is not a torch.cuda.Stream")
            return self._calls.coefficients(residual, params, pre_mix, x, norm_weight, norm_eps, layer_input, stream)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _layer_names(reads), converted_at_load=True)
            checks.rename(exc, {"pre_mix": "state.pre"})
            raise

    def _side(self, step: DecodeStep) -> bool:
        """Whether this step's mixes run on side streams: they fall away on a CPU boundary."""
        return step.side_stream and self.all_reduce.device.type == "cuda" and self._calls.side_streams

    def _check_step(self, step: object) -> None:
        if not isinstance(step, DecodeStep):
            raise TypeError(f"step must be a DecodeStep, got {type(step).__name__}")
        if step.rows > self.all_reduce.max_rows:
            raise ValueError(
                f"step.rows ({step.rows}) exceed the boundary's capacity max_rows="
                f"{self.all_reduce.max_rows}: build the BoundaryAllReduce with max_rows >= the largest "
                "step"
            )

    def _check_state(self, state: object, step: DecodeStep | None, *, pending: bool) -> None:
        if not isinstance(state, BoundaryState):
            raise TypeError(f"state must be a BoundaryState, got {type(state).__name__}")
        if not isinstance(state.residual, Tensor):  # the other fields are named where the boundary checks them
            raise TypeError(f"state.residual must be a Tensor, got {type(state.residual).__name__}")
        if step is not None and state.residual.shape[0] != step.rows:
            raise ValueError(f"state.residual has {state.residual.shape[0]} rows but step.rows is {step.rows}")
        if not pending:
            if state.pending is not None:
                raise ValueError(
                    "state.pending is set: reduce it with post_only(state) before pre() (pre enters a "
                    "sublayer on the streams post_only returned, and reduces nothing)"
                )
            return
        if state.pending is None:
            raise ValueError(
                "state.pending is None: set it to the sublayer's output before each boundary; a boundary "
                "consumes it (sublayer and post_only set it to None), so carry on with the state that "
                "sublayer returned"
            )
        if not isinstance(state.pending, (Tensor, MoEOutput)):
            raise TypeError(f"state.pending must be a Tensor or a MoEOutput, got {type(state.pending).__name__}")
        if isinstance(state.pending, MoEOutput) and not isinstance(
            state.pending.routed, (Tensor, UnfinalizedMoEOutput)
        ):
            raise TypeError("state.pending.routed must be a Tensor or an UnfinalizedMoEOutput")
