"""The DeepSeek-V4 scheme's boundaries (own pre, `hc_head`; CONTRACT §4d): V4Boundaries and the head's protocol.

A V4 boundary reduces the pending partial into the streams with the mixes the state carries (the fused residual-only
boundary: the all-reduce inside on the peer path, one launch), then computes the next sublayer's mixes from the new
streams and collapses them with that very pre (the coefficients kernel's own-pre variant, whose CTAs that finish
the rows write their layer input: one launch at 1 row, two from 2 rows). Its coefficients sit on the critical path: there is no side stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from boundary import checks, mhc
from boundary.all_reduce import BoundaryAllReduce
from boundary.params import MHCParams
from boundary.scheduler import (
    ATTN,
    FFN,
    FIRST,
    QUANTIZE,
    Boundaries,
    BoundaryState,
    DecodeStep,
    _layer_names,
    _Reads,
    _state_names,
    final_norm,
)
from boundary.types import (
    Fp8GroupActivation,
    MHCLayer,
    Norm,
    QuantizedActivation,
    empty_layer_input_form,
    quant_form,
)
from cute_kernels.boundary.config import own_pre_final


class V4Head(Protocol):
    """The model-level attributes `V4Boundaries.final` reads (DeepSeek-V4's `hc_head_*`, CONTRACT §5)."""

    hc_head_fn: Tensor  # [hc, hc*H] fp32
    hc_head_scale: Tensor  # [1] fp32
    hc_head_base: Tensor  # [hc] fp32
    rms_norm_eps: float  # the projection's RMS eps
    hc_eps: float  # added to each weight after the sigmoid


class V4Boundaries:
    """Drives the boundaries of a DeepSeek-V4 decode step (own pre).

    The state carries the new streams and the post / comb of the sublayer it entered; `state.pre` is the pre-mix its
    layer input was collapsed with (V4 carries none forward). As with `Boundaries`, a boundary consumes
    `state.pending`.
    """

    def __init__(self, all_reduce: BoundaryAllReduce, *, custom_ops: bool = False) -> None:
        if not isinstance(all_reduce, BoundaryAllReduce):
            raise TypeError(f"all_reduce must be a BoundaryAllReduce, got {type(all_reduce).__name__}")
        self.all_reduce = all_reduce
        # The reductions (post_only) and the layer protocol's reads are the V4.1 scheduler's own, through the custom
        # ops with custom_ops (torch.compile traces them), as the mixes and the collapse below.
        self._boundaries = Boundaries(all_reduce, custom_ops=custom_ops)
        self.custom_ops = self._boundaries.custom_ops
        self.backend = self._boundaries.backend
        self._owner = all_reduce.rank if all_reduce.simulated_ranks else None

    # Methods, not closures stored on self: a cycle would keep this object, its BoundaryAllReduce and that one's
    # process group alive until a garbage collection, past destroy_process_group (gloo then aborted at interpreter
    # exit, about 1 run in 20 of the two-rank demo).
    def _mixes(self, residual: Tensor, params: MHCParams, x: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The mixes of `residual` (of `x` with the broadcast fn)."""
        if self.custom_ops:
            return torch.ops.mhc_boundary.mhc_mixes(residual, *params, x, self.backend, self._owner)
        return mhc.mixes(residual, params, x, backend=self.backend, workspace_owner=self._owner)

    def _head_input(self, residual: Tensor, *weights: Any) -> Tensor:
        """hc_head's weights, the collapse and the final norm of `residual` (mhc.head_input)."""
        if self.custom_ops:
            return torch.ops.mhc_boundary.hc_head_input(residual, *weights, self.backend, self._owner)
        return mhc.head_input(residual, *weights, backend=self.backend, workspace_owner=self._owner)

    def _own_pre(
        self,
        residual: Tensor,
        params: MHCParams,
        weight: Tensor,
        eps: float,
        quantized: QuantizedActivation | Fp8GroupActivation | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(post, comb, pre, layer input) of the streams, the layer input collapsed with that pre (one call of the
        own-pre variant), its quantized form into `quantized`."""
        if not self.custom_ops:
            return mhc.own_pre(
                residual,
                params,
                weight,
                eps,
                quantized_out=quantized,
                backend=self.backend,
                workspace_owner=self._owner,
            )
        data, scale, form = (
            (None, None, None) if quantized is None else (quantized.data, quantized.scale, quant_form(quantized))
        )
        return torch.ops.mhc_boundary.mhc_own_pre(
            residual, *params, weight, eps, data, scale, form, self.backend, self._owner
        )

    def _collapse_norm(
        self,
        residual: Tensor,
        pre: Tensor,
        weight: Tensor,
        eps: float,
        quantized: QuantizedActivation | Fp8GroupActivation | None = None,
    ) -> Tensor:
        """The layer input collapsed with `pre` and normed (one launch), its quantized form into `quantized`."""
        if not self.custom_ops:
            return mhc.collapse_norm(residual, pre, weight, eps, quantized_out=quantized, backend=self.backend)
        if quantized is None:
            return torch.ops.mhc_boundary.collapse_norm(residual, pre, weight, eps, self.backend)
        return torch.ops.mhc_boundary.collapse_norm_quantized(
            residual, pre, weight, eps, quantized.data, quantized.scale, quant_form(quantized), self.backend
        )

    def warmup(
        self,
        max_rows: int | None = None,
        *,
        quantize: Sequence[str] | None = QUANTIZE,
        sinkhorn_repeat: int = 20,
        progress: bool = True,
    ) -> None:
        """`BoundaryAllReduce.warmup` with the V4 kernels too: the own-pre layer input in the `quantize` forms. The
        arguments are that method's."""
        self.all_reduce.warmup(
            max_rows, quantize=quantize, own_pre=True, sinkhorn_repeat=sinkhorn_repeat, progress=progress
        )

    def weights_updated(self) -> None:
        """Call after updating hc_head's weights where torch does not see it (a loader's `param.data.copy_`, a
        collective into the parameter) and before replaying CUDA graphs captured earlier: the kernel path keeps
        device copies of hc_head's scale and base (and, past one launch, its fn as 24 mixes), rewritten here in
        place, on the current stream, so that captured graphs read the new values. Updates torch sees (in-place ops,
        a new storage) are taken by the next eager call; the layers' weights are read where they lie. Inference
        tensors keep no version: an in-place update of one (inside inference mode) needs this call too."""
        mhc.refresh_weights()

    def first(self, layer: MHCLayer, x: Tensor, step: DecodeStep) -> tuple[BoundaryState, Tensor]:
        """The model entry: streams = the embedding broadcast to hc; their mixes (from the embedding, with
        hc_attn_fn_broadcast); layer input = RMSNorm(bf16(sum_j pre[j] * e)) with that pre."""
        self._check_step(step)
        ar = self.all_reduce
        checks.tensor("x", x, dtype=torch.bfloat16, shape=(step.rows, ar.hidden_size), device=ar.device)
        values = self._boundaries._layer(layer, FIRST)
        if values[0] is None:
            raise ValueError("layer.hc_attn_fn_broadcast is None: the first layer needs the [24, H] broadcast fn")
        residual = x.unsqueeze(1).expand(-1, ar.hc_mult, -1).contiguous()
        state, layer_input, _ = self._enter(values, FIRST, residual, x, None)
        return state, layer_input

    def pre(
        self, layer: MHCLayer, residual: Tensor, state: BoundaryState, step: DecodeStep
    ) -> tuple[BoundaryState, Tensor]:
        """An Engram layer's attention entry on injected streams (from `post_only`): their mixes, the own-pre
        collapse, the norm."""
        self._check_step(step)
        self._boundaries._check_state(state, step, pending=False)
        ar = self.all_reduce
        checks.tensor(
            "residual", residual, dtype=torch.bfloat16, shape=(step.rows, ar.hc_mult, ar.hidden_size), device=ar.device
        )
        new_state, layer_input, _ = self._enter(self._boundaries._layer(layer, ATTN), ATTN, residual, None, None)
        return new_state, layer_input

    def sublayer(
        self,
        layer: MHCLayer,
        ffn: bool,
        state: BoundaryState,
        step: DecodeStep,
        *,
        quantize: bool | str | None = False,
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | Fp8GroupActivation | None]:
        """A V4 boundary on state.pending (which it consumes): the post with the carried mixes, then the mixes of the
        sublayer it enters (attention, or MoE with `ffn`) from the new streams and the layer input collapsed with
        their own pre. `quantize` as `Boundaries.sublayer`'s."""
        self._check_step(step)
        checks.flag("ffn", ffn)
        if quantize is not False:
            quantize = checks.quantize_form("quantize", quantize, QUANTIZE)
        if quantize and mhc.kernel_arch(self.all_reduce.device, self.backend):
            # Before the reduction consumes state.pending: a refused call consumes nothing.
            mhc.check_quantizable(self.all_reduce.hidden_size)
        self._boundaries._check_state(state, step, pending=True)
        reads = FFN if ffn else ATTN
        values = self._boundaries._layer(layer, reads)
        # The norm before the reduction consumes state.pending, as Boundaries.sublayer's boundary call checks it (the
        # mHC weights were, by _layer: CONTRACT §5 Errors).
        ar = self.all_reduce
        try:
            checks.tensor("norm_weight", values[3], dtype=torch.bfloat16, shape=(ar.hidden_size,), device=ar.device)
            checks.finite_float("norm_eps", values[4], minimum=0.0)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _layer_names(reads), converted_at_load=True)
            raise
        residual = self._boundaries._post(state)  # the state checked against the step above
        return self._enter(values, reads, residual, None, quantize or None)

    def post_only(self, state: BoundaryState) -> Tensor:
        """The residual-only boundary on state.pending (which it consumes): the new streams (before an Engram
        injection)."""
        return self._boundaries.post_only(state)

    def final(self, state: BoundaryState, head: V4Head, norm: Norm | Tensor, eps: float | None = None) -> Tensor:
        """The last boundary on state.pending (which it consumes): R' = the post with the carried mixes, then hc_head
        and the final norm, h = RMSNorm(bf16(sum_i p_i * R'_i)). `head` holds the model's hc_head_* attributes (V4Head);
        `norm` is the final norm, or its weight followed by `eps`. One launch up to 512 x 4096 elements of a stream
        (`own_pre_final`), two beyond; the bits are the same."""
        norm_weight, norm_eps = final_norm(norm, eps)
        if norm_eps is None and isinstance(norm, Tensor):
            raise TypeError("final(state, head, norm_weight, eps): eps is missing after the norm weight")
        try:
            fn, scale, base = head.hc_head_fn, head.hc_head_scale, head.hc_head_base
            rms_eps, hc_eps = head.rms_norm_eps, head.hc_eps
        except AttributeError as exc:
            raise TypeError(
                f"head must have hc_head_fn, hc_head_scale, hc_head_base, rms_norm_eps and hc_eps (V4Head), "
                f"got a {type(head).__name__} without {exc.name}"
            ) from None
        ar = self.all_reduce
        hc, hidden = ar.hc_mult, ar.hidden_size
        checks.tensor("head.hc_head_fn", fn, dtype=torch.float32, shape=(hc, hc * hidden), device=ar.device)
        checks.tensor("head.hc_head_scale", scale, dtype=torch.float32, shape=(1,), device=ar.device)
        checks.tensor("head.hc_head_base", base, dtype=torch.float32, shape=(hc,), device=ar.device)
        rms_eps = checks.finite_float("head.rms_norm_eps", rms_eps, minimum=0.0)
        hc_eps = checks.finite_float("head.hc_eps", hc_eps, minimum=0.0)
        # The final norm too, before the reduction consumes state.pending: a refused call consumes nothing.
        checks.tensor("norm_weight", norm_weight, dtype=torch.bfloat16, shape=(hidden,), device=ar.device)
        norm_eps = checks.finite_float(
            "eps" if isinstance(norm, Tensor) else "norm.variance_epsilon", norm_eps, minimum=0.0
        )
        self._boundaries._check_state(state, None, pending=True)
        if not own_pre_final(state.residual.shape[0], hidden):
            # Many rows: the residual-only boundary, then hc_head's weights, the collapse and the norm in one
            # coefficients call (faster there than every row's CTAs reading fn again in the boundary).
            residual = self._boundaries.post_only(state)
            return self._head_input(residual, fn, scale, base, rms_eps, hc_eps, norm_weight, norm_eps)
        # One boundary that computes hc_head's weights from its own new streams (CONTRACT §4d): the post, the head's
        # weights, the collapse and the final norm in one launch on the kernels.
        try:
            hidden_out = self._boundaries._calls.head_final(
                state, (fn, scale, base, rms_eps, hc_eps), norm_weight, norm_eps
            )
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _state_names(state))
            raise
        state.pending = None
        return hidden_out

    def _enter(
        self, values: tuple[Any, ...], reads: _Reads, residual: Tensor, x: Tensor | None, quantize: str | None
    ) -> tuple[BoundaryState, Tensor, QuantizedActivation | Fp8GroupActivation | None]:
        """The mixes of `residual` (of `x` with the broadcast fn), the layer input collapsed with their pre, and its
        quantized form."""
        fn, scale, base, weight, eps, rms_eps, hc_eps, alpha, iters, _ = values
        params = MHCParams(fn, scale, base, rms_eps, hc_eps, hc_eps, alpha, iters)
        quantized = empty_layer_input_form(
            quantize, residual.shape[0], self.all_reduce.hidden_size, self.all_reduce.device
        )
        try:
            if x is None:
                post, comb, pre, layer_input = self._own_pre(residual, params, weight, eps, quantized)
            else:  # the first layer: the mixes of the embedding, then the collapse of its broadcast streams
                post, comb, pre = self._mixes(residual, params, x)
                layer_input = self._collapse_norm(residual, pre, weight, eps, quantized)
        except (TypeError, ValueError) as exc:
            checks.rename(exc, _layer_names(reads), converted_at_load=True)
            raise
        return BoundaryState(residual, post, comb, pre), layer_input, quantized

    def _check_step(self, step: object) -> None:
        self._boundaries._check_step(step)
        if step.side_stream and self.all_reduce.device.type == "cuda":  # type: ignore[attr-defined]
            raise ValueError(
                "step.side_stream is set, but a V4 boundary's coefficients are on its critical path (its layer input "
                "collapses with the pre it computes): use DecodeStep(rows, side_stream=False)"
            )
