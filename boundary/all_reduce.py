"""BoundaryAllReduce: owns the TP group, the workspace and the kernels; picks the path once."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from boundary import checks, reference
from boundary.types import QuantizedActivation
from boundary.workspace import Workspace

log = logging.getLogger("boundary")

BF16 = torch.bfloat16
F32 = torch.float32
BACKENDS = ("auto", "reference")


class BoundaryAllReduce:
    """The fused boundary of one TP rank: all-reduce, mHC post, delayed collapse, RMSNorm, MXFP8.

    `backend="reference"` all-gathers the partials through torch.distributed and sums them in
    rank order, then runs the torch epilogue (the CPU path and the oracle). `"auto"` picks the
    fastest path this machine has, once, here, and logs the choice.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        group: Any = None,
        max_rows: int = 512,
        hc_mult: int = 4,
        device: Any = None,
        backend: str = "auto",
    ) -> None:
        checks.positive_int("hidden_size", hidden_size)
        if hidden_size % 256:
            raise ValueError(f"hidden_size must be a multiple of 256, got {hidden_size}")
        checks.positive_int("max_rows", max_rows)
        if hc_mult != 4:
            raise ValueError(f"hc_mult must be 4 (the mHC models this boundary serves), got {hc_mult!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if group is not None and not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised")
        self.hidden_size = hidden_size
        self.max_rows = max_rows
        self.hc_mult = hc_mult
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.path = "reference"
        self.workspace = Workspace(hidden_size, max_rows, self.device)
        log.info(
            "BoundaryAllReduce rank %d/%d on %s, H=%d: %s path (all-gather through torch.distributed, "
            "rank-order sum, torch epilogue)",
            self.rank, self.world_size, self.device, hidden_size, self.path,
        )  # fmt: skip

    def mailbox(self, rows: int) -> Tensor:
        """The [rows, H] bf16 view of this rank's buffer that a GEMM may write its partial into."""
        self._check_rows(rows)
        return self.workspace.mailbox[:rows]

    def __call__(
        self,
        x: Tensor,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        *,
        shared_output: Tensor | None = None,
        aux_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The boundary on a bf16 partial `x`: (new residual, layer input or None when pre is None).

        With `shared_output` the rank's partial is bf16(x + shared_output) (a combined MoE output).
        """
        residual = self._check_residual(residual)
        rows = residual.shape[0]
        checks.tensor("x", x, dtype=BF16, shape=(rows, self.hidden_size), device=self.device)
        checks.optional_tensor("shared_output", shared_output, dtype=BF16, shape=(rows, self.hidden_size),
                               device=self.device)  # fmt: skip
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out)
        y = self._reduce(reference.add_shared(x, shared_output))
        return self._epilogue(y, residual, *args)

    def finalize(
        self,
        gemm2_permuted: Tensor,
        expert_weights: Tensor,
        expanded_idx_to_permuted_idx: Tensor,
        shared_output: Tensor | None,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        *,
        aux_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The boundary on an unfinalized MoE output: the top-k combine + shared add, then as __call__."""
        residual = self._check_residual(residual)
        rows = residual.shape[0]
        dev, hidden = self.device, self.hidden_size
        checks.tensor("gemm2_permuted", gemm2_permuted, dtype=BF16, shape=(None, hidden), device=dev)
        checks.tensor("expert_weights", expert_weights, dtype=F32, shape=(rows, None), device=dev)
        top_k = expert_weights.shape[1]
        checks.tensor("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx, dtype=torch.int32,
                      shape=(rows, top_k), device=dev)  # fmt: skip
        checks.optional_tensor("shared_output", shared_output, dtype=BF16, shape=(rows, hidden), device=dev)
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out)
        partial = reference.moe_finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
        y = self._reduce(partial)
        return self._epilogue(y, residual, *args)

    def warmup(self, max_rows: int | None = None) -> None:
        """Compile every kernel variant this boundary will launch, before CUDA-graph capture."""
        if max_rows is not None:
            self._check_rows(max_rows)
        log.info("BoundaryAllReduce.warmup: the %s path has nothing to compile", self.path)

    def check(self) -> None:
        """Raise if a kernel of this rank gave up waiting for a peer (reads a device word: syncs)."""
        word = int(self.workspace.error.item())
        if word:
            raise RuntimeError(f"rank {self.rank}: the boundary gave up waiting for rank {word - 1}")

    def _check_rows(self, rows: int) -> None:
        checks.positive_int("rows", rows)
        if rows > self.max_rows:
            raise ValueError(f"rows ({rows}) exceed this boundary's capacity max_rows={self.max_rows}")

    def _check_residual(self, residual: object) -> Tensor:
        residual = checks.tensor(
            "residual", residual, dtype=BF16, shape=(None, self.hc_mult, self.hidden_size), device=self.device
        )
        self._check_rows(residual.shape[0])
        return residual

    def _check_epilogue(
        self,
        rows: int,
        post: object,
        comb: object,
        pre: object,
        norm_weight: object,
        norm_eps: object,
        mxfp8_out: object,
        aux_out: object,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, float, QuantizedActivation | None, Tensor | None]:
        dev, hidden = self.device, self.hidden_size
        post, comb, pre = checks.coefficients(rows, self.hc_mult, dev, post, comb, pre)
        if pre is None:
            if norm_weight is not None or mxfp8_out is not None:
                raise ValueError("the residual-only boundary (pre=None) takes no norm_weight and no mxfp8_out")
        else:
            checks.tensor("norm_weight", norm_weight, dtype=BF16, shape=(hidden,), device=dev)
        norm_eps = checks.finite_float("norm_eps", norm_eps, minimum=0.0)
        if mxfp8_out is not None:
            if not isinstance(mxfp8_out, QuantizedActivation):
                raise TypeError(f"mxfp8_out must be a QuantizedActivation or None, got {type(mxfp8_out).__name__}")
            checks.tensor("mxfp8_out.data", mxfp8_out.data, dtype=torch.float8_e4m3fn, shape=(rows, hidden), device=dev)
            nbytes = reference.mxfp8_scale_bytes(rows, hidden)
            checks.tensor("mxfp8_out.scale", mxfp8_out.scale, dtype=torch.uint8, shape=(nbytes,), device=dev)
        checks.optional_tensor("aux_out", aux_out, dtype=BF16, shape=(rows, hidden), device=dev)
        return post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out  # type: ignore[return-value]

    def _reduce(self, x: Tensor) -> Tensor:
        """y = the rank-order fp32 sum of every rank's partial, rounded once to bf16."""
        if self.world_size == 1:
            return x
        # Gathered as int32 words (bf16 pairs) so that the bits travel untouched whatever the backend does with bf16.
        parts = [torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.int32, device=x.device) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous().view(torch.int32), group=self.group)
        return reference.rank_sum([p.view(BF16) for p in parts])

    def _epilogue(
        self,
        y: Tensor,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        aux_out: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        result = reference.boundary(
            y, residual, post, comb, pre, norm_weight, norm_eps, mxfp8=mxfp8_out is not None, aux=aux_out is not None
        )
        if mxfp8_out is not None:
            mxfp8_out.data.copy_(result.mxfp8[0])
            mxfp8_out.scale.copy_(result.mxfp8[1])
        if aux_out is not None:
            aux_out.copy_(result.aux)
        return result.residual, result.layer_input
