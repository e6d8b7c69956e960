"""Cheap host-side input checks that raise a clear TypeError or ValueError before any work."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Dim = int | None  # None: any size


def _shape_ok(actual: torch.Size, shape: Sequence[Dim]) -> bool:
    if len(actual) != len(shape):
        return False
    for want, got in zip(shape, actual):
        if want is not None and want != got:
            return False
    return True


def _on(value: Tensor, device: torch.device) -> bool:
    if device.type == "cuda":
        return value.is_cuda and value.get_device() == device.index
    return value.device == device


def tensor(
    name: str,
    value: object,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    shape: Sequence[Dim] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
    align16: bool = False,
) -> Tensor:
    """Check one tensor argument and return it; the message names the argument and the expectation."""
    # The common case in one pass of cheap attribute reads: boundaries run ~100 times per step.
    if (
        isinstance(value, Tensor)
        and (dtype is None or value.dtype is dtype or (isinstance(dtype, tuple) and value.dtype in dtype))
        and (shape is None or _shape_ok(value.shape, shape))
        and (device is None or _on(value, device))
        and (not contiguous or value.is_contiguous())
        and (not align16 or value.data_ptr() % 16 == 0)
    ):
        return value
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if value.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {value.dtype}")
    if shape is not None and not _shape_ok(value.shape, shape):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if align16 and value.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (got address {value.data_ptr():#x})")
    return value


def optional_tensor(name: str, value: object, **kwargs: object) -> Tensor | None:
    """Like `tensor`, for an argument that may be None."""
    return None if value is None else tensor(name, value, **kwargs)  # type: ignore[arg-type]


def coefficients(
    rows: int, hc: int, device: torch.device, post: object, comb: object, pre: object | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Check post [T, hc] (or [T, hc, 1]), comb [T, hc, hc] and pre [T, hc], all fp32."""
    if isinstance(post, Tensor) and post.dim() == 3:
        tensor("post", post, dtype=torch.float32, shape=(rows, hc, 1), device=device)
        post = post.reshape(rows, hc)
    post = tensor("post", post, dtype=torch.float32, shape=(rows, hc), device=device)
    comb = tensor("comb", comb, dtype=torch.float32, shape=(rows, hc, hc), device=device)
    pre = optional_tensor("pre", pre, dtype=torch.float32, shape=(rows, hc), device=device)
    return post, comb, pre


def positive_int(name: str, value: object) -> int:
    """Check a positive int argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def finite_float(name: str, value: object, *, minimum: float | None = None) -> float:
    """Check a real-number argument (int or float), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def pre_delayed_args(
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
    """The arguments of mhc_pre_delayed and mhc_pre_delayed_overlap (CONTRACT §3): dtypes, shapes, devices, scalars."""
    residual = tensor("residual", residual, dtype=torch.bfloat16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    dev = residual.device
    x = optional_tensor("x", x, dtype=torch.bfloat16, shape=(rows, hidden), device=dev)
    width = hidden if x is not None else hc * hidden
    tensor("fn", fn, dtype=torch.float32, shape=(hc * (hc + 2), width), device=dev)
    tensor("hc_scale", hc_scale, dtype=torch.float32, shape=(3,), device=dev)
    tensor("hc_base", hc_base, dtype=torch.float32, shape=(hc * (hc + 2),), device=dev)
    optional_tensor("pre_mix", pre_mix, dtype=torch.float32, shape=(rows, hc), device=dev)
    optional_tensor("norm_weight", norm_weight, dtype=torch.bfloat16, shape=(hidden,), device=dev)
    finite_float("rms_eps", rms_eps, minimum=0.0)
    finite_float("hc_pre_eps", hc_pre_eps, minimum=0.0)
    finite_float("hc_sinkhorn_eps", hc_sinkhorn_eps, minimum=0.0)
    finite_float("hc_post_mult_value", hc_post_mult_value)
    positive_int("sinkhorn_repeat", sinkhorn_repeat)
    finite_float("norm_eps", norm_eps, minimum=0.0)
