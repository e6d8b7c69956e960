"""BoundaryAllReduce: owns the TP group, the workspace and the kernels; picks the path once."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from boundary import checks, mhc, reference
from boundary.types import QuantizedActivation
from boundary.workspace import Workspace
from cute_kernels.boundary import api as boundary_api
from cute_kernels.compile import arch_for_device, warmup

log = logging.getLogger("boundary")

BF16 = torch.bfloat16
F32 = torch.float32
BACKENDS = ("auto", "kernel", "reference")


class BoundaryAllReduce:
    """The fused boundary of one TP rank: all-reduce, mHC post, delayed collapse, RMSNorm, MXFP8.

    Paths, chosen once here and logged:
    - "kernel" (W = 1 on sm_90a / sm_100a): the fused CuTe DSL kernel, one launch per boundary.
    - "gather+kernel" (W > 1 on such GPUs): the partials all-gathered through torch.distributed
      and summed in rank order, then the fused kernel on the sum.
    - "reference": the same gather and sum, then the torch epilogue (the CPU path and the oracle).
    `backend="auto"` takes the kernels on a supported GPU and the reference on the CPU; on any
    other GPU it raises, naming the GPU, and `backend="reference"` is the way out.
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
        self.arch: str | None = None
        if backend == "reference" or (backend == "auto" and self.device.type != "cuda"):
            self.path = "reference"
        else:
            if self.device.type != "cuda":
                raise ValueError(f"backend='kernel' needs a CUDA device, got {self.device}")
            self.arch = arch_for_device(self.device)  # raises on GPUs without the kernels
            self.path = "kernel" if self.world_size == 1 else "gather+kernel"
        self.workspace = Workspace(hidden_size, max_rows, self.device)
        how = {
            "kernel": f"the fused CuTe DSL kernel ({self.arch}), one launch per boundary",
            "gather+kernel": f"all-gather through torch.distributed, rank-order sum, then the fused kernel ({self.arch})",
            "reference": "all-gather through torch.distributed, rank-order sum, torch epilogue",
        }[self.path]
        log.info("BoundaryAllReduce rank %d/%d on %s, H=%d: %s path: %s",
                 self.rank, self.world_size, self.device, hidden_size, self.path, how)  # fmt: skip

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
        a16 = self.arch is not None
        checks.tensor("x", x, dtype=BF16, shape=(rows, self.hidden_size), device=self.device, align16=a16)
        checks.optional_tensor("shared_output", shared_output, dtype=BF16, shape=(rows, self.hidden_size),
                               device=self.device, align16=a16)  # fmt: skip
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out)
        if self.path == "kernel":
            return self._kernel(residual, *args, x=x, shared=shared_output)
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
        dev, hidden, a16 = self.device, self.hidden_size, self.arch is not None
        checks.tensor("gemm2_permuted", gemm2_permuted, dtype=BF16, shape=(None, hidden), device=dev, align16=a16)
        checks.tensor("expert_weights", expert_weights, dtype=F32, shape=(rows, None), device=dev)
        top_k = expert_weights.shape[1]
        checks.tensor("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx, dtype=torch.int32,
                      shape=(rows, top_k), device=dev)  # fmt: skip
        checks.optional_tensor("shared_output", shared_output, dtype=BF16, shape=(rows, hidden), device=dev,
                               align16=a16)  # fmt: skip
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out)
        if self.path == "kernel":
            moe = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx)
            return self._kernel(residual, *args, moe=moe, shared=shared_output)
        partial = reference.moe_finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
        y = self._reduce(partial)
        return self._epilogue(y, residual, *args)

    def warmup(self, max_rows: int | None = None, *, progress: bool = True) -> None:
        """Compile every kernel variant this boundary (and the scheduler's mHC ops) will launch.

        Call it before CUDA-graph capture: nothing can compile or allocate a workspace inside a
        capture. Compiled kernels are cached on disk, so later processes only load them.
        """
        rows = self.max_rows if max_rows is None else max_rows
        self._check_rows(rows)
        if self.arch is None:
            log.info("BoundaryAllReduce.warmup: the %s path has nothing to compile", self.path)
            return
        jobs = boundary_api.warmup_jobs(self.hidden_size, arch=self.arch) + mhc.warmup_jobs(
            self.hidden_size, self.arch, rows
        )
        warmup(jobs, progress=progress, desc=f"mHC kernels H={self.hidden_size} {self.arch}")
        mhc.prepare_workspace(self.hidden_size, rows, self.device)

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
        residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, self.hc_mult, self.hidden_size),
                                 device=self.device, align16=self.arch is not None)  # fmt: skip
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
        dev, hidden, a16 = self.device, self.hidden_size, self.arch is not None
        post, comb, pre = checks.coefficients(rows, self.hc_mult, dev, post, comb, pre)
        if pre is None:
            if norm_weight is not None or mxfp8_out is not None:
                raise ValueError("the residual-only boundary (pre=None) takes no norm_weight and no mxfp8_out")
        else:
            checks.tensor("norm_weight", norm_weight, dtype=BF16, shape=(hidden,), device=dev, align16=a16)
        norm_eps = checks.finite_float("norm_eps", norm_eps, minimum=0.0)
        if mxfp8_out is not None:
            if not isinstance(mxfp8_out, QuantizedActivation):
                raise TypeError(f"mxfp8_out must be a QuantizedActivation or None, got {type(mxfp8_out).__name__}")
            checks.tensor("mxfp8_out.data", mxfp8_out.data, dtype=torch.float8_e4m3fn, shape=(rows, hidden),
                          device=dev, align16=a16)  # fmt: skip
            nbytes = reference.mxfp8_scale_bytes(rows, hidden)
            checks.tensor("mxfp8_out.scale", mxfp8_out.scale, dtype=torch.uint8, shape=(nbytes,), device=dev)
        checks.optional_tensor("aux_out", aux_out, dtype=BF16, shape=(rows, hidden), device=dev, align16=a16)
        return post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out  # type: ignore[return-value]

    def _kernel(
        self,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        aux_out: Tensor | None,
        *,
        x: Tensor | None = None,
        moe: tuple[Tensor, Tensor, Tensor] | None = None,
        shared: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The one-rank fused kernel; the arguments were checked by the caller."""
        new_residual = torch.empty_like(residual)
        out = None if pre is None else torch.empty(residual.shape[0], self.hidden_size, dtype=BF16, device=self.device)
        boundary_api.fused_boundary(
            residual=residual, post=post, comb=comb, pre=pre, norm_weight=norm_weight, norm_eps=norm_eps, x=x,
            shared=shared, moe=moe, new_residual=new_residual, out=out,
            mxfp8_data=None if mxfp8_out is None else mxfp8_out.data,
            mxfp8_scale=None if mxfp8_out is None else mxfp8_out.scale, aux=aux_out, arch=self.arch,
        )  # fmt: skip
        return new_residual, out

    def _reduce(self, x: Tensor) -> Tensor:
        """y = the rank-order fp32 sum of every rank's partial, rounded once to bf16."""
        if self.world_size == 1:
            return x
        # Gathered as int32 words (bf16 pairs) so that the bits travel untouched whatever the backend does with bf16.
        parts = [
            torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.int32, device=x.device) for _ in range(self.world_size)
        ]
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
        if self.path == "gather+kernel":
            return self._kernel(residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out, x=y)
        result = reference.boundary(
            y, residual, post, comb, pre, norm_weight, norm_eps, mxfp8=mxfp8_out is not None, aux=aux_out is not None
        )
        if mxfp8_out is not None:
            mxfp8_out.data.copy_(result.mxfp8[0])
            mxfp8_out.scale.copy_(result.mxfp8[1])
        if aux_out is not None:
            aux_out.copy_(result.aux)
        return result.residual, result.layer_input
