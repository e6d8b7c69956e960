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


def ulp_bf16(x: Tensor) -> Tensor:
    """The bf16 spacing at |x| (float64), subnormals included: 2^(floor(log2|x|) - 7), at least 2^-133."""
    a = x.to(torch.float64).abs()
    _, e = torch.frexp(a)
    spacing = torch.ldexp(torch.ones_like(a), (e - 8).clamp(min=-133))
    return torch.where(a == 0, torch.full_like(a, 2.0**-133), spacing)


def within_contract(got: Tensor, exact: Tensor, terms: Tensor) -> Tensor:
    """CONTRACT §2's comparison, elementwise: |got - exact| <= ulp_bf16(exact) + 2^-21 * terms, where `exact`
    is the float64 value of the step and `terms` the sum of its products' magnitudes (fp32 reassociation
    moves a result by at most 2^-21 of that at these sizes). NaN matches NaN; Inf matches the same Inf."""
    got64, exact = got.to(torch.float64), exact.to(torch.float64)
    ok = (got64 - exact).abs() <= ulp_bf16(exact) + 2.0**-21 * terms.to(torch.float64)
    ok = ok & exact.isfinite()  # an infinite bound (inf terms) would pass any finite `got`
    ok = ok | (got64.isnan() & exact.isnan()) | (got64.isinf() & (got64 == exact))
    return ok


def exported(fn: object) -> bool:
    """Whether a compile returned its kernel exported through TVM-FFI, the entry the call path launches (a compile
    that fails raises before): a TVM-FFI function (the package's cache) or the DSL's TVM-FFI callable (a kernel an
    experiment compiles directly), not a plain JIT function."""
    import tvm_ffi
    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase

    return isinstance(fn, (tvm_ffi.Function, TVMFFIJitCompiledFunctionBase))
