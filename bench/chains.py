"""The unfused baselines the kernels are measured against: the reference chains, eager and compiled."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from boundary import reference


def boundary_chain(
    y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, pre: Tensor, w: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The W = 1 boundary as torch ops: mHC post, collapse, RMSNorm."""
    new = reference.mhc_post(y, residual, post, comb)
    return new, reference.rms_norm(reference.collapse(new, pre), w, eps)


def coefficients_chain(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> reference.Coefficients:
    """The mHC coefficients as torch ops (V4.1 constants)."""
    return reference.mhc_coefficients(streams.flatten(1), fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)


def v4_chain(
    y: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    w: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A DeepSeek-V4 boundary as torch ops (CONTRACT §4d, V4 constants): post, the mixes of R', the own-pre collapse
    and RMSNorm: (R', post, comb, pre, layer input)."""
    from boundary.params import MHCParams

    params = MHCParams(fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    return tuple(reference.v4_boundary(y, residual, post, comb, params, w, eps))  # type: ignore[return-value]


def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile with dynamic shapes, so one compile serves every row count and H."""
    return torch.compile(fn, dynamic=True)
