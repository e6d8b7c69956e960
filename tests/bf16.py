"""Helpers that compare bf16 tensors by their bit patterns."""

from __future__ import annotations

import torch
from torch import Tensor


def ordered(x: Tensor) -> Tensor:
    """bf16 bit patterns mapped to integers that order like the values (-0.0 and +0.0 both 0)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """How many bf16 steps lie between a and b, elementwise (NaN against NaN counts as 0)."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    d = (ordered(a) - ordered(b)).abs()
    both_nan = a.isnan() & b.isnan()
    one_nan = a.isnan() ^ b.isnan()
    d = torch.where(both_nan, torch.zeros_like(d), d)
    return torch.where(one_nan, torch.full_like(d, 1 << 30), d)


def max_ulp(a: Tensor, b: Tensor) -> int:
    """The largest bf16 step distance between a and b."""
    return int(ulp_distance(a, b).max()) if a.numel() else 0


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the very same bits."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )
