"""The FP8 1x128 layer input (CONTRACT §4b): the reference's bytes against a plain numpy restatement of the rule,
special groups, both scale modes, the layout, and the boundary and scheduler that write it."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    Fp8GroupActivation,
    empty_fp8_group_layer_input,
    empty_quantized_layer_input,
)
from boundary import reference as ref
from boundary.toy import ToyConfig, ToyModel, random_tokens
from tests.bf16 import bitwise_equal
from tests.inputs import boundary_inputs

BF16 = torch.bfloat16
SMALL = ToyConfig(hidden_size=512, num_layers=2, vocab=64)


def e4m3_positive_values() -> np.ndarray:
    """The values of the e4m3fn codes 0..126 (bias 7, 3 mantissa bits, subnormals below 2^-6), increasing."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)


E4M3 = e4m3_positive_values()


def to_e4m3_bytes(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 values to e4m3fn bytes: ties to the even code, NaN 0x7f with the value's
    sign, past the 448 / NaN midpoint (464) NaN."""
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = np.abs(a - E4M3[lo]), np.abs(E4M3[hi] - a)
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a > 464, 0x7F, code)
    code = np.where(np.isnan(v), 0x7F, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def pow2_ceil(sf: np.float32) -> np.float32:
    """The smallest power of two >= a finite positive sf (frexp: sf = m * 2^e, 0.5 <= m < 1); NaN, Inf unchanged."""
    if not math.isfinite(sf):
        return sf
    m, e = math.frexp(float(sf))
    return np.float32(sf if m == 0.5 else 2.0**e)


def restated(out: torch.Tensor, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """CONTRACT §4b element by element in numpy float32: (data bytes [T, H], sf [T, H/128])."""
    x = out.float().numpy()
    rows, hidden = x.shape
    data = np.empty((rows, hidden), dtype=np.uint8)
    sfs = np.empty((rows, hidden // 128), dtype=np.float32)
    for t in range(rows):
        for g in range(hidden // 128):
            group = x[t, g * 128 : (g + 1) * 128]
            amax = np.float32(np.nan) if np.isnan(group).any() else np.abs(group).max()
            amax = amax if np.isnan(amax) or amax > np.float32(1e-4) else np.float32(1e-4)
            sf = np.float32(amax) / np.float32(448.0)
            if ue8m0:
                sf = pow2_ceil(sf)
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                q = group * (np.float32(1.0) / sf)
            data[t, g * 128 : (g + 1) * 128] = to_e4m3_bytes(q.astype(np.float32))
            sfs[t, g] = sf
    return data, sfs


def special_rows(hidden: int) -> torch.Tensor:
    """Rows whose groups hold NaN, +/-Inf, all zeros, tiny values (amax below 1e-4, subnormal bf16), a power-of-two
    amax, values near bf16's largest, and ordinary data at assorted magnitudes."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(hidden, generator=g) * 10.0 ** torch.randint(-6, 6, (1,), generator=g).item() for _ in range(3)]
    special = torch.randn(hidden, generator=g)
    groups = special.view(-1, 128)
    cases = [
        lambda v: v.index_fill_(0, torch.tensor([5]), float("nan")),
        lambda v: v.index_fill_(0, torch.tensor([9]), float("inf")),
        lambda v: v.index_fill_(0, torch.tensor([0]), float("-inf")),
        lambda v: v.zero_(),
        lambda v: v.mul_(1e-7),
        lambda v: v.fill_(1e-40),
        lambda v: v.clamp_(-1, 1).index_fill_(0, torch.tensor([3]), 448.0 * 2.0**-3),
        lambda v: v.mul_(1e37),
    ]
    for i, case in enumerate(cases):
        case(groups[i % groups.shape[0]])
        if (i + 1) % groups.shape[0] == 0:
            rows.append(special.clone())
            special = torch.randn(hidden, generator=g)
            groups = special.view(-1, 128)
    rows.append(special)
    return torch.stack(rows).to(BF16)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("rows,hidden", [(1, 128), (3, 512), (4, 384), (5, 1024), (9, 256)])
def test_the_bytes_match_the_restated_rule(rows: int, hidden: int, ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    out = (torch.randn(rows, hidden, generator=g) * torch.rand(rows, 1, generator=g) * 30).to(BF16)
    data, scale = ref.fp8_group_quantize(out, ue8m0=ue8m0)
    want_data, want_sf = restated(out, ue8m0)
    t_pad = -(-rows // 4) * 4
    assert data.dtype == torch.float8_e4m3fn and data.shape == (rows, hidden)
    assert scale.dtype == torch.float32 and scale.shape == (hidden // 128, t_pad) and scale.is_contiguous()
    assert np.array_equal(data.view(torch.uint8).numpy(), want_data)
    assert np.array_equal(scale[:, :rows].t().numpy().view(np.uint32), want_sf.view(np.uint32))
    assert torch.all(scale[:, rows:] == 0), "the padding columns are 0"


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_special_groups_follow_the_formula_as_torch_evaluates_it(ue8m0: bool) -> None:
    out = special_rows(1024)
    data, scale = ref.fp8_group_quantize(out, ue8m0=ue8m0)
    want_data, want_sf = restated(out, ue8m0)
    got = data.view(torch.uint8).numpy()
    assert np.array_equal(got, want_data)
    sf = scale[:, : out.shape[0]].t().numpy()
    assert np.array_equal(np.isnan(sf), np.isnan(want_sf))
    assert np.array_equal(sf[~np.isnan(sf)], want_sf[~np.isnan(want_sf)])
    # What CONTRACT §4b says of each special group, read off the bytes.
    x = out.float().view(out.shape[0], -1, 128)
    bytes_ = data.view(torch.uint8).view(out.shape[0], -1, 128)
    is_nan = (bytes_ & 0x7F) == 0x7F
    nan_group = x.isnan().any(-1)
    inf_group = x.isinf().any(-1) & ~nan_group
    assert nan_group.any() and inf_group.any()
    assert torch.all(is_nan[nan_group]) and torch.all(torch.from_numpy(sf.copy()).isnan()[nan_group])
    assert torch.all(torch.from_numpy(sf.copy()).isinf()[inf_group])
    inf_rows = bytes_[inf_group]
    assert torch.equal(is_nan[inf_group], x[inf_group].isinf()), "the Inf element becomes NaN"
    assert torch.all((inf_rows[~x[inf_group].isinf()] & 0x7F) == 0), "the rest of an Inf group is 0"
    zero = (x == 0).all(-1)
    assert zero.any() and torch.all(bytes_[zero] == 0)
    finite = sf[np.isfinite(sf)]
    assert finite.min() >= np.float32(1e-4) / np.float32(448) if not ue8m0 else finite.min() > 0
    if ue8m0:
        mantissa = finite.view(np.uint32) & 0x7FFFFF
        assert np.all(mantissa == 0), "ue8m0 scales are powers of two"


def test_ue8m0_rounds_the_scale_up_from_its_bits() -> None:
    sf = torch.tensor([1.0, 1.5, 2.0**-20, 3.0 * 2.0**-22, 2.0**100 * 1.0000001, float("inf"), float("nan")])
    got = ref.ceil_to_ue8m0(sf)
    assert got[:5].tolist() == [1.0, 2.0, 2.0**-20, 2.0**-20, 2.0**101]
    assert got[5] == float("inf") and got[6].isnan()


def test_the_gemm_view_is_column_major_and_tma_aligned() -> None:
    q = empty_fp8_group_layer_input(5, 512, "cpu", ue8m0=True)
    assert isinstance(q, Fp8GroupActivation) and q.ue8m0 and q.quant_key == "fp8_e4m3_ue8m0_1x128_colmajor"
    assert q.scale.shape == (4, 8) and q.data.shape == (5, 512) and q.orig_shape == (5, 512)
    view = q.gemm_scale
    assert view.shape == (5, 4) and view.stride() == (1, 8) and view.data_ptr() == q.scale.data_ptr()
    assert (view.stride(1) * 4) % 16 == 0, "each column of scales starts 16-byte aligned"
    plain = empty_fp8_group_layer_input(3, 256, "cpu")
    assert not plain.ue8m0 and plain.quant_key == "fp8_e4m3_fp32_1x128_colmajor" and plain.scale.shape == (2, 4)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((4, 200, "cpu"), ValueError, "hidden_size must be a positive multiple of 128"),
        ((0, 256, "cpu"), ValueError, "num_tokens must be a positive int"),
        ((4, 256, "cpu", 1), TypeError, "ue8m0 must be a bool"),
    ],
)
def test_empty_fp8_group_layer_input_checks_its_arguments(args: tuple, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        empty_fp8_group_layer_input(*args)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_the_boundary_writes_it_beside_mxfp8(ue8m0: bool) -> None:
    rows, hidden = 3, 512
    inp = boundary_inputs(rows, hidden, seed=1)
    ar = BoundaryAllReduce(hidden, max_rows=4, device="cpu")
    fp8 = empty_fp8_group_layer_input(rows, hidden, "cpu", ue8m0=ue8m0)
    mx = empty_quantized_layer_input(rows, hidden, "cpu")
    args = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6)
    new, x = ar(inp["x"], *args, mx, fp8_out=fp8)
    data, scale = ref.fp8_group_quantize(x, ue8m0=ue8m0)
    assert bitwise_equal(fp8.data, data) and bitwise_equal(fp8.scale, scale)
    mx_data, mx_scale = ref.mxfp8_quantize(x)
    assert bitwise_equal(mx.data, mx_data) and bitwise_equal(mx.scale, mx_scale)
    plain_new, plain_x = ar(inp["x"], *args, None)
    assert bitwise_equal(new, plain_new) and bitwise_equal(x, plain_x)
    with pytest.raises(ValueError, match="takes no norm_weight, no mxfp8_out and no fp8_out"):
        ar(inp["x"], inp["residual"], inp["post"], inp["comb"], None, None, 0.0, None, fp8_out=fp8)
    with pytest.raises(TypeError, match="fp8_out must be an Fp8GroupActivation or None, got QuantizedActivation"):
        ar(inp["x"], *args, None, fp8_out=mx)
    with pytest.raises(
        ValueError, match=r"fp8_out.quant_key is 'fp8_e4m3_ue8m0_1x128_colmajor' but fp8_out.ue8m0 is Fals"
    ):
        ue8m0_key = "fp8_e4m3_ue8m0_1x128_colmajor"  # a GEMM would read the plain scales as powers of two
        ar(inp["x"], *args, None, fp8_out=Fp8GroupActivation(fp8.data, fp8.scale, BF16, fp8.orig_shape, ue8m0_key))
    with pytest.raises(ValueError, match=r"fp8_out.scale must have shape \[4, 4\]"):
        ar(
            inp["x"],
            *args,
            None,
            fp8_out=Fp8GroupActivation(fp8.data, fp8.scale[:, :3].contiguous(), BF16, fp8.orig_shape, fp8.quant_key),
        )


def offset_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A contiguous tensor with t's shape and dtype whose data starts `nbytes` past a 16-byte boundary."""
    raw = torch.zeros(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    return raw[nbytes : nbytes + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def test_the_kernel_path_refuses_scale_buffers_its_stores_would_fault_on() -> None:
    """The kernel writes the FP8 1x128 scales with 16-byte stores and the MXFP8 scale bytes a 4-byte word at a time:
    on the kernel path a buffer starting off those boundaries is a ValueError naming it, before any launch (a misaligned
    store would end the CUDA context); the torch path takes any address."""
    rows, hidden = 3, 512
    inp = boundary_inputs(rows, hidden, seed=1)
    args = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6)
    fp8 = empty_fp8_group_layer_input(rows, hidden, "cpu")
    mx = empty_quantized_layer_input(rows, hidden, "cpu")
    fp8_off = Fp8GroupActivation(fp8.data, offset_view(fp8.scale, 4), BF16, fp8.orig_shape, fp8.quant_key)
    mx_off = dataclasses.replace(mx, scale=offset_view(mx.scale, 1))
    ar = BoundaryAllReduce(hidden, max_rows=4, device="cpu")
    _, x = ar(inp["x"], *args, mx_off, fp8_out=fp8_off)  # the torch path
    data, scale = ref.fp8_group_quantize(x, ue8m0=False)
    assert bitwise_equal(fp8_off.scale, scale) and bitwise_equal(mx_off.scale, ref.mxfp8_quantize(x)[1])
    ar.arch = "sm_90a"  # the kernel path's checks (the kernel itself needs a GPU)
    with pytest.raises(ValueError, match=r"fp8_out.scale must start on a 16-byte boundary \(got address 0x"):
        ar(inp["x"], *args, None, fp8_out=fp8_off)
    with pytest.raises(ValueError, match=r"mxfp8_out.scale must start on a 4-byte boundary"):
        ar(inp["x"], *args, mx_off)
    # What the stores need, no more: a 4-byte offset suits the MXFP8 words, a 16-byte one the FP8 scales.
    mx_word = dataclasses.replace(mx, scale=offset_view(mx.scale, 4))
    fp8_16 = Fp8GroupActivation(fp8.data, offset_view(fp8.scale, 16), BF16, fp8.orig_shape, fp8.quant_key)
    ar._check_epilogue(rows, *args[1:], mx_word, None, fp8_16)


@pytest.mark.parametrize("quantize", ["fp8_1x128", "fp8_1x128_ue8m0"])
def test_sublayer_returns_the_fp8_1x128_form(quantize: str) -> None:
    model = ToyModel(SMALL)
    b = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu"))
    rows = 5
    step = DecodeStep.for_rows(rows)
    state, x = b.first(model.layers[0], model.embed[random_tokens(model, rows, 0)], step)
    state.pending = model.attention(model.layers[0], x)
    pending = state.pending
    new_state, x, q, _ = b.sublayer(model.layers[0], True, state, step, quantize=quantize)
    assert isinstance(q, Fp8GroupActivation) and q.ue8m0 is (quantize == "fp8_1x128_ue8m0")
    data, scale = ref.fp8_group_quantize(x, ue8m0=q.ue8m0)
    assert bitwise_equal(q.data, data) and bitwise_equal(q.scale, scale)
    state.pending = pending  # the same boundary without the FP8 form gives the same bf16 bits
    _, plain_x, none, _ = b.sublayer(model.layers[0], True, state, step)
    assert none is None and bitwise_equal(x, plain_x)


def _round_f32(value: Fraction) -> np.float32:
    """value rounded to the nearest fp32 (ties to even), exactly: the nearest of the three fp32 around its float."""
    guess = np.float32(float(value))
    candidates = (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.array(c).view(np.uint32)) & 1))


def test_the_kernels_quotient_is_ieee_division_for_every_amax() -> None:
    """The kernel divides a group's amax by 448 with a multiply and one FMA correction (quant.amax_over_e4m3_max),
    not div.rn: for every value the amax can take (a bf16 value >= 1e-4, or the fp32 floor 1e-4) the two FMAs,
    emulated with exact rational arithmetic, give the IEEE quotient the rule asks for."""
    magnitudes = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    amaxes = np.concatenate([magnitudes[magnitudes >= np.float32(1e-4)], [np.float32(1e-4)]])
    r = np.float32(1.0) / np.float32(448.0)
    wrong = []
    for a in amaxes:
        q0 = np.float32(a * r)  # one fp32 rounding
        residual = _round_f32(Fraction(float(a)) - Fraction(float(q0)) * 448)  # fma(-q0, 448, a)
        q = _round_f32(Fraction(float(residual)) * Fraction(float(r)) + Fraction(float(q0)))  # fma(residual, r, q0)
        if q != np.divide(a, np.float32(448.0), dtype=np.float32):
            wrong.append(float(a))
    assert len(amaxes) > 18_000 and not wrong, f"{len(wrong)} amax values miss the IEEE quotient: {wrong[:5]}"


def test_the_kernels_reciprocal_is_rcp_rn_for_every_scale() -> None:
    """The kernel takes 1/sf by rcp.approx and one Newton FMA (quant.Fp8GroupWriter.scale), not rcp.rn. rcp.approx
    is within 2^-23 of 1/sf (the PTX ISA), so the refined value before its one rounding lies within 1.5 * 2^-46 of
    1/sf (the error squared, plus the rounding of the residual): it rounds as 1/sf does wherever 1/sf lies farther
    than that from an fp32 rounding midpoint. No scale the rule can make (amax / 448 for every amax above) comes
    within 2^-44 of one, checked with exact rational arithmetic; ue8m0 scales are powers of two, whose reciprocals
    are exact."""
    magnitudes = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    amaxes = np.concatenate([magnitudes[magnitudes >= np.float32(1e-4)], [np.float32(1e-4)]])
    close = []
    for a in amaxes:
        sf = np.divide(a, np.float32(448.0), dtype=np.float32)  # the kernel's sf (the test above)
        exact = 1 / Fraction(float(sf))
        below = np.float32(float(exact))
        if Fraction(float(below)) > exact:
            below = np.nextafter(below, np.float32(0))
        midpoint = (Fraction(float(below)) + Fraction(float(np.nextafter(below, np.float32(np.inf))))) / 2
        if abs(exact - midpoint) <= exact / 2**44:
            close.append(float(sf))
    assert len(amaxes) > 18_000 and not close, f"{len(close)} scales lie near a rounding midpoint: {close[:5]}"
