"""The fused boundary's call path: variants, compile (cached per key), warmup, and the thin launch.

The public entry points (boundary.BoundaryAllReduce, boundary.mhc_post) check every argument once;
nothing here checks again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8

from cute_kernels.boundary.config import HC, BoundaryConfig, default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import WarmupJob, compile_kernel, fake_stream, fake_tensor, jit_cache

Y_SOURCES = ("x", "moe")


class BoundaryVariant(NamedTuple):
    """The compile-time flags of one fused-boundary kernel."""

    y_source: str = "x"  # "x": a ready partial; "moe": the top-k combine of gemm2_permuted
    shared: bool = False  # an addend: bf16(x + shared), or the MoE shared_output
    pre: bool = True  # collapse + RMSNorm; False: residual-only
    mxfp8: bool = False
    aux: bool = False


ENGINE_VARIANTS: tuple[BoundaryVariant, ...] = tuple(
    BoundaryVariant(y_source, shared, pre, mxfp8, aux)
    for y_source in Y_SOURCES
    for shared in (False, True)
    for pre, mxfp8 in ((False, False), (True, False), (True, True))
    for aux in (False, True)
)


@jit_cache
def compile_fused_boundary(
    H: int, y_source: str, shared: bool, pre: bool, mxfp8: bool, aux: bool, config: BoundaryConfig, *, arch: str
) -> Callable[..., Any]:
    """Compile one fused-boundary variant with its launch shape; T (and P, top-k) stay dynamic.

    The compiled function takes, positionally, (residual, post, comb, pre, norm_weight, x,
    shared, gemm2_permuted, expert_weights, idx, new_residual, out, mxfp8_data, mxfp8_scale,
    aux, norm_eps), with None for every tensor the variant does not use.
    """
    kernel = FusedBoundaryKernel(H, config, y_source=y_source, shared=shared, pre=pre, mxfp8=mxfp8, aux=aux)
    T, top_k = cute.sym_int(), cute.sym_int()
    bf16 = lambda shape: fake_tensor(BFloat16, shape, divisibility=8)  # noqa: E731
    f32 = lambda shape: fake_tensor(Float32, shape, divisibility=1)  # noqa: E731
    moe = y_source == "moe"
    args = (
        bf16((T, HC, H)),  # residual
        f32((T, HC)),  # post
        f32((T, HC, HC)),  # comb
        f32((T, HC)) if pre else None,  # pre
        bf16((H,)) if pre else None,  # norm weight
        bf16((T, H)) if not moe else None,  # x
        bf16((T, H)) if shared else None,  # shared addend / shared_output
        bf16((cute.sym_int(), H)) if moe else None,  # gemm2_permuted
        f32((T, top_k)) if moe else None,  # expert weights
        fake_tensor(Int32, (T, top_k), divisibility=1) if moe else None,  # permuted row per expert
        bf16((T, HC, H)),  # new residual
        bf16((T, H)) if pre else None,  # out
        fake_tensor(Float8E4M3FN, (T, H), divisibility=16) if mxfp8 else None,
        fake_tensor(Uint8, (cute.sym_int(),), divisibility=4) if mxfp8 else None,
        bf16((T, H)) if aux else None,
        Float32(0.0),  # norm eps
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


def compiled_boundary(H: int, variant: BoundaryVariant, *, arch: str) -> Callable[..., Any]:
    """The compiled kernel of one variant at the shipped launch shape (compiled or loaded on first use)."""
    return compile_fused_boundary(H, *variant, default_config(H, arch), arch=arch)


def variant_name(v: BoundaryVariant) -> str:
    """A short readable name of a variant, e.g. "moe+shared pre mxfp8 aux"."""
    parts = [v.y_source + ("+shared" if v.shared else "")]
    parts.append("pre" if v.pre else "residual-only")
    parts += [flag for flag, on in (("mxfp8", v.mxfp8), ("aux", v.aux)) if on]
    return " ".join(parts)


def warmup_jobs(H: int, *, arch: str, variants: Sequence[BoundaryVariant] = ENGINE_VARIANTS) -> list[WarmupJob]:
    """One warmup job per variant an engine may launch at hidden size H (all of them by default)."""
    config = default_config(H, arch)
    return [
        WarmupJob(
            name=f"boundary H={H} {variant_name(v)}",
            compile_fn=compile_fused_boundary,
            args=(H, *v, config),
            kwargs=(("arch", arch),),
        )
        for v in variants
    ]


def fused_boundary(
    *,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    x: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    new_residual: torch.Tensor,
    out: torch.Tensor | None = None,
    mxfp8_data: torch.Tensor | None = None,
    mxfp8_scale: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    arch: str,
) -> None:
    """Run the fused boundary of one rank on checked arguments, writing new_residual (and out, MXFP8, aux).

    y is `x` (plus `shared`), or with `moe=(gemm2_permuted, expert_weights, idx)` the MoE top-k
    combine (plus `shared`, the shared-expert output). pre=None is the residual-only boundary.
    `post` may be [T, 4] or [T, 4, 1].
    """
    rows, _, H = residual.shape
    if rows == 0:
        return
    variant = BoundaryVariant(
        "x" if moe is None else "moe", shared is not None, pre is not None, mxfp8_data is not None, aux is not None
    )
    g, ew, idx = moe if moe is not None else (None, None, None)
    compiled_boundary(H, variant, arch=arch)(
        residual, post.view(rows, HC), comb, pre, norm_weight if pre is not None else None, x, shared, g, ew, idx,
        new_residual, out, mxfp8_data, mxfp8_scale, aux, float(norm_eps),
    )  # fmt: skip
