"""The data the boundary passes around: MoE outputs, quantized activations, the layer protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from boundary import checks
from boundary.reference import FP8_GROUP, fp8_group_scale_rows, mxfp8_scale_bytes

MXFP8_QUANT_KEY = "mxfp8_e4m3_e8m0_swizzled_128x4"
FP8_GROUP_QUANT_KEY = "fp8_e4m3_fp32_1x128_colmajor"
FP8_GROUP_UE8M0_QUANT_KEY = "fp8_e4m3_ue8m0_1x128_colmajor"  # fp32 scales that are powers of two


@dataclass
class UnfinalizedMoEOutput:
    """A MoE output whose top-k combine is still to do: rows permuted by expert, router weights, index map."""

    gemm2_permuted: Tensor
    expert_weights: Tensor
    expanded_idx_to_permuted_idx: Tensor


@dataclass
class MoEOutput:
    """A rank's MoE partial: the routed part (combined or not) and the shared experts' part."""

    routed: UnfinalizedMoEOutput | Tensor
    shared_output: Tensor | None


@dataclass(frozen=True)
class MixWeights:
    """DeepSeek-V4's pre weights for a boundary that computes its own pre from the new streams R' (CONTRACT §4d):
    pre = sigmoid(scale * (fn . R') * rsqrt(mean(R'^2) + rms_eps) + base) + eps. `fn` [4, 4H] fp32 (a layer's first
    4 mixes, or hc_head's fn), `params` their kernel form ([8] fp32 on the device: scale, base, rms_eps, eps, 0), and
    scale / base / the epsilons as given, for the reference. Made by `boundary.mhc.mix_weights`."""

    fn: Tensor
    params: Tensor
    scale: Tensor
    base: Tensor
    rms_eps: float
    eps: float


@dataclass
class QuantizedActivation:
    """A layer input in MXFP8: e4m3 data [T, H] and E8M0 scales in the swizzled 128x4 layout."""

    data: Tensor
    scale: Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: str


def empty_quantized_layer_input(num_tokens: int, hidden_size: int, device: Any) -> QuantizedActivation:
    """An uninitialised MXFP8 layer input for `num_tokens` rows, for a boundary to write into."""
    num_tokens = checks.positive_int("num_tokens", num_tokens)
    hidden_size = checks.positive_int("hidden_size", hidden_size)
    if hidden_size % 32:
        raise ValueError(f"hidden_size must be a positive multiple of 32, got {hidden_size!r}")
    return empty_quantized(num_tokens, hidden_size, checks.device("device", device))


def empty_quantized(num_tokens: int, hidden_size: int, device: torch.device) -> QuantizedActivation:
    """empty_quantized_layer_input on checked arguments (the scheduler's, every sublayer with `quantize`)."""
    data = torch.empty(num_tokens, hidden_size, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(mxfp8_scale_bytes(num_tokens, hidden_size), dtype=torch.uint8, device=device)
    return QuantizedActivation(data, scale, torch.bfloat16, torch.Size((num_tokens, hidden_size)), MXFP8_QUANT_KEY)


@dataclass
class Fp8GroupActivation:
    """A layer input in FP8 1x128 (CONTRACT §4b): e4m3 data [T, H], fp32 scales [H/128, T_pad] (column-major)."""

    data: Tensor
    scale: Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: str
    ue8m0: bool = False

    @property
    def gemm_scale(self) -> Tensor:
        """The scales as the [T, H/128] view with strides (1, T_pad) that DeepGEMM's SM90 FP8 GEMMs take."""
        return self.scale[:, : self.data.shape[0]].t()


def empty_fp8_group_layer_input(
    num_tokens: int, hidden_size: int, device: Any, ue8m0: bool = False
) -> Fp8GroupActivation:
    """An uninitialised FP8 1x128 layer input for `num_tokens` rows, for a boundary to write into."""
    num_tokens = checks.positive_int("num_tokens", num_tokens)
    hidden_size = checks.positive_int("hidden_size", hidden_size)
    if hidden_size % FP8_GROUP:
        raise ValueError(f"hidden_size must be a positive multiple of {FP8_GROUP}, got {hidden_size!r}")
    return empty_fp8_group(num_tokens, hidden_size, checks.device("device", device), checks.flag("ue8m0", ue8m0))


def empty_fp8_group(num_tokens: int, hidden_size: int, device: torch.device, ue8m0: bool) -> Fp8GroupActivation:
    """empty_fp8_group_layer_input on checked arguments (the scheduler's, a sublayer with an FP8 1x128 `quantize`)."""
    data = torch.empty(num_tokens, hidden_size, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(hidden_size // FP8_GROUP, fp8_group_scale_rows(num_tokens), dtype=torch.float32, device=device)
    key = FP8_GROUP_UE8M0_QUANT_KEY if ue8m0 else FP8_GROUP_QUANT_KEY
    return Fp8GroupActivation(data, scale, torch.bfloat16, torch.Size((num_tokens, hidden_size)), key, ue8m0)


def empty_layer_input_form(
    form: str | None, num_tokens: int, hidden_size: int, device: torch.device
) -> QuantizedActivation | Fp8GroupActivation | None:
    """An empty quantized layer input in the form a `quantize=` name gives ("mxfp8", "fp8_1x128",
    "fp8_1x128_ue8m0"; None: none), on checked arguments."""
    if form is None:
        return None
    if form == "mxfp8":
        return empty_quantized(num_tokens, hidden_size, device)
    return empty_fp8_group(num_tokens, hidden_size, device, form == "fp8_1x128_ue8m0")


def check_mxfp8_out(name: str, out: object, rows: int, hidden: int, device: torch.device, align: int) -> None:
    """Raise unless `out` is a QuantizedActivation for `rows` x `hidden` on `device` whose data start on `align`
    bytes (the kernels write 16 bytes of data, 4 of scales, at a time; 1 on the torch path)."""
    if not isinstance(out, QuantizedActivation):
        raise TypeError(f"{name} must be a QuantizedActivation or None, got {type(out).__name__}")
    fp8 = torch.float8_e4m3fn
    checks.tensor(f"{name}.data", out.data, dtype=fp8, shape=(rows, hidden), device=device, align=align)
    nbytes = mxfp8_scale_bytes(rows, hidden)
    checks.tensor(f"{name}.scale", out.scale, dtype=torch.uint8, shape=(nbytes,), device=device, align=min(align, 4))


def check_fp8_out(name: str, out: object, rows: int, hidden: int, device: torch.device, align: int) -> None:
    """Raise unless `out` is an Fp8GroupActivation for `rows` x `hidden` on `device` whose data and scales start on
    `align` bytes (TMA-aligned columns; the last row's scale and padding go as one 16-byte store), with the quant_key
    of its ue8m0."""
    if not isinstance(out, Fp8GroupActivation):
        raise TypeError(f"{name} must be an Fp8GroupActivation or None, got {type(out).__name__}")
    fp8 = torch.float8_e4m3fn
    checks.tensor(f"{name}.data", out.data, dtype=fp8, shape=(rows, hidden), device=device, align=align)
    shape = (hidden // FP8_GROUP, fp8_group_scale_rows(rows))
    checks.tensor(f"{name}.scale", out.scale, dtype=torch.float32, shape=shape, device=device, align=align)
    checks.flag(f"{name}.ue8m0", out.ue8m0)
    key = FP8_GROUP_UE8M0_QUANT_KEY if out.ue8m0 else FP8_GROUP_QUANT_KEY
    if out.quant_key != key:  # a GEMM reads the scales by the key, the kernel writes them by ue8m0
        raise ValueError(f"{name}.quant_key is {out.quant_key!r} but {name}.ue8m0 is {out.ue8m0}, whose key is {key!r}")


def quant_form(out: QuantizedActivation | Fp8GroupActivation) -> str:
    """The `quantize=` name of a checked quantized layer input: "mxfp8", "fp8_1x128" or "fp8_1x128_ue8m0"."""
    if isinstance(out, QuantizedActivation):
        return "mxfp8"
    return "fp8_1x128_ue8m0" if out.ue8m0 else "fp8_1x128"


class Norm(Protocol):
    """An RMSNorm module as the boundary reads it."""

    weight: Tensor
    variance_epsilon: float


class MHCLayer(Protocol):
    """The attributes of a decoder layer that the boundary scheduler reads (CONTRACT §5)."""

    hc_mult: int
    hc_attn_fn: Tensor
    hc_attn_fn_broadcast: Tensor | None
    hc_attn_scale: Tensor
    hc_attn_base: Tensor
    hc_ffn_fn: Tensor
    hc_ffn_scale: Tensor
    hc_ffn_base: Tensor
    attn_norm: Norm
    ffn_norm: Norm
    rms_norm_eps: float
    hc_eps: float
    hc_post_alpha: float
    hc_sinkhorn_iters: int
    mhc_stream: Any
