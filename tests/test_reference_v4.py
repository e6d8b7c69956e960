"""The DeepSeek-V4 scheme's reference (own-pre boundary, first entry, hc_head) against an independent float64
formulation of SPEC §4d, with its rounding points: y and R' in bf16, the collapse in bf16 before the norm."""

from __future__ import annotations

import pytest
import torch

from boundary import reference as ref
from boundary.params import MHCParams
from tests.bf16 import bitwise_equal, within_contract

F64, BF16 = torch.float64, torch.bfloat16
HC = 4


def params(hidden: int, seed: int, *, broadcast: bool = False) -> MHCParams:
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(24, HC * hidden, generator=g) * 0.02
    if broadcast:
        fn = fn.view(24, HC, hidden).sum(1)
    scale = torch.tensor([0.5, 0.5, 0.5]) + 0.05 * torch.randn(3, generator=g)
    return MHCParams(fn, scale, 0.5 * torch.randn(24, generator=g), 1e-6, 1e-6, 1e-6, 2.0, 20)


def streams(rows: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HC, hidden, generator=torch.Generator().manual_seed(seed)).to(BF16)


def mixes64(x: torch.Tensor, p: MHCParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SPEC §3 in float64: (post, comb, pre) of a [T, K] projection input."""
    x = x.to(F64)
    m = (x @ p.fn.to(F64).t()) / torch.sqrt((x * x).mean(-1, keepdim=True) + p.rms_eps)
    s, b = p.scale.to(F64), p.base.to(F64)
    pre = torch.sigmoid(m[:, :4] * s[0] + b[:4]) + p.pre_eps
    post = torch.sigmoid(m[:, 4:8] * s[1] + b[4:8]) * p.post_mult
    comb = torch.softmax((m[:, 8:] * s[2] + b[8:]).view(-1, 4, 4), -1) + p.sinkhorn_eps
    comb = comb / (comb.sum(-2, keepdim=True) + p.sinkhorn_eps)
    for _ in range(p.sinkhorn_repeat - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + p.sinkhorn_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + p.sinkhorn_eps)
    return post, comb, pre


def weighted64(residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j w[:, j] * R[:, j] in float64, and the sum of its terms' magnitudes (the comparison rule's bound)."""
    terms = w.to(F64)[:, :, None] * residual.to(F64)
    return terms.sum(1), terms.abs().sum(1)


def norm64(c: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    c = c.to(F64)
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps) * weight.to(F64)


def assert_mixes(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want):  # fp32 against float64: SPEC §3's fp32 reference tolerance is far looser (1e-3)
        torch.testing.assert_close(g.to(F64), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,hidden", [(1, 256), (5, 512), (3, 1024)])
def test_a_v4_boundary_is_post_then_its_own_mixes_then_the_own_pre_collapse(rows: int, hidden: int) -> None:
    r, y = streams(rows, hidden, 1), streams(rows, hidden, 2)[:, 0]
    carried = ref.coefficients(streams(rows, hidden, 3).reshape(rows, -1), params(hidden, 4))
    p, weight = params(hidden, 5), (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(6))).to(BF16)
    got = ref.v4_boundary(y, r, carried.post, carried.comb, p, weight, 1e-6)
    # Step 2: R' from the carried post and comb, each stream one bf16 rounding (SPEC §2's rule).
    post, comb = carried.post.to(F64), carried.comb.to(F64)
    exact = post[:, :, None] * y.to(F64)[:, None] + torch.einsum("tkj,tkh->tjh", comb, r.to(F64))
    bound = (post[:, :, None] * y.to(F64)[:, None]).abs() + torch.einsum("tkj,tkh->tjh", comb.abs(), r.to(F64).abs())
    assert within_contract(got.residual, exact, bound).all()
    # Step 3: the mixes of the new streams themselves (not of the streams before, nor carried ones).
    assert_mixes((got.post, got.comb, got.pre), mixes64(got.residual.reshape(rows, -1), p))
    # Step 4: the collapse with that pre, rounded to bf16, then the norm over the rounded collapse.
    c = ref.collapse(got.residual, got.pre)
    exact, bound = weighted64(got.residual, got.pre.to(F64))
    assert within_contract(c, exact, bound).all()
    assert within_contract(got.layer_input, norm64(c, weight, 1e-6), torch.zeros(rows, hidden)).all()
    # Bit for bit, the composition SPEC §4d writes: the V4.1 boundary's post, then the entry on its output.
    again = ref.v4_enter(ref.mhc_post(y, r, carried.post, carried.comb), p, weight, 1e-6)
    assert all(bitwise_equal(a, b) for a, b in zip(got, again))


def test_the_first_v4_entry_collapses_the_broadcast_streams_with_their_own_pre() -> None:
    """First layer: R = the embedding broadcast to hc; the mixes from fn_broadcast over the embedding are those of fn
    over R, and the layer input is the norm of bf16(sum_i pre_i) * e, not stream 0 as in V4.1."""
    rows, hidden = 4, 512
    e = streams(rows, hidden, 7)[:, 0]
    r = e.unsqueeze(1).expand(-1, HC, -1).contiguous()
    full, weight = params(hidden, 8), torch.ones(hidden, dtype=BF16)
    broadcast = full._replace(fn=full.fn.view(24, HC, hidden).sum(1))
    got = ref.v4_enter(r, broadcast, weight, 1e-6, x=e)
    assert_mixes((got.post, got.comb, got.pre), mixes64(r.reshape(rows, -1), full))
    exact, bound = weighted64(r, got.pre.to(F64))
    c = ref.collapse(r, got.pre)
    assert within_contract(c, exact, bound).all()
    assert bitwise_equal(got.layer_input, ref.rms_norm(c, weight, 1e-6))
    assert not bitwise_equal(got.layer_input, ref.rms_norm(e, weight, 1e-6)), "the own pre is not one-hot"


@pytest.mark.parametrize("rows,hidden", [(1, 256), (6, 768)])
def test_hc_head_is_the_sigmoid_weighted_sum_of_the_streams(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(9)
    r = streams(rows, hidden, 10)
    fn, scale, base = (
        torch.randn(HC, HC * hidden, generator=g) * 0.02,
        torch.tensor([0.7]),
        torch.randn(HC, generator=g),
    )
    h = ref.hc_head(r, fn, scale, base, 1e-6, 1e-6)
    x = r.reshape(rows, -1).to(F64)
    mix = (x @ fn.to(F64).t()) / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    p = torch.sigmoid(mix * 0.7 + base.to(F64)) + 1e-6  # no post, no comb, no Sinkhorn
    exact, bound = weighted64(r, p)
    assert h.dtype == BF16 and within_contract(h, exact, bound).all()
    # A wrong weight (a plain mean of the streams) is told apart: the check has teeth.
    assert not within_contract(h, weighted64(r, torch.full_like(p, 0.25))[0], bound).all()
