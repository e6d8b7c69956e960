"""The public mHC ops (coefficients, post) with their input checks and their dispatch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from boundary import checks, reference
from boundary.reference import MIX_WIDTH

BF16 = torch.bfloat16
F32 = torch.float32


def _check_pre_delayed_args(
    residual: object,
    fn: object,
    hc_scale: object,
    hc_base: object,
    rms_eps: object,
    hc_pre_eps: object,
    hc_sinkhorn_eps: object,
    hc_post_mult_value: object,
    sinkhorn_repeat: object,
    pre_mix: object,
    x: object,
    norm_weight: object,
    norm_eps: object,
) -> None:
    residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    dev = residual.device
    x = checks.optional_tensor("x", x, dtype=BF16, shape=(rows, hidden), device=dev)
    width = hidden if x is not None else hc * hidden
    checks.tensor("fn", fn, dtype=F32, shape=(MIX_WIDTH if hc == 4 else hc * (hc + 2), width), device=dev)
    checks.tensor("hc_scale", hc_scale, dtype=F32, shape=(3,), device=dev)
    checks.tensor("hc_base", hc_base, dtype=F32, shape=(hc * (hc + 2),), device=dev)
    checks.optional_tensor("pre_mix", pre_mix, dtype=F32, shape=(rows, hc), device=dev)
    checks.optional_tensor("norm_weight", norm_weight, dtype=BF16, shape=(hidden,), device=dev)
    checks.finite_float("rms_eps", rms_eps, minimum=0.0)
    checks.finite_float("hc_pre_eps", hc_pre_eps, minimum=0.0)
    checks.finite_float("hc_sinkhorn_eps", hc_sinkhorn_eps, minimum=0.0)
    checks.finite_float("hc_post_mult_value", hc_post_mult_value)
    checks.positive_int("sinkhorn_repeat", sinkhorn_repeat)
    checks.finite_float("norm_eps", norm_eps, minimum=0.0)


def mhc_pre_delayed(
    residual: Tensor,
    fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    pre_mix: Tensor | None = None,
    x: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, layer_input, next_pre) of SPEC §3: the mixes of the streams and the delayed collapse."""
    _check_pre_delayed_args(
        residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
        hc_post_mult_value, sinkhorn_repeat, pre_mix, x, norm_weight, norm_eps,
    )  # fmt: skip
    return reference.mhc_pre_delayed(
        residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
        hc_post_mult_value, sinkhorn_repeat, pre_mix, x, norm_weight, norm_eps,
    )  # fmt: skip


def delayed_layer_input(residual: Tensor, pre_mix: Tensor | None, norm_weight: Tensor | None, norm_eps: float) -> Tensor:
    """The delayed collapse alone: RMSNorm(collapse(streams, carried pre)), or stream 0 without a pre."""
    c = residual[:, 0].clone() if pre_mix is None else reference.collapse(residual, pre_mix)
    return c if norm_weight is None else reference.rms_norm(c, norm_weight, norm_eps)


def mhc_pre_delayed_overlap(
    residual: Tensor,
    fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    pre_mix: Tensor | None = None,
    x: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    *,
    stream: Any,
    layer_input: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mhc_pre_delayed split in two: the layer input on the current stream, the mixes on `stream`.

    `stream` waits for the current stream first; the streams (and `x`) are recorded on it. The
    caller keeps the weights alive and makes the current stream wait for `stream` before it
    reads post, comb or next_pre. With `layer_input` given, only the mixes run. `stream` None
    (the CPU) runs everything on the current stream.
    """
    _check_pre_delayed_args(
        residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
        hc_post_mult_value, sinkhorn_repeat, pre_mix, x, norm_weight, norm_eps,
    )  # fmt: skip
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if stream is not None and residual.device.type != "cuda":
        raise ValueError(f"stream is a CUDA stream but residual is on {residual.device}")
    if layer_input is None:
        layer_input = delayed_layer_input(residual, pre_mix, norm_weight, norm_eps)
    else:
        checks.tensor("layer_input", layer_input, dtype=BF16, shape=(residual.shape[0], residual.shape[2]),
                      device=residual.device)  # fmt: skip
    source = x if x is not None else residual.reshape(residual.shape[0], -1)
    if stream is None:
        coeffs = _coefficients(source, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                               hc_post_mult_value, sinkhorn_repeat)  # fmt: skip
        return coeffs.post, coeffs.comb, layer_input, coeffs.pre
    stream.wait_stream(torch.cuda.current_stream(residual.device))
    with torch.cuda.stream(stream):
        coeffs = _coefficients(source, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                               hc_post_mult_value, sinkhorn_repeat)  # fmt: skip
    source.record_stream(stream)
    return coeffs.post, coeffs.comb, layer_input, coeffs.pre


def _coefficients(
    source: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, pre_eps: float,
    sinkhorn_eps: float, post_mult: float, repeat: int,
) -> reference.Coefficients:  # fmt: skip
    """The coefficients of one projection input, on the current stream."""
    return reference.mhc_coefficients(source, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat)


def mhc_post(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The new streams R'[j] = bf16(post[j]*x + sum_k comb[k, j]*R[k]) from a reduced sublayer output."""
    residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    checks.tensor("x", x, dtype=BF16, shape=(rows, hidden), device=residual.device)
    post, comb, _ = checks.coefficients(rows, hc, residual.device, post, comb, None)
    return reference.mhc_post(x, residual, post, comb)
