"""The boundary's torch.library ops (`torch.ops.mhc_boundary.*`, CONTRACT §5) with their fake implementations.

Each op's real implementation is the direct Python path (`BoundaryAllReduce`, `boundary.mhc`), so it checks its
inputs and runs the fused kernels where they run. A boundary op names its rank's `BoundaryAllReduce` (the workspace,
the peer table, the error word) by `all_reduce.handle`, an int; those buffers are the op's hidden state, as a
communicator is an all-reduce op's. `torch.compile` traces the fake implementations and calls the ops as opaque
nodes. Annotations stay unpostponed here: `torch.library.infer_schema` reads them to build the schema.
"""

import inspect
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from boundary import checks, mhc
from boundary.all_reduce import from_handle
from boundary.params import MHCParams
from boundary.types import (
    FP8_GROUP_QUANT_KEY,
    FP8_GROUP_UE8M0_QUANT_KEY,
    MXFP8_QUANT_KEY,
    Fp8GroupActivation,
    MixWeights,
    MoEOutput,
    QuantizedActivation,
)

BF16 = torch.bfloat16
F32 = torch.float32

# The outputs written in place take no default in the schemas: torch's boxed call drops trailing arguments equal to
# their defaults, and torch 2.11's in-place bookkeeping then indexes past the arguments it got.
BOUNDARY_MUTATES = ("mxfp8_data", "mxfp8_scale", "fp8_data", "fp8_scale", "aux_out")
# Plain torch.library registration, not torch.library.custom_op, which wraps every call in Python (an autograd
# wrapper, an aliasing check) at several times a plain op's host cost (docs/PERF.md decisions: boundary.ops._op).
_LIB = torch.library.Library("mhc_boundary", "DEF")


def _op(fake: Callable[..., object], mutates_args: tuple[str, ...] = ()):
    """Define mhc_boundary::<the function's name> with the schema its annotations give (as custom_op infers it), make
    the function its implementation on every device, and `fake` its fake implementation: a shape rule that takes the
    op's arguments by name and reads only those it needs (the outputs follow from `residual` alone)."""

    def register(fn):
        _LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        names = tuple(inspect.signature(fn).parameters)

        def fake_impl(*args: object, **kwargs: object) -> object:
            bound = dict(zip(names, args), **kwargs)
            _refuse_meta_among_real(bound)
            return fake(**bound)

        torch.library.register_fake(f"mhc_boundary::{fn.__name__}", fake_impl, lib=_LIB)
        return fn

    return register


def _refuse_meta_among_real(args: dict[str, object]) -> None:
    """The fake implementation is also the op's Meta kernel, which the dispatcher runs eagerly when any argument is on
    the meta device: among real tensors (a weight a loader left on "meta") it would return uninitialised real tensors
    and consume the call. Refused as the direct path refuses a tensor on another device, naming the argument."""
    meta = real = None
    for name, value in args.items():
        if isinstance(value, Tensor) and not isinstance(value, FakeTensor):
            if value.is_meta:
                meta = name if meta is None else meta
            elif real is None:
                real = value
    if meta is not None and real is not None:
        raise checks._error(ValueError, meta, f"must be on {real.device}, got meta")


# The shape rules of the fake implementations: every output's shape follows from the streams [T, hc, H].
def _new_streams(residual: Tensor, **_: object) -> Tensor:
    return torch.empty_like(residual)


def _layer_input(residual: Tensor, **_: object) -> Tensor:
    return residual.new_empty(residual.shape[0], residual.shape[2])


def _mixes(residual: Tensor, **_: object) -> tuple[Tensor, Tensor, Tensor]:
    rows, hc, _ = residual.shape
    return (
        residual.new_empty(rows, hc, dtype=F32),
        residual.new_empty(rows, hc, hc, dtype=F32),
        residual.new_empty(rows, hc, dtype=F32),
    )


def _boundary_outputs(residual: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    return _new_streams(residual), _layer_input(residual)


def _coefficients(residual: Tensor, **_: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    post, comb, pre = _mixes(residual)
    return post, comb, _layer_input(residual), pre


def _run_boundary(
    handle: int,
    x: Tensor | None,
    gemm2_permuted: Tensor | None,
    expert_weights: Tensor | None,
    expanded_idx_to_permuted_idx: Tensor | None,
    shared_output: Tensor | None,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor | None,
    norm_weight: Tensor | None,
    norm_eps: float,
    mxfp8_data: Tensor | None = None,
    mxfp8_scale: Tensor | None = None,
    fp8_data: Tensor | None = None,
    fp8_scale: Tensor | None = None,
    fp8_ue8m0: bool = False,
    aux_out: Tensor | None = None,
    mix: MixWeights | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The direct path of one boundary op: the partial is `x`, or the unfinalised MoE output (all three given); with
    `mix` the boundary computes its own pre (pre None)."""
    ar = from_handle(handle)
    moe = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx)
    given = (gemm2_permuted is not None) + (expert_weights is not None) + (expanded_idx_to_permuted_idx is not None)
    if (x is None) != (given == 3) or (x is not None and given):
        raise ValueError(
            "pass the partial as x, or as gemm2_permuted, expert_weights and expanded_idx_to_permuted_idx, not both"
        )
    if (mxfp8_data is None) != (mxfp8_scale is None) or (fp8_data is None) != (fp8_scale is None):
        raise ValueError("mxfp8_data and mxfp8_scale (fp8_data and fp8_scale) are given together or not at all")
    mxfp8 = fp8 = None
    if mxfp8_data is not None:
        mxfp8 = QuantizedActivation(mxfp8_data, mxfp8_scale, BF16, mxfp8_data.shape, MXFP8_QUANT_KEY)
    if fp8_data is not None:
        key = FP8_GROUP_UE8M0_QUANT_KEY if fp8_ue8m0 else FP8_GROUP_QUANT_KEY
        fp8 = Fp8GroupActivation(fp8_data, fp8_scale, BF16, fp8_data.shape, key, fp8_ue8m0)
    epilogue = (residual, post, comb, pre, norm_weight, norm_eps, mxfp8)
    if x is not None:
        return ar(x, *epilogue, shared_output=shared_output, aux_out=aux_out, fp8_out=fp8, mix=mix)
    return ar.finalize(*moe, shared_output, *epilogue, aux_out=aux_out, fp8_out=fp8, mix=mix)


@_op(_layer_input)
def hc_head_final(
    handle: int,
    x: Tensor | None,
    gemm2_permuted: Tensor | None,
    expert_weights: Tensor | None,
    expanded_idx_to_permuted_idx: Tensor | None,
    shared_output: Tensor | None,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    head_fn: Tensor,
    head_scale: Tensor,
    head_base: Tensor,
    rms_eps: float,
    hc_eps: float,
    norm_weight: Tensor,
    norm_eps: float,
) -> Tensor:
    """DeepSeek-V4's last boundary (CONTRACT §4d) of rank `handle`: R' = the post, hc_head's weights p from R', then
    h = RMSNorm(bf16(sum_i p_i * R'_i)) (one launch on the kernels; the weights' kernel form made once per fn)."""
    mix = mhc.mix_weights(head_fn, head_scale, head_base, rms_eps, hc_eps)
    source = (x, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
    _, hidden = _run_boundary(handle, *source, residual, post, comb, None, norm_weight, norm_eps, mix=mix)
    return hidden


@_op(_boundary_outputs, BOUNDARY_MUTATES)
def boundary(
    handle: int,
    x: Tensor | None,
    gemm2_permuted: Tensor | None,
    expert_weights: Tensor | None,
    expanded_idx_to_permuted_idx: Tensor | None,
    shared_output: Tensor | None,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    mxfp8_data: Tensor | None,
    mxfp8_scale: Tensor | None,
    fp8_data: Tensor | None,
    fp8_scale: Tensor | None,
    fp8_ue8m0: bool,
    aux_out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The fused boundary (CONTRACT §2) of rank `handle`: (new residual, layer input), from a ready partial `x`
    (with `shared_output`: bf16(x + shared)) or an unfinalised MoE output; MXFP8, FP8 1x128 and aux written in place."""
    if (
        gemm2_permuted is None
        and expert_weights is None
        and expanded_idx_to_permuted_idx is None
        and shared_output is None
        and mxfp8_data is None
        and mxfp8_scale is None
        and fp8_data is None
        and fp8_scale is None
        and aux_out is None
        and x is not None
    ):  # the plain call, straight to the public one (host time; the scheduler's ops call boundary_ready for it)
        return boundary_ready(handle, x, residual, post, comb, pre, norm_weight, norm_eps)
    return _run_boundary(
        handle,
        x,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        shared_output,
        residual,
        post,
        comb,
        pre,
        norm_weight,
        norm_eps,
        mxfp8_data,
        mxfp8_scale,
        fp8_data,
        fp8_scale,
        fp8_ue8m0,
        aux_out,
    )


@_op(_boundary_outputs)
def boundary_ready(
    handle: int,
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
) -> tuple[Tensor, Tensor]:
    """`boundary` on a ready partial `x` with nothing written in place, the common call, in 8 arguments (an op's
    dispatch costs host time per argument: about 1 us less than `boundary`'s 18): what Boundaries' ops call for it."""
    return from_handle(handle)(x, residual, post, comb, pre, norm_weight, norm_eps, None)


# No aux_out here: Inductor cannot compile an op that returns one Tensor and declares a mutated argument the call
# passes as None ("getitem is not an OpOverload"); aux on the residual-only boundary is BoundaryAllReduce's.
@_op(_new_streams)
def post_only(
    handle: int,
    x: Tensor | None,
    gemm2_permuted: Tensor | None,
    expert_weights: Tensor | None,
    expanded_idx_to_permuted_idx: Tensor | None,
    shared_output: Tensor | None,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
) -> Tensor:
    """The residual-only boundary (CONTRACT §2) of rank `handle`: the new streams R' alone."""
    new, _ = _run_boundary(
        handle,
        x,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        shared_output,
        residual,
        post,
        comb,
        None,
        None,
        0.0,
    )
    return new


@_op(_layer_input)
def final(
    handle: int,
    x: Tensor | None,
    gemm2_permuted: Tensor | None,
    expert_weights: Tensor | None,
    expanded_idx_to_permuted_idx: Tensor | None,
    shared_output: Tensor | None,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
) -> Tensor:
    """The final boundary (CONTRACT §4c) of rank `handle`: h = RMSNorm(collapse(R', pre)) with the final norm."""
    _, hidden = _run_boundary(
        handle,
        x,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        shared_output,
        residual,
        post,
        comb,
        pre,
        norm_weight,
        norm_eps,
    )
    return hidden


@_op(_coefficients)
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
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, layer_input, next_pre) of CONTRACT §3: `boundary.mhc_pre_delayed` as an op. `workspace_owner`
    names a simulated rank's coefficients workspace (the scheduler passes it; see mhc.prepare_workspace)."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    return mhc.pre_delayed(
        residual, params, pre_mix, x, norm_weight, norm_eps, backend=backend, workspace_owner=workspace_owner
    )


@_op(_mixes)
def mhc_mixes(
    residual: Tensor,
    fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    x: Tensor | None = None,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(post, comb, next_pre) alone, with no layer input: the coefficients a `sublayer` computes after its boundary."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    return mhc.mixes(residual, params, x, backend=backend, workspace_owner=workspace_owner)


@_op(_layer_input)
def collapse_norm(residual: Tensor, pre: Tensor, norm_weight: Tensor, norm_eps: float, backend: str = "auto") -> Tensor:
    """RMSNorm(bf16(sum_j pre[j] * R[j])) with the pre given (the V4 scheme's layer input and hc_head's collapse):
    `boundary.mhc.collapse_norm` as an op."""
    return mhc.collapse_norm(residual, pre, norm_weight, norm_eps, backend=backend)


def _head_weights(residual: Tensor, **_: object) -> Tensor:
    return residual.new_empty(residual.shape[0], residual.shape[1], dtype=F32)


@_op(_head_weights)
def hc_head_mix(
    residual: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    rms_eps: float,
    hc_eps: float,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> Tensor:
    """DeepSeek-V4's hc_head weights [T, hc]: `boundary.mhc.head_mix` as an op."""
    return mhc.head_mix(residual, fn, scale, base, rms_eps, hc_eps, backend=backend, workspace_owner=workspace_owner)


def _quantized(data: Tensor, scale: Tensor, form: str) -> QuantizedActivation | Fp8GroupActivation:
    """The layer input's quantized form `form` ("mxfp8", "fp8_1x128" or "fp8_1x128_ue8m0") over `data` and `scale`."""
    if form == "mxfp8":
        return QuantizedActivation(data, scale, BF16, data.shape, MXFP8_QUANT_KEY)
    if form in ("fp8_1x128", "fp8_1x128_ue8m0"):
        ue8m0 = form == "fp8_1x128_ue8m0"
        key = FP8_GROUP_UE8M0_QUANT_KEY if ue8m0 else FP8_GROUP_QUANT_KEY
        return Fp8GroupActivation(data, scale, BF16, data.shape, key, ue8m0)
    raise ValueError(f"form must be 'mxfp8', 'fp8_1x128' or 'fp8_1x128_ue8m0', got {form!r}")


@_op(_layer_input, ("data", "scale"))
def collapse_norm_quantized(
    residual: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    data: Tensor,
    scale: Tensor,
    form: str,
    backend: str = "auto",
) -> Tensor:
    """collapse_norm with the layer input's quantized form `form` ("mxfp8", "fp8_1x128" or "fp8_1x128_ue8m0") written
    in place into `data` and `scale` (CONTRACT §4 / §4b layouts): `boundary.mhc.collapse_norm(quantized_out=)`."""
    out = _quantized(data, scale, form)
    return mhc.collapse_norm(residual, pre, norm_weight, norm_eps, quantized_out=out, backend=backend)


def _own_pre_outputs(residual: Tensor, **_: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_mixes(residual), _layer_input(residual))


@_op(_own_pre_outputs, ("data", "scale"))
def mhc_own_pre(
    residual: Tensor,
    fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    norm_weight: Tensor,
    norm_eps: float,
    data: Tensor | None,
    scale: Tensor | None,
    form: str | None,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, pre, layer_input) of DeepSeek-V4's own-pre entry, with the layer input's quantized form `form`
    (None: none) written in place into `data` and `scale`: `boundary.mhc.own_pre` as an op."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    if (form is None) != (data is None) or (data is None) != (scale is None):
        raise TypeError(
            "mhc_own_pre: give form, data and scale together (a quantized layer input) or none of them, got "
            f"form={form!r}, data {'None' if data is None else 'given'}, scale {'None' if scale is None else 'given'}"
        )
    out = None if form is None else _quantized(data, scale, form)
    return mhc.own_pre(
        residual, params, norm_weight, norm_eps, quantized_out=out, backend=backend, workspace_owner=workspace_owner
    )


@_op(_layer_input)
def hc_head_input(
    residual: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    rms_eps: float,
    hc_eps: float,
    norm_weight: Tensor,
    norm_eps: float,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> Tensor:
    """DeepSeek-V4's final hidden state from the last streams (hc_head's weights, collapse, final norm):
    `boundary.mhc.head_input` as an op."""
    return mhc.head_input(
        residual,
        fn,
        scale,
        base,
        rms_eps,
        hc_eps,
        norm_weight,
        norm_eps,
        backend=backend,
        workspace_owner=workspace_owner,
    )


@_op(_new_streams)
def mhc_post(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor, backend: str = "auto") -> Tensor:
    """The new streams from a reduced sublayer output: `boundary.mhc_post` as an op."""
    return mhc.mhc_post(x, residual, post, comb, backend=backend)


def partial_args(pending: object) -> tuple[Tensor | None, ...]:
    """A pending sublayer output as the boundary ops' partial arguments: (x, gemm2_permuted, expert_weights,
    expanded_idx_to_permuted_idx, shared_output)."""
    if isinstance(pending, Tensor):
        return pending, None, None, None, None
    assert isinstance(pending, MoEOutput)  # the scheduler checked it
    routed = pending.routed
    if isinstance(routed, Tensor):
        return routed, None, None, None, pending.shared_output
    return (
        None,
        routed.gemm2_permuted,
        routed.expert_weights,
        routed.expanded_idx_to_permuted_idx,
        pending.shared_output,
    )
