"""The torch math of CONTRACT §2-§4, with its exact rounding points: the oracle and the CPU path.

Every function computes in fp32 and rounds to bf16 exactly where the contract (docs/CONTRACT.md) says, so that a kernel
can be held to the same bits. Nothing here checks its inputs: the public entry points in
`boundary.mhc` and `boundary.all_reduce` do that before calling in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from boundary.params import MHCParams
from cute_kernels import E4M3_MAX, FP8_GROUP, HC, MXFP8_BLOCK, mxfp8_scale_bytes

MIX_WIDTH = HC * (HC + 2)  # 24: pre (4), post (4), comb (16)

BF16 = torch.bfloat16
F32 = torch.float32


ROW_BLOCK = 16  # rows of one block of the CPU path's projection and mixes (see `in_row_blocks`)


def in_row_blocks(f: Callable[..., Any], x: Tensor, *args: Any) -> Any:
    """`f(x, *args)` for x [T, ...] on the CPU, run on blocks of ROW_BLOCK rows (the last padded with zero rows) and
    put back together: f returns a tensor or a tuple (or NamedTuple) of tensors, each with the block's rows first.
    So a row's bits depend on that row alone, never on the row count (CONTRACT §6): torch's CPU kernels run a
    tensor's body vectorised and its tail scalar (sigmoid's two differ in the last bit); in blocks of one shape every
    row takes the same path. On a GPU, f(x, *args) (the oracle of the kernels, which are the GPU path)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or rows == 0:
        return f(x, *args)
    pad = -rows % ROW_BLOCK
    padded = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    parts = [f(padded[s : s + ROW_BLOCK], *args) for s in range(0, rows + pad, ROW_BLOCK)]
    fields = [(p,) if isinstance(p, Tensor) else tuple(p) for p in parts]
    for field in fields[0]:
        if not isinstance(field, Tensor) or field.dim() == 0 or field.shape[0] != ROW_BLOCK:
            raise ValueError("in_row_blocks: f must return tensors with the block's rows first")
    joined = [torch.cat(column)[:rows] for column in zip(*fields, strict=True)]
    if isinstance(parts[0], Tensor):
        return joined[0]
    return type(parts[0])(*joined) if hasattr(parts[0], "_fields") else tuple(joined)


def _row_sums(values: Tensor) -> Tensor:
    """[T, 1]: each row of a CPU fp32 [T, K] summed in one fixed order whatever T and the thread count: its two halves
    reduced apart, then added (torch splits a reduction with a single output, one row of 32768 values or more,
    across threads; never one with several). An odd K (no shape the boundary takes) is summed whole."""
    rows, width = values.shape
    if width % 2:
        return values.sum(-1, keepdim=True)
    halves = values.view(rows, 2, width // 2).sum(-1)
    return halves[:, :1] + halves[:, 1:]


def row_dots(x: Tensor, w: Tensor) -> Tensor:
    """[T, n] fp32: each fp32 row of x [T, K] dotted with each row of w [n, K]. On the CPU each dot product is its
    own reduction (`_row_sums`), so its bits depend neither on the other rows nor on the thread count, as a GEMM's
    blocking would."""
    w = w.to(F32)
    if x.device.type != "cpu":
        return x @ w.t()
    return torch.cat([_row_sums(x * w[i]) for i in range(w.shape[0])], 1)


def row_square_sums(x: Tensor) -> Tensor:
    """[T, 1] fp32: each fp32 row's sum of squares (on the CPU by `_row_sums`)."""
    squares = x * x
    if x.device.type != "cpu":
        return squares.sum(-1, keepdim=True)
    return _row_sums(squares)


def bf16_words(x: Tensor) -> Tensor:
    """A bf16 tensor's bits as int32 words (pairs of values) for an exchange that must not touch them; a view at an
    odd offset (no int32 view) is copied first."""
    x = x.contiguous()
    if x.storage_offset() % 2:
        x = x.clone()
    return x.view(torch.int32)


def rank_sum(partials: Sequence[Tensor]) -> Tensor:
    """y = bf16(x_0 + x_1 + ... + x_{W-1}) summed in fp32 in rank order (CONTRACT §2 step 1)."""
    acc = partials[0].to(F32)
    for p in partials[1:]:
        acc = acc + p.to(F32)
    return acc.to(BF16)


def moe_finalize(
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    idx: Tensor,
    shared_output: Tensor | None,
    error: Tensor | None = None,
) -> Tensor:
    """A rank's MoE partial: bf16(sum_i w[t,i] * gemm2_permuted[idx[t,i]] + shared[t]); idx -1 adds nothing.

    Any other index outside [0, P) adds nothing either (it is a caller bug, CONTRACT §2): with `error`
    (the int32 error word) the last such row + 1 goes to word 1 and its index to word 2, with no host sync.
    """
    rows, top_k = expert_weights.shape
    experts = gemm2_permuted.shape[0]
    acc = torch.zeros(rows, gemm2_permuted.shape[1], dtype=F32, device=gemm2_permuted.device)
    bad = (idx < -1) | (idx >= experts)
    if error is not None and rows:
        row_ids = torch.arange(1, rows + 1, dtype=torch.int32, device=idx.device)
        flagged = torch.where(bad.any(1), row_ids, 0).max()
        error[1] = torch.maximum(error[1], flagged)
        # Gathers, not indexing by a tensor (that reads it on the host): CUDA-graph capture and torch.compile.
        last = (flagged - 1).clamp(min=0).long().view(1)
        first_bad = bad.index_select(0, last).int().argmax(1, keepdim=True)
        error[2] = torch.where(flagged > 0, idx.index_select(0, last).gather(1, first_bad).view(()), error[2])
    for i in range(top_k if experts else 0):  # no rows to gather from: every index adds nothing
        col = idx[:, i].long()
        valid = ((col >= 0) & (col < experts)).unsqueeze(1)
        gathered = gemm2_permuted[col.clamp(min=0, max=max(experts - 1, 0))].to(F32)
        acc = torch.where(valid, acc + expert_weights[:, i : i + 1].to(F32) * gathered, acc)
    if shared_output is not None:
        acc = acc + shared_output.to(F32)
    return acc.to(BF16)


def add_shared(routed: Tensor, shared_output: Tensor | None) -> Tensor:
    """A rank's MoE partial from an already combined routed output: bf16(routed + shared)."""
    if shared_output is None:
        return routed
    return (routed.to(F32) + shared_output.to(F32)).to(BF16)


def mhc_post(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """R'[j] = bf16(post[j]*y + sum_k comb[k, j]*R[k]) for each stream j (CONTRACT §2 step 2)."""
    rows, hc, _ = residual.shape
    y32 = y.to(F32)
    r32 = residual.to(F32)
    post = post.reshape(rows, hc).to(F32)
    comb = comb.to(F32)
    out = torch.empty_like(residual)
    for j in range(hc):
        acc = post[:, j : j + 1] * y32
        for k in range(hc):
            acc = acc + comb[:, k, j : j + 1] * r32[:, k]
        out[:, j] = acc.to(BF16)
    return out


def collapse(residual: Tensor, pre: Tensor) -> Tensor:
    """c = bf16(sum_j pre[j] * R[j]), j in order 0..hc-1 (CONTRACT §2 step 3)."""
    rows, hc, _ = residual.shape
    pre = pre.reshape(rows, hc).to(F32)
    r32 = residual.to(F32)
    acc = pre[:, 0:1] * r32[:, 0]
    for j in range(1, hc):
        acc = acc + pre[:, j : j + 1] * r32[:, j]
    return acc.to(BF16)


def rms_norm(c: Tensor, weight: Tensor, eps: float) -> Tensor:
    """out = bf16(c * rsqrt(sum c^2 / H + eps) * w) over the bf16 values of c (CONTRACT §2 steps 4-5)."""
    c32 = c.to(F32)
    inv = torch.rsqrt(row_square_sums(c32.reshape(-1, c.shape[-1])).view(*c.shape[:-1], 1) / c.shape[-1] + eps)
    return (c32 * inv * weight.to(F32)).to(BF16)


def mean_of_streams(residual: Tensor) -> Tensor:
    """aux = bf16((sum_j R[j]) / hc), the mean of the streams that draft heads read."""
    r32 = residual.to(F32)
    acc = r32[:, 0]
    for j in range(1, residual.shape[1]):
        acc = acc + r32[:, j]
    return (acc / residual.shape[1]).to(BF16)


def swizzled_scale_offsets(num_tokens: int, hidden_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Byte offset of scale (m, k) in the swizzled 128x4 layout, as a [num_tokens, H/32] int64 tensor."""
    cols = hidden_size // MXFP8_BLOCK
    kp = -(-cols // 4) * 4
    m = torch.arange(num_tokens, device=device).unsqueeze(1)
    k = torch.arange(cols, device=device).unsqueeze(0)
    return (m // 128) * 128 * kp + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def e8m0_round_up(descale: Tensor) -> Tensor:
    """The biased E8M0 exponent: the smallest E with 2^(E-127) >= descale; 0 at or below 2^-127.

    Inf gives 254 and NaN 255. Computed from the fp32 bits, so it is exact for every input.
    """
    bits = descale.to(F32).view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # A normal value 2^(e-127) * 1.m needs e when m == 0, else e + 1. A subnormal below 2^-127
    # (mantissa <= 0x400000) needs 0, one above needs 1.
    normal = exponent + (mantissa != 0).to(torch.int32)
    subnormal = (mantissa > 0x400000).to(torch.int32)
    e = torch.where(exponent == 0, subnormal, normal).clamp(max=254)
    e = torch.where(exponent == 0xFF, torch.where(mantissa == 0, 254, 255), e)
    return e.to(torch.uint8)


def mxfp8_quantize(out: Tensor) -> tuple[Tensor, Tensor]:
    """MXFP8 of a [T, H] bf16 tensor (CONTRACT §4): e4m3 data [T, H] and swizzled 128x4 E8M0 scales."""
    rows, hidden = out.shape
    blocks = out.to(F32).reshape(rows, hidden // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1)
    amax = torch.where(blocks.isnan().any(-1), torch.full_like(amax, float("nan")), amax)
    e = e8m0_round_up(amax / E4M3_MAX)
    e32 = e.to(torch.int32)
    # 2^(127-E) built from its bits: E in 1..253 is normal, 254 is the subnormal 2^-127.
    normal_bits = ((254 - e32).clamp(min=1) << 23).view(F32)
    multiplier = torch.where(e32 == 254, torch.full_like(normal_bits, 2.0**-127), normal_bits)
    multiplier = torch.where(e32 == 0, torch.ones_like(multiplier), multiplier)
    multiplier = torch.where(e32 == 255, torch.full_like(multiplier, float("nan")), multiplier)
    scaled = (blocks * multiplier.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    data = scaled.reshape(rows, hidden).to(torch.float8_e4m3fn)
    scale = torch.zeros(mxfp8_scale_bytes(rows, hidden), dtype=torch.uint8, device=out.device)
    scale[swizzled_scale_offsets(rows, hidden, out.device).reshape(-1)] = e.reshape(-1)
    return data, scale


def fp8_group_scale_rows(num_tokens: int) -> int:
    """T_pad: the rows of one column of 1x128 scales, T rounded up to a multiple of 4 (16-byte aligned columns)."""
    return -(-num_tokens // 4) * 4


def ceil_to_ue8m0(sf: Tensor) -> Tensor:
    """A finite positive fp32 scale rounded up to a power of two from its bits: exponent + 1 if the mantissa is
    non-zero, clamped to [1, 254]; NaN and Inf pass through (as torch's pow(2, ceil(log2(sf))) gives them)."""
    bits = sf.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    e = (exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)
    return torch.where(sf.isfinite(), (e << 23).view(F32), sf)


def fp8_group_quantize(out: Tensor, *, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """FP8 1x128 of a [T, H] bf16 tensor (CONTRACT §4b): e4m3 data [T, H] and fp32 scales [H/128, T_pad], column-major
    (scale[g, t] for token t, group g); the padding columns are 0."""
    rows, hidden = out.shape
    groups = out.to(F32).reshape(rows, hidden // FP8_GROUP, FP8_GROUP)
    amax = groups.abs().amax(-1).clamp(min=1e-4)  # NaN propagates through both
    # Tensor divisors: a CUDA division by a Python scalar multiplies by its reciprocal, which is not IEEE division.
    sf = amax / torch.full_like(amax, E4M3_MAX)
    if ue8m0:
        sf = ceil_to_ue8m0(sf)
    inverse = torch.ones_like(sf) / sf
    data = (groups * inverse.unsqueeze(-1)).reshape(rows, hidden).to(torch.float8_e4m3fn)
    scale = torch.zeros(hidden // FP8_GROUP, fp8_group_scale_rows(rows), dtype=F32, device=out.device)
    scale[:, :rows] = sf.t()
    return data, scale


def quantize_into(out: Tensor, data: Tensor, scale: Tensor, form: str) -> None:
    """Write the quantized form `form` ("mxfp8", "fp8_1x128" or "fp8_1x128_ue8m0") of a [T, H] bf16 tensor into
    `data` and `scale` (the layouts of mxfp8_quantize / fp8_group_quantize)."""
    if form == "mxfp8":
        q, sf = mxfp8_quantize(out)
    else:
        q, sf = fp8_group_quantize(out, ue8m0=form == "fp8_1x128_ue8m0")
    data.copy_(q)
    scale.copy_(sf)


class BoundaryResult(NamedTuple):
    """What one boundary produces: the new streams and, unless residual-only, the next input."""

    residual: Tensor
    layer_input: Tensor | None
    mxfp8: tuple[Tensor, Tensor] | None
    aux: Tensor | None
    fp8_group: tuple[Tensor, Tensor] | None = None


def boundary(
    y: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor | None,
    norm_weight: Tensor | None,
    norm_eps: float,
    *,
    mxfp8: bool = False,
    aux: bool = False,
    fp8_group: bool = False,
    ue8m0: bool = False,
) -> BoundaryResult:
    """CONTRACT §2 steps 2-6 on an already reduced y; residual-only when pre is None. `fp8_group`: the FP8 1x128
    form too (§4b; `ue8m0`: power-of-two scales)."""
    new_residual = mhc_post(y, residual, post, comb)
    mean = mean_of_streams(new_residual) if aux else None
    if pre is None:
        return BoundaryResult(new_residual, None, None, mean)
    layer_input = rms_norm(collapse(new_residual, pre), norm_weight, norm_eps)
    quantized = mxfp8_quantize(layer_input) if mxfp8 else None
    grouped = fp8_group_quantize(layer_input, ue8m0=ue8m0) if fp8_group else None
    return BoundaryResult(new_residual, layer_input, quantized, mean, grouped)


class Coefficients(NamedTuple):
    """The mixes of one sublayer: post [T, hc], comb [T, hc, hc] (src, dst) and pre [T, hc]."""

    post: Tensor
    comb: Tensor
    pre: Tensor


def coefficients(x: Tensor, params: MHCParams) -> Coefficients:
    """post, comb and pre from a [T, K] projection input (CONTRACT §3); the RMS is over K columns.

    Pass the streams flattened to [T, hc*H] with `fn`, or the first layer's embedding [T, H]
    with `fn_broadcast`. Batch invariant on the CPU too: each row's dot products and sum of squares are reductions of
    their own (`row_dots`), the rest runs in blocks of rows of one shape (`in_row_blocks`).
    """
    xf = x.to(F32)
    sums = torch.cat([row_dots(xf, params.fn), row_square_sums(xf)], 1)
    return in_row_blocks(_mixes_of_sums, sums, params, x.shape[1])


def _mixes_of_sums(sums: Tensor, params: MHCParams, width: int) -> Coefficients:
    """`coefficients` from each row's 24 dot products and its sum of squares ([T, 25])."""
    _, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, sinkhorn_repeat = params
    rows = sums.shape[0]
    mixes = sums[:, :MIX_WIDTH] * torch.rsqrt(sums[:, MIX_WIDTH:] / width + rms_eps)
    scale = scale.to(F32)
    base = base.to(F32)
    pre = torch.sigmoid(mixes[:, 0:HC] * scale[0] + base[0:HC]) + pre_eps
    post = torch.sigmoid(mixes[:, HC : 2 * HC] * scale[1] + base[HC : 2 * HC]) * post_mult
    logits = (mixes[:, 2 * HC :] * scale[2] + base[2 * HC :]).reshape(rows, HC, HC)
    comb = torch.softmax(logits, dim=-1) + sinkhorn_eps
    comb = comb / (comb.sum(-2, keepdim=True) + sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + sinkhorn_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + sinkhorn_eps)
    return Coefficients(post, comb, pre)


def mhc_coefficients(
    x: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    post_mult: float,
    sinkhorn_repeat: int,
) -> Coefficients:
    """`coefficients` with the parameters spelled out."""
    return coefficients(x, MHCParams(fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, sinkhorn_repeat))


def one_hot_pre(rows: int, hc: int = HC, device: torch.device | str = "cpu") -> Tensor:
    """The first layer's identity pre-mix [1, 0, 0, 0] per row: the collapse is stream 0 exactly."""
    pre = torch.zeros(rows, hc, dtype=F32, device=device)
    pre[:, 0] = 1.0
    return pre


def pre_delayed(
    residual: Tensor,
    params: MHCParams,
    pre_mix: Tensor | None = None,
    x: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(post, comb, layer_input, next_pre): mixes from the streams, collapse with the carried pre_mix.

    The projection reads `x` when given (the first layer's embedding with fn_broadcast), else the
    streams. Without `pre_mix` the collapse is stream 0 exactly (the one-hot pre).
    """
    rows, hc, hidden = residual.shape
    coeffs = coefficients(x if x is not None else residual.reshape(rows, hc * hidden), params)
    c = residual[:, 0].clone() if pre_mix is None else collapse(residual, pre_mix)
    layer_input = c if norm_weight is None else rms_norm(c, norm_weight, norm_eps)
    return coeffs.post, coeffs.comb, layer_input, coeffs.pre


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
    """`pre_delayed` with the parameters spelled out (the CONTRACT §5 signature)."""
    params = MHCParams(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    return pre_delayed(residual, params, pre_mix, x, norm_weight, norm_eps)


def final_collapse(residual: Tensor, pre: Tensor, norm_weight: Tensor, norm_eps: float) -> Tensor:
    """The model's last step before the LM head: RMSNorm(collapse(streams, last pre))."""
    return rms_norm(collapse(residual, pre), norm_weight, norm_eps)


# --- The DeepSeek-V4 scheme (own pre) and hc_head: SPEC §4d, DeepSeek's model.py (hc_pre, hc_post, ParallelHead.hc_head)


class V4Boundary(NamedTuple):
    """What a V4 boundary produces: the new streams, the mixes computed from them (post and comb carried to the next
    boundary, pre used at once) and the next sublayer's input."""

    residual: Tensor
    post: Tensor
    comb: Tensor
    pre: Tensor
    layer_input: Tensor


def v4_enter(
    residual: Tensor, params: MHCParams, norm_weight: Tensor, norm_eps: float, x: Tensor | None = None
) -> V4Boundary:
    """A V4 sublayer's entry on streams R: the mixes of R (the projection reads `x` when given: the first layer's
    embedding with fn_broadcast), then the layer input RMSNorm(bf16(sum_j pre[j] * R[j])) with that very pre."""
    rows, hc, hidden = residual.shape
    coeffs = coefficients(x if x is not None else residual.reshape(rows, hc * hidden), params)
    layer_input = rms_norm(collapse(residual, coeffs.pre), norm_weight, norm_eps)
    return V4Boundary(residual, coeffs.post, coeffs.comb, coeffs.pre, layer_input)


def v4_boundary(
    y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, params: MHCParams, norm_weight: Tensor, norm_eps: float
) -> V4Boundary:
    """A V4 boundary on an already reduced y (SPEC §4d steps 2-4): R' = bf16(post * y + comb^T R) with the carried
    mixes, then the next sublayer's entry on R' (its own mixes, its own-pre collapse, its norm)."""
    return v4_enter(mhc_post(y, residual, post, comb), params, norm_weight, norm_eps)


def hc_head_mix(residual: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float) -> Tensor:
    """V4's hc_head weights p [T, hc] = sigmoid(scale * (fn . x) * rsqrt(mean(x^2) + rms_eps) + base) + hc_eps, x the
    streams flattened to hc*H in fp32, `fn` [hc, hc*H], one `scale`, `base` [hc] (batch invariant as `coefficients`)."""
    rows, hc, hidden = residual.shape
    xf = residual.reshape(rows, hc * hidden).to(F32)
    sums = torch.cat([row_dots(xf, fn), row_square_sums(xf)], 1)
    return in_row_blocks(_head_mix_of_sums, sums, scale, base, rms_eps, hc_eps, hc * hidden)


def _head_mix_of_sums(sums: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float, width: int) -> Tensor:
    """`hc_head_mix` from each row's hc dot products and its sum of squares ([T, hc + 1])."""
    r = torch.rsqrt(sums[:, -1:] / width + rms_eps)
    return torch.sigmoid(sums[:, :-1] * r * scale.to(F32).reshape(()) + base.to(F32)) + hc_eps


def hc_head(residual: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float) -> Tensor:
    """V4's hc_head: h = bf16(sum_i p_i * R_i) with p = `hc_head_mix`; the final RMSNorm (`rms_norm`) follows it."""
    return collapse(residual, hc_head_mix(residual, fn, scale, base, rms_eps, hc_eps))
