"""The reference math of CONTRACT §2-§4 against float64 oracles, and its rounding contract."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from boundary import reference as ref
from tests.bf16 import bitwise_equal, max_ulp

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def coefficients(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Realistic post (0, 2), comb with rows from a softmax, pre (0, 1)."""
    g = gen(seed)
    post = torch.rand(rows, 4, generator=g) * 2
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g), -1)
    pre = torch.rand(rows, 4, generator=g)
    return post, comb, pre


def streams(rows: int, hidden: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, 4, hidden, generator=gen(seed)).to(BF16)


# --- CONTRACT §2 step 1: the rank-order sum ------------------------------------------------------


def test_rank_sum_matches_float64_sum_rounded_once() -> None:
    parts = [torch.randn(5, 512, generator=gen(r)).to(BF16) for r in range(8)]
    exact = sum(p.to(F64) for p in parts).to(BF16)
    assert bitwise_equal(ref.rank_sum(parts), exact)


def test_rank_sum_adds_in_rank_order() -> None:
    # fp32(2^24 + 1) rounds back to 2^24, so rank order 0, 1, 2 gives 0 where another order gives 1.
    a, b, c = (torch.full((1, 256), v, dtype=BF16) for v in (2.0**24, 1.0, -(2.0**24)))
    assert torch.all(ref.rank_sum([a, b, c]) == 0)
    assert torch.all(ref.rank_sum([b, c, a]) == 1)


# --- CONTRACT §2 steps 2-5 -------------------------------------------------------------------------


def test_mhc_post_against_float64() -> None:
    rows, hidden = 7, 1024
    post, comb, _ = coefficients(rows)
    residual = streams(rows, hidden)
    y = torch.randn(rows, hidden, generator=gen(3)).to(BF16)
    got = ref.mhc_post(y, residual, post, comb)
    oracle = post.to(F64).unsqueeze(-1) * y.to(F64).unsqueeze(1) + torch.einsum(
        "tkj,tkh->tjh", comb.to(F64), residual.to(F64)
    )
    assert max_ulp(got, oracle.to(BF16)) <= 1
    assert got.dtype == BF16 and got.shape == residual.shape


def test_mhc_post_accepts_post_with_trailing_one() -> None:
    post, comb, _ = coefficients(3)
    residual, y = streams(3, 256), torch.randn(3, 256).to(BF16)
    assert bitwise_equal(ref.mhc_post(y, residual, post.unsqueeze(-1), comb), ref.mhc_post(y, residual, post, comb))


def test_collapse_and_rms_norm_against_float64() -> None:
    rows, hidden = 9, 2048
    _, _, pre = coefficients(rows)
    residual = streams(rows, hidden)
    c = ref.collapse(residual, pre)
    c_oracle = (pre.to(F64).unsqueeze(-1) * residual.to(F64)).sum(1)
    assert max_ulp(c, c_oracle.to(BF16)) <= 1
    w = (1 + 0.1 * torch.randn(hidden, generator=gen(5))).to(BF16)
    out = ref.rms_norm(c, w, 1e-6)
    c64 = c.to(F64)
    oracle = c64 * torch.rsqrt((c64 * c64).mean(-1, keepdim=True) + 1e-6) * w.to(F64)
    assert max_ulp(out, oracle.to(BF16)) <= 1


def test_collapse_is_rounded_to_bf16_before_the_norm() -> None:
    # pre = [1, 0.003, 0, 0] on streams of ones gives a collapse of 1.003, which bf16 rounds to 1.0.
    hidden = 256
    residual = torch.zeros(1, 4, hidden, dtype=BF16)
    residual[:, 0] = 1.0
    residual[:, 1] = 1.0
    pre = torch.tensor([[1.0, 0.003, 0.0, 0.0]])
    c = ref.collapse(residual, pre)
    assert torch.all(c == 1.0)
    # A large epsilon makes the norm sensitive to the collapse's scale: 1/sqrt(1 + eps) differs
    # from 1.003/sqrt(1.003^2 + eps) by more than a bf16 step.
    w, eps = torch.ones(hidden, dtype=BF16), 1000.0
    out = ref.boundary(
        torch.zeros(1, hidden, dtype=BF16), residual, torch.zeros(1, 4), torch.eye(4).unsqueeze(0), pre, w, eps
    ).layer_input
    assert torch.all(out == torch.tensor(1.0 / math.sqrt(1.0 + eps)).to(BF16))
    unrounded = torch.tensor(1.003 / math.sqrt(1.003**2 + eps)).to(BF16)
    assert not torch.all(out == unrounded)


def test_mean_of_streams_against_float64() -> None:
    residual = streams(6, 512)
    assert max_ulp(ref.mean_of_streams(residual), residual.to(F64).mean(1).to(BF16)) <= 1


def test_boundary_composes_the_steps() -> None:
    rows, hidden = 4, 512
    post, comb, pre = coefficients(rows)
    residual = streams(rows, hidden)
    y = torch.randn(rows, hidden).to(BF16)
    w = torch.ones(hidden, dtype=BF16)
    res = ref.boundary(y, residual, post, comb, pre, w, 1e-20, mxfp8=True, aux=True)
    new = ref.mhc_post(y, residual, post, comb)
    assert bitwise_equal(res.residual, new)
    assert bitwise_equal(res.layer_input, ref.rms_norm(ref.collapse(new, pre), w, 1e-20))
    assert bitwise_equal(res.aux, ref.mean_of_streams(new))
    data, scale = ref.mxfp8_quantize(res.layer_input)
    assert bitwise_equal(res.mxfp8[0], data) and bitwise_equal(res.mxfp8[1], scale)
    only = ref.boundary(y, residual, post, comb, None, None, 0.0)
    assert bitwise_equal(only.residual, new) and only.layer_input is None and only.mxfp8 is None


# --- MoE finalize ------------------------------------------------------------------------------


def test_moe_finalize_against_float64_with_missing_experts() -> None:
    rows, top_k, hidden = 5, 6, 512
    g = gen(7)
    permuted = torch.randn(rows * top_k + 3, hidden, generator=g).to(BF16)
    permuted[-3:] = float("nan")  # rows no index points at must never be read
    weights = torch.rand(rows, top_k, generator=g)
    idx = torch.randperm(rows * top_k, generator=g).to(torch.int32).view(rows, top_k)
    idx[0, 1] = idx[2, 0] = idx[4, 5] = -1
    idx[3] = -1  # a row with no expert at all: only the shared output
    shared = torch.randn(rows, hidden, generator=g).to(BF16)
    got = ref.moe_finalize(permuted, weights, idx, shared)
    oracle = shared.to(F64).clone()
    for t in range(rows):
        for i in range(top_k):
            if idx[t, i] >= 0:
                oracle[t] += weights[t, i].double() * permuted[idx[t, i]].to(F64)
    assert not got.isnan().any()
    assert max_ulp(got, oracle.to(BF16)) <= 1
    assert bitwise_equal(got[3], shared[3])
    no_shared = ref.moe_finalize(permuted, weights, idx, None)
    assert torch.all(no_shared[3] == 0)


# --- CONTRACT §3: the coefficients -----------------------------------------------------------------


def coefficients_float64(x, fn, scale, base, rms_eps, pre_eps, eps, post_mult, repeat):
    x, fn, scale, base = (t.to(F64) for t in (x, fn, scale, base))
    mixes = (x @ fn.t()) * torch.rsqrt((x * x).mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mixes[:, :4] * scale[0] + base[:4]) + pre_eps
    post = torch.sigmoid(mixes[:, 4:8] * scale[1] + base[4:8]) * post_mult
    c = torch.softmax((mixes[:, 8:] * scale[2] + base[8:]).view(-1, 4, 4), -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return post, c, pre


def mix_weights(width: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = gen(seed)
    return torch.randn(24, width, generator=g) * 0.01, torch.tensor([0.5, 0.6, 0.7]), torch.randn(24, generator=g) * 0.5


def test_coefficients_against_float64() -> None:
    rows, hidden = 6, 1024
    x = streams(rows, hidden).reshape(rows, -1)
    fn, scale, base = mix_weights(4 * hidden)
    got = ref.mhc_coefficients(x, fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    want = coefficients_float64(x, fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.to(F64), b, atol=1e-5, rtol=1e-5)
    assert got.post.shape == (rows, 4) and got.comb.shape == (rows, 4, 4) and got.pre.shape == (rows, 4)
    torch.testing.assert_close(got.comb.sum(1), torch.ones(rows, 4), atol=1e-4, rtol=0)


def test_broadcast_projection_equals_the_full_projection_on_identical_streams() -> None:
    rows, hidden = 3, 512
    e = torch.randn(rows, hidden).to(BF16)
    fn, scale, base = mix_weights(4 * hidden)
    full = ref.mhc_coefficients(e.repeat(1, 4), fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    broadcast = ref.mhc_coefficients(e, fn.view(24, 4, hidden).sum(1), scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    for a, b in zip(full, broadcast):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pre_delayed_collapses_with_the_carried_pre_not_its_own() -> None:
    rows, hidden = 4, 512
    residual = streams(rows, hidden)
    fn, scale, base = mix_weights(4 * hidden)
    w = (1 + 0.1 * torch.randn(hidden)).to(BF16)
    _, _, pre_mix = coefficients(rows, seed=9)
    post, comb, layer_input, next_pre = ref.mhc_pre_delayed(
        residual, fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20, pre_mix=pre_mix, norm_weight=w, norm_eps=1e-20
    )
    assert bitwise_equal(layer_input, ref.rms_norm(ref.collapse(residual, pre_mix), w, 1e-20))
    own = ref.mhc_coefficients(residual.reshape(rows, -1), fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    assert bitwise_equal(next_pre, own.pre) and bitwise_equal(post, own.post) and bitwise_equal(comb, own.comb)


def test_pre_delayed_without_pre_mix_collapses_to_stream_zero_exactly() -> None:
    rows, hidden = 3, 256
    residual = streams(rows, hidden)
    fn, scale, base = mix_weights(4 * hidden)
    _, _, layer_input, _ = ref.mhc_pre_delayed(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    assert bitwise_equal(layer_input, residual[:, 0])
    assert bitwise_equal(ref.collapse(residual, ref.one_hot_pre(rows)), residual[:, 0])


# --- CONTRACT §4: MXFP8 ----------------------------------------------------------------------------


def test_scale_bytes_and_layout() -> None:
    assert ref.mxfp8_scale_bytes(1, 4096) == 128 * 128
    assert ref.mxfp8_scale_bytes(129, 7168) == 256 * 224
    assert ref.mxfp8_scale_bytes(16, 2560) == 128 * 80
    assert ref.mxfp8_scale_bytes(1, 256 * 3) == 128 * 24  # 24 scale columns: no column padding
    assert ref.mxfp8_scale_bytes(1, 32 * 5) == 128 * 8  # 5 scale columns pad to 8
    off = ref.swizzled_scale_offsets(256, 4096)
    assert off[0, 0] == 0 and off[0, 1] == 1 and off[0, 4] == 512 and off[1, 0] == 16 and off[32, 0] == 4
    assert off[128, 0] == 128 * 128
    assert torch.unique(off.reshape(-1)).numel() == off.numel()


def test_e8m0_round_up_is_the_smallest_exponent_that_covers() -> None:
    g = gen(13)
    d = torch.cat(
        [
            torch.exp2(torch.randn(20000, generator=g, dtype=F64) * 50).to(F32),
            torch.exp2(torch.arange(-149, 128, dtype=F64)).to(F32),
            torch.tensor([0.0, 2.0**-127, 2.0**-127 * 1.000001, 2.0**-126, 2.0**127, 2.0**127 * 1.5, 3.0e38]),
        ]
    )
    d = d[torch.isfinite(d)]
    e = ref.e8m0_round_up(d).to(torch.int64)
    for value, got in zip(d.tolist(), e.tolist()):
        want = 0
        if value > 2.0**-127:
            want = 127 + math.ceil(math.log2(value))
            while 2.0 ** (want - 127) < value:  # guard against log2 rounding near powers of two
                want += 1
            while 2.0 ** (want - 128) >= value:
                want -= 1
            want = min(want, 254)
        assert got == want, (value, got, want)
    special = ref.e8m0_round_up(torch.tensor([float("inf"), float("nan")]))
    assert special.tolist() == [254, 255]


def mx_inputs(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 rows whose 32-blocks span a huge dynamic range, with every special block the contract names."""
    g = gen(seed)
    x = torch.randn(rows, hidden, generator=g, dtype=F64)
    x *= (
        torch.exp2(torch.randn(rows, hidden // 32, 1, generator=g, dtype=F64) * 30)
        .expand(-1, -1, 32)
        .reshape(rows, hidden)
    )
    x = x.to(BF16)
    specials = {
        0: 0.0,  # an all-zero block
        1: 1e-39,  # subnormal values: descale far below 2^-127
        2: 448 * 2.0**-127,  # descale exactly 2^-127: E = 0
        3: 448 * 2.0**-126,  # descale 2^-126: E = 1
        4: -0.0,
        5: 448.0,  # exactly the e4m3 max: E = 127
        6: 450.0,  # just above (bf16 step 2 here): E = 128
    }
    for block, value in specials.items():
        x[0, block * 32 : (block + 1) * 32] = value
    x[0, 7 * 32 + 3] = float("inf")
    x[0, 8 * 32 + 5] = float("-inf")
    x[0, 9 * 32 + 31] = float("nan")
    x[0, 10 * 32 : 11 * 32] = torch.linspace(-3e38, 3e38, 32)
    return x


@pytest.mark.parametrize("rows,hidden", [(1, 4096), (7, 2560), (130, 5120), (3, 7168), (2, 256 * 3)])
def test_mxfp8_matches_torchao_bit_for_bit(rows: int, hidden: int) -> None:
    torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.utils import to_blocked

    x = mx_inputs(rows, hidden, seed=rows + hidden)
    data, scale = ref.mxfp8_quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_scale, ao_data = torchao_mx.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    ao_blocked = to_blocked(ao_scale.view(torch.uint8).view(rows, hidden // 32)).flatten()
    assert bitwise_equal(scale, ao_blocked)
    ours, theirs = data.view(torch.uint8), ao_data.view(torch.uint8)
    nan = data.float().isnan()
    assert torch.equal(nan, ao_data.float().isnan())
    assert torch.equal(ours[~nan], theirs[~nan])
    # The contract's special blocks (CONTRACT §4), spelled out.
    e = scale[ref.swizzled_scale_offsets(rows, hidden)[0, :11]].tolist()
    assert e[0] == 0 and e[1] == 0 and e[2] == 0 and e[3] == 1 and e[5] == 127 and e[6] == 128
    assert e[7] == 254 and e[8] == 254 and e[9] == 255
    assert torch.all(nan[0, 9 * 32 : 10 * 32]) and torch.all(ours[0, 4 * 32 : 5 * 32] == 0x80)
    assert data[0, 7 * 32 + 3].float() == 448 and data[0, 8 * 32 + 5].float() == -448


def test_mxfp8_padding_bytes_are_zero() -> None:
    x = (torch.randn(5, 32 * 5) * 100).to(BF16)
    _, scale = ref.mxfp8_quantize(x)
    used = torch.zeros_like(scale, dtype=torch.bool)
    used[ref.swizzled_scale_offsets(5, 32 * 5).reshape(-1)] = True
    assert torch.all(scale[~used] == 0) and torch.all(scale[used] > 0)


def test_final_collapse() -> None:
    residual = streams(2, 512)
    _, _, pre = coefficients(2)
    w = torch.ones(512, dtype=BF16)
    assert bitwise_equal(
        ref.final_collapse(residual, pre, w, 1e-20), ref.rms_norm(ref.collapse(residual, pre), w, 1e-20)
    )


# --- CONTRACT §6: batch invariance of the CPU path -------------------------------------------------


@pytest.mark.parametrize("width", [1024, 4 * 7168])
def test_a_rows_mixes_do_not_depend_on_the_batch_or_the_thread_count(width: int) -> None:
    """The CPU path (one rank, and every gloo rank) computes the mixes here: a row's post, comb, pre and hc_head
    weights must be the same bits in any batch around it and at any thread count. A GEMM's blocking, or a vectorised
    sigmoid's body against its scalar tail, made them differ in the last bit with the row count."""
    g = gen(11)
    rows = 40
    x = (torch.randn(rows, width, generator=g) * 3).to(BF16)
    fn = torch.randn(24, width, generator=g) * 0.02
    params = ref.MHCParams(fn, torch.tensor([0.5, 0.4, 0.6]), torch.randn(24, generator=g), 1e-6, 1e-6, 1e-6, 2.0, 20)
    head = (fn[:4].contiguous(), torch.tensor([0.7]), torch.randn(4, generator=g), 1e-6, 1e-6)
    streams = x.view(rows, 4, width // 4)
    whole = (*ref.coefficients(x.float(), params), ref.hc_head_mix(streams, *head))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = (*ref.coefficients(x.float(), params), ref.hc_head_mix(streams, *head))
    finally:
        torch.set_num_threads(threads)
    assert all(bitwise_equal(a, b) for a, b in zip(whole, one_thread))
    for count in (1, 2, 3, 15, 16, 17, 33):
        for start in (0, rows - count):
            part = slice(start, start + count)
            alone = (*ref.coefficients(x[part].float(), params), ref.hc_head_mix(streams[part], *head))
            assert all(bitwise_equal(a[part], b) for a, b in zip(whole, alone)), (count, start)


def test_in_row_blocks_puts_tensors_and_tuples_back_and_refuses_what_it_cannot() -> None:
    x = torch.arange(40 * 3, dtype=F32).reshape(40, 3)
    assert torch.equal(ref.in_row_blocks(lambda b: b * 2, x), x * 2)
    a, b = ref.in_row_blocks(lambda blk: (blk + 1, blk[:, :1]), x)  # a plain tuple
    assert torch.equal(a, x + 1) and torch.equal(b, x[:, :1])
    named = ref.in_row_blocks(lambda blk: ref.Coefficients(blk, blk, blk), x[:5])
    assert isinstance(named, ref.Coefficients) and torch.equal(named.pre, x[:5])
    with pytest.raises(ValueError, match="rows first"):
        ref.in_row_blocks(lambda blk: blk.t(), x)  # the rows are not first: a wrong answer if put back
