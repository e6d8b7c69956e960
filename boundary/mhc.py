"""The public mHC ops (coefficients, post) with their input checks and their dispatch.

On a CUDA device with the kernels (sm_90a / sm_100a) the coefficients run as one or two CuTe DSL
launches (`cute_kernels.coefficients`); on the CPU, or with `backend="reference"`, as torch ops. The
checks here are the only ones: the kernels' host side trusts its callers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from boundary import checks, reference
from boundary.backend import kernel_arch
from boundary.params import MHCParams
from boundary.types import (
    Fp8GroupActivation,
    MixWeights,
    QuantizedActivation,
    check_fp8_out,
    check_mxfp8_out,
    quant_form,
)
from cute_kernels import HC, coefficients
from cute_kernels.boundary.api import fused_boundary
from cute_kernels.boundary.args import BoundaryVariant
from cute_kernels.boundary.own_pre import MIX_PARAMS
from cute_kernels.coefficients import CoefficientsWorkspace, mhc_coefficients, mhc_layer_input
from cute_kernels.compile import WarmupJob
from cute_kernels.hardware import MAX_GRID_Y

RESIDUAL_ONLY = BoundaryVariant("x", pre=False)  # mhc_post: the fused boundary without a layer input

BF16 = torch.bfloat16
F32 = torch.float32
_WORKSPACES: dict[tuple[torch.device, int, int | None], Any] = {}
_RETIRED_WORKSPACES: list[Any] = []  # grown out of, kept for the graphs that may hold their addresses


def prepare_workspace(hidden: int, rows: int, device: torch.device, owner: int | None = None) -> Any:
    """The coefficients kernel's workspace for (device, H, owner), grown to hold `rows` rows.

    One workspace per device and H serves every call of one owner: the scheduler orders its coefficient
    launches (each side-stream launch is joined before the next boundary), so two never overlap. Simulated
    ranks run their steps at once on one GPU: each is an owner of its own (its rank). Growing is not
    allowed during CUDA-graph capture: call BoundaryAllReduce.warmup(max_rows) first.
    """
    key = (device, hidden, owner)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.max_rows < rows:
        limit = kernel_row_limit(hidden)
        if rows > limit:
            raise ValueError(_too_many_rows(rows, hidden))
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the mHC coefficients workspace for H={hidden} must grow to {rows} rows during CUDA-graph "
                "capture; call BoundaryAllReduce.warmup(max_rows) before capturing"
            )
        capacity = min(max(rows, 512 if ws is None else 2 * ws.max_rows), limit)
        if ws is not None:
            # A CUDA graph captured before may still use the smaller one's addresses: it is kept, never freed (each
            # growth doubles, so all of them take less than twice the largest).
            _RETIRED_WORKSPACES.append(ws)
        with torch.inference_mode(False):  # kept across calls, which may run outside inference mode
            ws = _WORKSPACES[key] = CoefficientsWorkspace(hidden, capacity, device)
    return ws


def warmup_jobs(
    hidden: int,
    arch: str,
    max_rows: int,
    *,
    sinkhorn_repeat: int = 20,
    unnormed: bool = False,
    own_pre: bool = False,
    quantized: tuple[str, ...] = (),
) -> list[WarmupJob]:
    """The compiles every mHC coefficients call of hidden size H, up to `max_rows` rows and `sinkhorn_repeat`
    Sinkhorn iterations (a compile-time constant) can need (`unnormed`: the layer input without a norm weight too;
    `own_pre`: DeepSeek-V4's too: own_pre's variant in bf16 and in the `quantized` forms, head_input's and head_mix's
    variants, and collapse_norm's `quantized` forms, those of the `quantize=` names given)."""
    _check_kernel_shape(4, hidden)
    if max_rows > kernel_row_limit(hidden):
        raise ValueError(_too_many_rows(max_rows, hidden))
    if not own_pre or hidden % QUANT_H_MULTIPLE:
        quantized = ()  # collapse_norm refuses them at this H
    return coefficients.warmup_jobs(
        hidden,
        arch=arch,
        max_rows=max_rows,
        sinkhorn_repeat=sinkhorn_repeat,
        unnormed=unnormed,
        quantized=quantized,
        head_repeat=HEAD_SINKHORN_REPEAT if own_pre else None,
    )


def kernel_row_limit(hidden: int) -> int:
    """The most rows a coefficients kernel call takes at hidden size H: the largest workspace, and row
    offsets (rows * 4H elements) in 32 bits."""
    return min(coefficients.MAX_ROWS, (2**31 - 1) // (4 * hidden))


def _too_many_rows(rows: int, hidden: int) -> str:
    return f"the mHC kernels take at most {kernel_row_limit(hidden)} rows at H={hidden}, got {rows}"


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
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, layer_input, next_pre) of CONTRACT §3: `pre_delayed` with the parameters spelled out."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    return pre_delayed(residual, params, pre_mix, x, norm_weight, norm_eps, backend=backend)


def pre_delayed(
    residual: Tensor,
    params: MHCParams,
    pre_mix: Tensor | None = None,
    x: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    *,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, layer_input, next_pre) of CONTRACT §3: the mixes of the streams and the delayed collapse.

    On the kernels, one launch computes both the mixes and the layer input (without `norm_weight`, the collapse).
    `workspace_owner`: see prepare_workspace.
    """
    params, norm_eps = checks.pre_delayed(residual, params, pre_mix, x, norm_weight, norm_eps)
    arch = kernel_arch(residual.device, backend)
    if arch is None:
        return reference.pre_delayed(residual, params, pre_mix, x, norm_weight, norm_eps)
    _check_kernel_args(residual, x, params.fn, pre_mix, norm_weight, arch, inline=True, layer_input_kernel=True)
    layer_input = torch.empty(residual.shape[0], residual.shape[2], dtype=BF16, device=residual.device)
    post, comb, pre = _kernel_coefficients(
        residual,
        x,
        params,
        arch,
        pre_mix=pre_mix,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
        layer_input=layer_input,
        owner=workspace_owner,
    )
    return post, comb, layer_input, pre


def _layer_input(
    residual: Tensor,
    x: Tensor | None,
    pre_mix: Tensor | None,
    norm_weight: Tensor | None,
    norm_eps: float,
    arch: str | None,
) -> Tensor:
    """The layer input alone, on the current stream: one kernel launch, or torch ops on the reference."""
    if arch is None:
        return delayed_layer_input(residual, pre_mix, norm_weight, norm_eps)
    out = torch.empty(residual.shape[0], residual.shape[2], dtype=BF16, device=residual.device)
    if x is not None:  # the first layer: the collapse is the embedding row itself
        mhc_layer_input(x, None, norm_weight, norm_eps, out, arch=arch, broadcast=True)
    else:
        mhc_layer_input(residual, pre_mix, norm_weight, norm_eps, out, arch=arch)
    return out


def collapse_norm(
    residual: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    *,
    quantized_out: QuantizedActivation | Fp8GroupActivation | None = None,
    backend: str = "auto",
) -> Tensor:
    """RMSNorm(bf16(sum_j pre[j] * R[j])) with the pre given: the V4 scheme's own-pre layer input and hc_head's
    collapse and final norm (CONTRACT §4d); with `quantized_out` (from empty_quantized_layer_input or
    empty_fp8_group_layer_input) also its MXFP8 or FP8 1x128 form, written there. One launch on the kernels (the
    layer-input kernel; a quantized form needs H a multiple of 1024), torch ops on the reference."""
    residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    dev = residual.device
    checks.tensor("pre", pre, dtype=torch.float32, shape=(rows, hc), device=dev)
    checks.tensor("norm_weight", norm_weight, dtype=BF16, shape=(hidden,), device=dev)
    norm_eps = checks.finite_float("norm_eps", norm_eps, minimum=0.0)
    arch = kernel_arch(dev, backend)
    align = 16 if arch is not None else 1
    if isinstance(quantized_out, QuantizedActivation):
        check_mxfp8_out("quantized_out", quantized_out, rows, hidden, dev, align)
    elif quantized_out is not None:
        check_fp8_out("quantized_out", quantized_out, rows, hidden, dev, align)
    if arch is None:
        out = delayed_layer_input(residual, pre, norm_weight, norm_eps)
        if quantized_out is not None:
            reference.quantize_into(out, quantized_out.data, quantized_out.scale, quant_form(quantized_out))
        return out
    _check_kernel_shape(hc, hidden)
    if quantized_out is not None:
        check_quantizable(hidden)
    for name, value in (("residual", residual), ("pre", pre), ("norm_weight", norm_weight)):
        checks.tensor(name, value, align=16)
    out = torch.empty(rows, hidden, dtype=BF16, device=dev)
    q = quantized_out
    mhc_layer_input(
        residual,
        pre,
        norm_weight,
        norm_eps,
        out,
        arch=arch,
        quant=None if q is None else quant_form(q),
        quant_data=None if q is None else q.data,
        quant_scale=None if q is None else q.scale,
    )
    return out


def own_pre(
    residual: Tensor,
    params: MHCParams,
    norm_weight: Tensor,
    norm_eps: float,
    *,
    quantized_out: QuantizedActivation | Fp8GroupActivation | None = None,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, pre, layer_input) of DeepSeek-V4's own-pre entry (CONTRACT §4d): the mixes of the streams, then
    the layer input RMSNorm(bf16(sum_j pre[j] * R[j])) collapsed with that very pre; with `quantized_out` (from
    empty_quantized_layer_input or empty_fp8_group_layer_input) also its MXFP8 or FP8 1x128 form, written there. On the
    kernels one call of the coefficients kernel's own-pre variant (the CTAs that finish the rows collapse them; one
    launch at 1 row, two from 2 rows: the partials schedule's finish kernel; a quantized form needs H a multiple of
    1024); torch ops on the reference, the very bits of `mixes` then
    `collapse_norm`. `workspace_owner`: see prepare_workspace."""
    params, norm_eps = checks.pre_delayed(residual, params, None, None, norm_weight, norm_eps)
    if norm_weight is None:
        raise TypeError("norm_weight must be a torch.Tensor, got None (the own-pre layer input is normed)")
    rows, hc, hidden = residual.shape
    dev = residual.device
    arch = kernel_arch(dev, backend)
    if isinstance(quantized_out, QuantizedActivation):
        check_mxfp8_out("quantized_out", quantized_out, rows, hidden, dev, 16 if arch is not None else 1)
    elif quantized_out is not None:
        check_fp8_out("quantized_out", quantized_out, rows, hidden, dev, 16 if arch is not None else 1)
    if arch is None:
        post, comb, pre = reference.coefficients(residual.reshape(rows, -1), params)
        layer_input = delayed_layer_input(residual, pre, norm_weight, norm_eps)
        if quantized_out is not None:
            reference.quantize_into(layer_input, quantized_out.data, quantized_out.scale, quant_form(quantized_out))
        return post, comb, pre, layer_input
    _check_kernel_args(
        residual, None, params.fn, None, norm_weight, arch, inline=False, layer_input_kernel=True, own_pre=True
    )
    if quantized_out is not None:
        check_quantizable(hidden)
    layer_input = torch.empty(rows, hidden, dtype=BF16, device=dev)
    post, comb, pre = _kernel_coefficients(
        residual,
        None,
        params,
        arch,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
        layer_input=layer_input,
        quantized=quantized_out,
        own_pre=True,
        owner=workspace_owner,
    )
    return post, comb, pre, layer_input


def check_quantizable(hidden: int) -> None:
    """Raise unless the layer-input kernel can write a quantized form at hidden size H (a multiple of 1024)."""
    if hidden % QUANT_H_MULTIPLE:
        raise ValueError(
            f"the layer-input kernel writes a quantized form at H a multiple of {QUANT_H_MULTIPLE} (got H={hidden}); "
            "use quantize=False, or pass backend='reference' for other shapes"
        )


def delayed_layer_input(
    residual: Tensor, pre_mix: Tensor | None, norm_weight: Tensor | None, norm_eps: float
) -> Tensor:
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
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mhc_pre_delayed split in two (`pre_delayed_overlap` with the parameters spelled out)."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    return pre_delayed_overlap(
        residual, params, pre_mix, x, norm_weight, norm_eps, stream=stream, layer_input=layer_input, backend=backend
    )


def pre_delayed_overlap(
    residual: Tensor,
    params: MHCParams,
    pre_mix: Tensor | None = None,
    x: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    *,
    stream: Any,
    layer_input: Tensor | None = None,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """pre_delayed split in two: the layer input on the current stream, the mixes on `stream`.

    `stream` waits for the current stream first; the streams (and `x`) are recorded on it. The
    caller keeps the weights alive and makes the current stream wait for `stream` before it
    reads post, comb or next_pre. With `layer_input` given, only the mixes run. `stream` None
    (the CPU) runs everything on the current stream. `workspace_owner`: see prepare_workspace.
    """
    params, norm_eps = checks.pre_delayed(residual, params, pre_mix, x, norm_weight, norm_eps)
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if stream is not None and residual.device.type != "cuda":
        raise ValueError(f"stream is a CUDA stream but residual is on {residual.device}")
    arch = kernel_arch(residual.device, backend)
    if arch is not None:
        reads = layer_input is None  # the layer-input-only kernel runs
        _check_kernel_args(residual, x, params.fn, pre_mix, norm_weight, arch, inline=False, layer_input_kernel=reads)
    if layer_input is None:
        layer_input = _layer_input(residual, x, pre_mix, norm_weight, norm_eps, arch)
    else:
        checks.tensor(
            "layer_input", layer_input, dtype=BF16, shape=(residual.shape[0], residual.shape[2]), device=residual.device
        )
    if stream is None:
        post, comb, pre = _coefficients(residual, x, params, arch, workspace_owner)
        return post, comb, layer_input, pre
    stream.wait_stream(torch.cuda.current_stream(residual.device))
    with torch.cuda.stream(stream):
        post, comb, pre = _coefficients(residual, x, params, arch, workspace_owner)
    (x if x is not None else residual).record_stream(stream)
    return post, comb, layer_input, pre


def mixes(
    residual: Tensor,
    params: MHCParams,
    x: Tensor | None = None,
    *,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """post, comb and next_pre alone (no layer input), on the current stream: one launch on the kernels.
    `workspace_owner`: see prepare_workspace."""
    params, _ = checks.pre_delayed(residual, params, None, x, None, 0.0)
    arch = kernel_arch(residual.device, backend)
    if arch is not None:
        _check_kernel_args(residual, x, params.fn, None, None, arch, inline=False, layer_input_kernel=False)
    return _coefficients(residual, x, params, arch, workspace_owner)


def head_mix(
    residual: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    rms_eps: float,
    hc_eps: float,
    *,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> Tensor:
    """DeepSeek-V4's hc_head weights p [T, hc] = sigmoid(scale * (fn . x) * rsqrt(mean(x^2) + rms_eps) + base) +
    hc_eps of the streams (`reference.hc_head_mix`; CONTRACT §4d). On the kernels it is the coefficients kernel's pre
    (the same formula, the same order of operations) with `fn` and `base` as the first hc of its 24 mixes, the rest
    zero: one launch, whose post and comb are dropped, so its variant runs one Sinkhorn repeat (HEAD_SINKHORN_REPEAT),
    not the layers' 20. On the reference, torch ops."""
    params = _head_params(residual, fn, scale, base, rms_eps, hc_eps, backend)
    if params is None:
        return reference.hc_head_mix(residual, fn, scale, base, rms_eps, hc_eps)
    return mixes(residual, params, backend=backend, workspace_owner=workspace_owner)[2]


def head_input(
    residual: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    rms_eps: float,
    hc_eps: float,
    norm_weight: Tensor,
    norm_eps: float,
    *,
    backend: str = "auto",
    workspace_owner: int | None = None,
) -> Tensor:
    """DeepSeek-V4's last step after the final post: hc_head's weights p (`head_mix`), then RMSNorm(bf16(sum_i p_i *
    R_i)) with the final norm (CONTRACT §4d). On the kernels one call of the own-pre variant with hc_head's weights as
    its pre, one Sinkhorn repeat (one launch at 1 row, two from 2); torch ops on the reference: the bits of `head_mix` then
    `collapse_norm`."""
    params = _head_params(residual, fn, scale, base, rms_eps, hc_eps, backend)
    if params is not None:
        return own_pre(residual, params, norm_weight, norm_eps, backend=backend, workspace_owner=workspace_owner)[3]
    checks.tensor("norm_weight", norm_weight, dtype=BF16, shape=(residual.shape[2],), device=residual.device)
    norm_eps = checks.finite_float("norm_eps", norm_eps, minimum=0.0)
    p = reference.hc_head_mix(residual, fn, scale, base, rms_eps, hc_eps)
    return delayed_layer_input(residual, p, norm_weight, norm_eps)


def _head_params(
    residual: object, fn: object, scale: object, base: object, rms_eps: float, hc_eps: float, backend: str
) -> MHCParams | None:
    """hc_head's arguments checked; on the kernels its weights as the coefficients kernel's parameters (the head as the
    first hc of the 24 mixes, one Sinkhorn repeat), None on the reference."""
    residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    dev = residual.device
    checks.tensor("fn", fn, dtype=torch.float32, shape=(hc, hc * hidden), device=dev)
    checks.tensor("scale", scale, dtype=torch.float32, shape=(1,), device=dev)
    checks.tensor("base", base, dtype=torch.float32, shape=(hc,), device=dev)
    if kernel_arch(dev, backend) is None:
        return None
    fn24, scale3, base24 = _head_weights(fn, scale, base)
    return MHCParams(fn24, scale3, base24, rms_eps, hc_eps, hc_eps, 1.0, HEAD_SINKHORN_REPEAT)


class _WeightCopies:
    """Device tensors built from a few weight tensors (hc_head's kernel forms), kept per tensors at most `size` at a
    time (least recently used out). An entry holds its weights strongly, so its key's ids cannot be reused while it
    lives, and no weak reference is left on a parameter (torch.utils.swap_tensors refuses those). A hit needs the very
    same tensors at the same storage and version (an in-place update that torch sees); a change rebuilds the copies
    in place, at the same addresses. An update torch does not see (`param.data.copy_`, a collective) or one between
    CUDA-graph replays needs `refresh()` (V4Boundaries.weights_updated)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple, tuple[tuple[Tensor, ...], tuple, Any, Callable[..., Any]]] = {}

    @staticmethod
    def _state(weights: tuple[Tensor, ...]) -> tuple:
        # inference tensors keep no version counter (nothing outside inference mode can update them in place)
        return tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in weights)

    def get(
        self, weights: tuple[Tensor, ...], extra: tuple, build: Callable[..., Any], fill: Callable[..., None]
    ) -> Any:
        """The copies of `weights` (with `extra`, plain values): `build(*weights, *extra)` makes them, `fill(copies,
        *weights, *extra)` rewrites them in place."""
        key = (*(id(w) for w in weights), *extra)
        entry = self.entries.pop(key, None)
        state = self._state(weights)
        if entry is None or entry[1] != state:
            with torch.inference_mode(False):  # kept and rewritten in place outside inference mode too
                if entry is None:
                    copies = build(*weights, *extra)
                else:
                    copies = entry[2]
                    fill(copies, *weights, *extra)
        else:
            copies = entry[2]
        self.entries[key] = (weights, state, copies, fill)  # the most recent last
        while len(self.entries) > self.size:
            del self.entries[next(iter(self.entries))]
        return copies

    def refresh(self) -> None:
        """Rewrite every entry's copies in place from its weights' current values (on the current stream)."""
        with torch.inference_mode(False):
            for key, (weights, _, copies, fill) in self.entries.items():
                fill(copies, *weights, *key[len(weights) :])
                self.entries[key] = (weights, self._state(weights), copies, fill)


# Enough for a benchmark's set of heads per shape; an engine has one head.
_MIX_WEIGHTS = _WeightCopies(32)
_HEAD_WEIGHTS = _WeightCopies(32)


def refresh_weights() -> None:
    """Rewrite the kernel path's copies of hc_head's weights from their tensors (after an update torch did not see,
    or before replaying CUDA graphs captured before an update): in place, so captured graphs read the new values."""
    _MIX_WEIGHTS.refresh()
    _HEAD_WEIGHTS.refresh()


def _fill_params(params: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, eps: float) -> None:
    params[0:1].copy_(scale)
    params[1 : 1 + HC].copy_(base)
    params[5].fill_(rms_eps)
    params[6].fill_(eps)


def _build_params(fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, eps: float) -> Tensor:
    params = torch.zeros(MIX_PARAMS, dtype=torch.float32, device=fn.device)
    _fill_params(params, fn, scale, base, rms_eps, eps)
    return params


def mix_weights(fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, eps: float) -> MixWeights:
    """The pre weights of a boundary that computes its own pre (MixWeights): a layer's `fn[:4]`, `scale[:1]`,
    `base[:4]` and its rms / pre epsilons, or hc_head's fn, scale, base and epsilons. Their kernel form is built once
    per set of tensors and kept (`_WeightCopies`): the call path makes no tensor and copies nothing from the host."""
    checks.tensor("fn", fn, dtype=torch.float32, shape=(HC, None))
    dev = fn.device
    hidden = fn.shape[1] // HC
    checks.tensor("fn", fn, dtype=torch.float32, shape=(HC, HC * hidden), device=dev)
    if not fn.is_contiguous():
        raise ValueError("fn must be contiguous (a layer's fn[:4] is)")
    checks.tensor("scale", scale, dtype=torch.float32, shape=(1,), device=dev)
    checks.tensor("base", base, dtype=torch.float32, shape=(HC,), device=dev)
    rms_eps = checks.finite_float("rms_eps", rms_eps, minimum=0.0)
    eps = checks.finite_float("eps", eps, minimum=0.0)
    params = _MIX_WEIGHTS.get((fn, scale, base), (rms_eps, eps), _build_params, _fill_params)
    return MixWeights(fn, params, scale, base, rms_eps, eps)


def _fill_head(copies: tuple[Tensor, Tensor, Tensor], fn: Tensor, scale: Tensor, base: Tensor) -> None:
    fn24, scale3, base24 = copies
    fn24[: fn.shape[0]].copy_(fn)
    scale3[:1].copy_(scale)
    base24[: fn.shape[0]].copy_(base)


def _build_head(fn: Tensor, scale: Tensor, base: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hc = fn.shape[0]
    mix = hc * (2 + hc)
    copies = (
        torch.zeros(mix, fn.shape[1], dtype=torch.float32, device=fn.device),
        torch.ones(3, dtype=torch.float32, device=fn.device),
        torch.zeros(mix, dtype=torch.float32, device=fn.device),
    )
    _fill_head(copies, fn, scale, base)
    return copies


def _head_weights(fn: Tensor, scale: Tensor, base: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(fn [24, hc*H], scale [3], base [24]) whose pre is hc_head's weights: fn and base first, zeros after."""
    return _HEAD_WEIGHTS.get((fn, scale, base), (), _build_head, _fill_head)


def _coefficients(
    residual: Tensor, x: Tensor | None, params: MHCParams, arch: str | None, owner: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """post, comb and next pre of one projection input, on the current stream."""
    if arch is None:
        return tuple(reference.coefficients(x if x is not None else residual.reshape(residual.shape[0], -1), params))
    return _kernel_coefficients(residual, x, params, arch, owner=owner)


def _kernel_coefficients(
    residual: Tensor,
    x: Tensor | None,
    params: MHCParams,
    arch: str,
    *,
    pre_mix: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float | None = None,
    layer_input: Tensor | None = None,
    quantized: QuantizedActivation | Fp8GroupActivation | None = None,
    own_pre: bool = False,
    owner: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One launch of the coefficients kernel (inline when `layer_input` is given; `own_pre`: collapsed with the pre
    it computes, `quantized` written beside it); the args are checked."""
    rows, hc, hidden = residual.shape
    dev = residual.device
    post = torch.empty(rows, hc, dtype=F32, device=dev)
    comb = torch.empty(rows, hc, hc, dtype=F32, device=dev)
    pre = torch.empty(rows, hc, dtype=F32, device=dev)
    inline = layer_input is not None
    mhc_coefficients(
        x if x is not None else residual,
        params.fn,
        params.scale,
        params.base,
        rms_eps=params.rms_eps,
        pre_eps=params.pre_eps,
        sinkhorn_eps=params.sinkhorn_eps,
        post_mult=params.post_mult,
        sinkhorn_repeat=params.sinkhorn_repeat,
        broadcast=x is not None,
        workspace=prepare_workspace(hidden, rows, dev, owner),
        post_out=post,
        comb_out=comb,
        pre_out=pre,
        pre_mix=pre_mix,
        norm_weight=norm_weight if inline else None,
        norm_eps=norm_eps if inline else None,
        layer_input_out=layer_input,
        own_pre=own_pre,
        quant=None if quantized is None else quant_form(quantized),
        quant_data=None if quantized is None else quantized.data,
        quant_scale=None if quantized is None else quantized.scale,
        arch=arch,
    )
    return post, comb, pre


def mhc_post(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor, *, backend: str = "auto") -> Tensor:
    """The new streams R'[j] = bf16(post[j]*x + sum_k comb[k, j]*R[k]) from a reduced sublayer output.

    On the kernels this is the fused boundary's residual-only mode: one launch.
    """
    residual = checks.tensor("residual", residual, dtype=BF16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    checks.tensor("x", x, dtype=BF16, shape=(rows, hidden), device=residual.device)
    post, comb, _ = checks.coefficients(rows, hc, residual.device, post, comb, None)
    arch = kernel_arch(residual.device, backend)
    if arch is None:
        return reference.mhc_post(x, residual, post, comb)
    _check_kernel_shape(hc, hidden)
    checks.tensor("residual", residual, align=16)
    checks.tensor("x", x, align=16)
    new = torch.empty_like(residual)
    fused_boundary(
        RESIDUAL_ONLY,
        residual=residual,
        post=post,
        comb=comb,
        pre=None,
        norm_weight=None,
        norm_eps=0.0,
        x=x,
        new_residual=new,
        arch=arch,
    )
    return new


# hc_head's weights need no comb: their coefficients variant runs the shortest Sinkhorn chain (~1.5 us less, v3).
HEAD_SINKHORN_REPEAT = 1
# H of a quantized layer input on the kernels: each of a cluster's 8 CTAs owns whole 128-column groups.
QUANT_H_MULTIPLE = 1024


def _check_kernel_shape(hc: int, hidden: int) -> None:
    if hc != 4 or hidden < 256 or hidden % 256:
        raise ValueError(
            f"the mHC kernels serve hc = 4 and H a positive multiple of 256 (got hc={hc}, H={hidden}); "
            "pass backend='reference' for other shapes"
        )


def _check_kernel_args(
    residual: Tensor,
    x: Tensor | None,
    fn: Tensor,
    pre_mix: Tensor | None,
    norm_weight: Tensor | None,
    arch: str,
    *,
    inline: bool,
    layer_input_kernel: bool,
    own_pre: bool = False,
) -> None:
    """What the coefficients kernels need beyond checks.pre_delayed (dtypes, shapes, contiguity and the
    device are checked there; the outputs and the workspace are allocated here): hc 4 and H a positive
    multiple of 256, the row limit, at most 65535 clusters per launch, and 16-byte alignment of what they
    read 16 bytes at a time. `inline`: the coefficients launch writes the layer input too;
    `layer_input_kernel`: the layer input is computed by a kernel (inline or alone)."""
    rows, hc, hidden = residual.shape
    _check_kernel_shape(hc, hidden)
    if rows > kernel_row_limit(hidden):
        raise ValueError(_too_many_rows(rows, hidden))
    broadcast = x is not None
    variant = coefficients.CoefficientsVariant.of(broadcast, inline, pre_mix is not None, norm_weight is not None)
    if own_pre:
        variant = coefficients.CoefficientsVariant.own()
    clusters = coefficients.grid_clusters(hidden, variant, rows, arch=arch)
    if clusters > MAX_GRID_Y:
        raise ValueError(f"{rows} rows at H={hidden} need {clusters} clusters, more than the {MAX_GRID_Y} of a launch")
    checks.tensor("x" if broadcast else "residual", x if broadcast else residual, align=16)
    checks.tensor("fn", fn, align=16)
    if layer_input_kernel:
        if norm_weight is not None:
            checks.tensor("norm_weight", norm_weight, align=16)
        if pre_mix is not None and not broadcast:  # the first layer's layer input ignores pre_mix
            checks.tensor("pre_mix", pre_mix, align=16)
