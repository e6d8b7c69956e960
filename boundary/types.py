"""The data the boundary passes around: MoE outputs, quantized activations, the layer protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from boundary import checks
from boundary.reference import mxfp8_scale_bytes

MXFP8_QUANT_KEY = "mxfp8_e4m3_e8m0_swizzled_128x4"


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
