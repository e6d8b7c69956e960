"""How `Boundaries` calls the boundary and the coefficients, chosen once when it is built: directly (Python, with side
streams) or through the custom ops (`torch.ops.mhc_boundary.*`, which torch.compile traces; the coefficients inline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from boundary import mhc, ops
from boundary.all_reduce import BoundaryAllReduce
from boundary.params import MHCParams
from boundary.types import Fp8GroupActivation, MixWeights, QuantizedActivation, UnfinalizedMoEOutput

if TYPE_CHECKING:  # the scheduler imports this module
    from boundary.scheduler import BoundaryState


class DirectCalls:
    """The plain Python path: `BoundaryAllReduce` for the boundary, `boundary.mhc` for the coefficients."""

    side_streams = True

    def __init__(self, all_reduce: BoundaryAllReduce, backend: str, owner: int | None) -> None:
        self.all_reduce, self.backend, self.owner = all_reduce, backend, owner

    def boundary(
        self,
        state: BoundaryState,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8: QuantizedActivation | None,
        fp8: Fp8GroupActivation | None,
        aux: Tensor | None,
        mix: MixWeights | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The fused boundary on the state's pending sublayer output: (new streams, layer input or None when pre is
        None and there is no `mix`, with which it computes its own pre)."""
        ar, pending = self.all_reduce, state.pending
        common = (state.residual, state.post, state.comb, pre, norm_weight, norm_eps, mxfp8)
        if isinstance(pending, Tensor):
            return ar(pending, *common, aux_out=aux, fp8_out=fp8, mix=mix)
        routed = pending.routed
        if isinstance(routed, UnfinalizedMoEOutput):
            return ar.finalize(
                routed.gemm2_permuted,
                routed.expert_weights,
                routed.expanded_idx_to_permuted_idx,
                pending.shared_output,
                *common,
                aux_out=aux,
                fp8_out=fp8,
                mix=mix,
            )
        return ar(routed, *common, shared_output=pending.shared_output, aux_out=aux, fp8_out=fp8, mix=mix)

    def final(self, state: BoundaryState, norm_weight: Tensor, eps: float) -> Tensor:
        """The final boundary: RMSNorm(collapse(R', state.pre)) with the final norm (the new streams are dropped)."""
        _, hidden = self.boundary(state, state.pre, norm_weight, eps, None, None, None)
        return hidden

    def head_final(self, state: BoundaryState, head: tuple, norm_weight: Tensor, eps: float) -> Tensor:
        """DeepSeek-V4's final boundary: the post, hc_head's weights from R' (`head`: fn, scale, base, rms_eps,
        hc_eps), the collapse with them and the final norm, in one boundary that computes its own pre."""
        _, hidden = self.boundary(state, None, norm_weight, eps, None, None, None, mhc.mix_weights(*head))
        return hidden

    def coefficients(
        self,
        residual: Tensor,
        params: MHCParams,
        pre_mix: Tensor | None,
        x: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        layer_input: Tensor | None,
        stream: torch.cuda.Stream | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(post, comb, layer input, next pre), on `stream` where one is given; with `layer_input` given (the
        boundary wrote it) the mixes alone are computed."""
        if stream is not None or layer_input is not None:
            return mhc.pre_delayed_overlap(
                residual,
                params,
                pre_mix,
                x,
                norm_weight,
                norm_eps,
                stream=stream,
                layer_input=layer_input,
                backend=self.backend,
                workspace_owner=self.owner,
            )
        return mhc.pre_delayed(
            residual, params, pre_mix, x, norm_weight, norm_eps, backend=self.backend, workspace_owner=self.owner
        )


class OpCalls(DirectCalls):
    """The same calls through `torch.ops.mhc_boundary`, whose implementations are DirectCalls' own paths."""

    side_streams = False

    def boundary(
        self,
        state: BoundaryState,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8: QuantizedActivation | None,
        fp8: Fp8GroupActivation | None,
        aux: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        source = ops.partial_args(state.pending)
        handle, streams = self.all_reduce.handle, (state.residual, state.post, state.comb)
        if pre is None:
            return torch.ops.mhc_boundary.post_only(handle, *source, *streams), None
        x, gemm2_permuted, *_, shared = source
        if gemm2_permuted is None and shared is None and mxfp8 is None and fp8 is None and aux is None:
            # A ready partial (a tensor, or a MoE output's routed tensor alone) with nothing in place: 8 arguments.
            return torch.ops.mhc_boundary.boundary_ready(handle, x, *streams, pre, norm_weight, norm_eps)
        mx = (None, None) if mxfp8 is None else (mxfp8.data, mxfp8.scale)
        grouped = (None, None, False) if fp8 is None else (fp8.data, fp8.scale, fp8.ue8m0)
        return torch.ops.mhc_boundary.boundary(
            handle, *source, *streams, pre, norm_weight, norm_eps, *mx, *grouped, aux
        )

    def final(self, state: BoundaryState, norm_weight: Tensor, eps: float) -> Tensor:
        source = ops.partial_args(state.pending)
        return torch.ops.mhc_boundary.final(
            self.all_reduce.handle, *source, state.residual, state.post, state.comb, state.pre, norm_weight, eps
        )

    def head_final(self, state: BoundaryState, head: tuple, norm_weight: Tensor, eps: float) -> Tensor:
        source = ops.partial_args(state.pending)
        streams = (state.residual, state.post, state.comb)
        return torch.ops.mhc_boundary.hc_head_final(self.all_reduce.handle, *source, *streams, *head, norm_weight, eps)

    def coefficients(
        self,
        residual: Tensor,
        params: MHCParams,
        pre_mix: Tensor | None,
        x: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        layer_input: Tensor | None,
        stream: torch.cuda.Stream | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if layer_input is None:
            return torch.ops.mhc_boundary.mhc_pre_delayed(
                residual, *params, pre_mix, x, norm_weight, norm_eps, self.backend, self.owner
            )
        post, comb, pre = torch.ops.mhc_boundary.mhc_mixes(residual, *params, x, self.backend, self.owner)
        return post, comb, layer_input, pre
