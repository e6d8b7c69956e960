"""Our reference (V4's own-pre boundary, hc_head, the shared coefficients) against DeepSeek's own torch references for
its TileLang mHC kernels: `tile_kernels/torch/mhc.py` of tile-kernels 2.1.0, run from the wheel that `make test`
downloads (its package imports tilelang; that file imports torch alone). Where two fp32 orders may differ, by
CONTRACT §2's rule; the rounding points (R' once to bf16, the collapse to bf16) must be the same."""

from __future__ import annotations

import types
import zipfile
from pathlib import Path

import pytest
import torch

from boundary import reference as ref
from boundary.params import MHCParams
from tests.bf16 import within_contract

ROOT = Path(__file__).resolve().parents[1]
WHEELS = sorted((ROOT / ".venv" / "oracles").glob("tile_kernels-2.1.0-*.whl"))
pytestmark = pytest.mark.skipif(
    not WHEELS, reason="the tile-kernels 2.1.0 wheel is not in .venv/oracles (make test downloads it)"
)
F64, BF16, HC = torch.float64, torch.bfloat16, 4


@pytest.fixture(scope="module")
def deepseek() -> types.ModuleType:
    """DeepSeek's torch reference module, loaded from the wheel's file."""
    source = zipfile.ZipFile(WHEELS[0]).read("tile_kernels/torch/mhc.py").decode()
    module = types.ModuleType("tile_kernels_torch_mhc")
    exec(compile(source, "tile_kernels/torch/mhc.py", "exec"), module.__dict__)  # noqa: S102
    return module


def streams(rows: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HC, hidden, generator=torch.Generator().manual_seed(seed)).to(BF16)


def weights(hidden: int, seed: int, mixes: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(mixes, HC * hidden, generator=g) * 0.02
    scale = torch.tensor([0.5, 0.45, 0.55]) if mixes == 24 else torch.tensor([0.7])
    return fn, scale, torch.randn(mixes, generator=g) * 0.5


@pytest.mark.parametrize("rows,hidden", [(3, 512), (16, 1024)])
def test_the_post_rounds_where_deepseeks_does(deepseek, rows: int, hidden: int) -> None:
    """R' = bf16(post * y + comb^T R): theirs sums comb^T R first, ours in stream order: one rounding each, within
    the fp32 reordering bound."""
    r, y = streams(rows, hidden, 1), streams(rows, hidden, 2)[:, 0]
    coeffs = ref.coefficients(streams(rows, hidden, 3).reshape(rows, -1), MHCParams(*weights(hidden, 4), *EPS))
    theirs = deepseek.mhc_post_ref(y[:, None], r[:, None], coeffs.post[:, None, :, None], coeffs.comb[:, None])[:, 0]
    ours = ref.mhc_post(y, r, coeffs.post, coeffs.comb)
    post, comb = coeffs.post.to(F64), coeffs.comb.to(F64)
    exact = post[:, :, None] * y.to(F64)[:, None] + torch.einsum("tkj,tkh->tjh", comb, r.to(F64))
    bound = (post[:, :, None] * y.to(F64)[:, None]).abs() + torch.einsum("tkj,tkh->tjh", comb.abs(), r.to(F64).abs())
    assert theirs.dtype == ours.dtype == BF16
    assert within_contract(theirs, exact, bound).all() and within_contract(ours, exact, bound).all()
    assert (theirs == ours).float().mean() > 0.99  # the same rounding point: they differ only where an fp32 order does


@pytest.mark.parametrize("rows,hidden", [(3, 512), (8, 768)])
def test_the_collapse_rounds_to_bf16_as_deepseeks(deepseek, rows: int, hidden: int) -> None:
    r = streams(rows, hidden, 5)
    pre = torch.rand(rows, HC, generator=torch.Generator().manual_seed(6)) + 0.1
    theirs = deepseek.mhc_pre_apply_mix_ref(r[:, None], pre[:, None, :, None])[:, 0]
    ours = ref.collapse(r, pre)
    exact = (pre.to(F64)[:, :, None] * r.to(F64)).sum(1)
    bound = (pre.to(F64)[:, :, None] * r.to(F64)).abs().sum(1)
    assert (
        theirs.dtype == BF16
        and within_contract(theirs, exact, bound).all()
        and within_contract(ours, exact, bound).all()
    )
    assert (theirs == ours).float().mean() > 0.99


EPS = (1e-6, 1e-6, 1e-6, 2.0, 20)  # rms_eps, pre_eps, sinkhorn_eps, post_mult, sinkhorn_repeat


@pytest.mark.parametrize("rows,hidden", [(2, 512), (5, 1024)])
def test_the_coefficients_are_deepseeks(deepseek, rows: int, hidden: int) -> None:
    """The projection and its RMS, pre (+ eps after the sigmoid), post (x 2) and comb (softmax + eps, a column
    normalisation, then 19 row-column pairs): DeepSeek's mhc_pre_norm_fn, mhc_pre_split_mixes and
    sinkhorn_normalize (its `repeat` counts the first column normalisation) give the same values within fp32."""
    r = streams(rows, hidden, 7)
    fn, scale, base = weights(hidden, 8)
    mixes = deepseek.mhc_pre_norm_fn_ref(r[:, None], fn, None, 1e-6)
    pre, post, logits = deepseek.mhc_pre_split_mixes_ref(mixes, scale, base, HC, 2.0, 1e-6)
    comb = deepseek.sinkhorn_normalize_ref(logits, repeat=20, eps=1e-6)
    ours = ref.coefficients(r.reshape(rows, -1), MHCParams(fn, scale, base, *EPS))
    for theirs, mine in ((pre[:, 0, :, 0], ours.pre), (post[:, 0, :, 0], ours.post), (comb[:, 0], ours.comb)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    # A Sinkhorn of 3 is told apart: the comparison has teeth (one pair short of 20 is not: it has converged).
    short = deepseek.sinkhorn_normalize_ref(logits, repeat=3, eps=1e-6)[:, 0]
    assert not torch.allclose(ours.comb, short, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,hidden", [(2, 512), (7, 1024)])
def test_hc_head_is_deepseeks(deepseek, rows: int, hidden: int) -> None:
    """hc_head's weights: DeepSeek's projection of the flattened streams with its RMS, then sigmoid(mix * scale +
    base) + eps; its collapse is the pre-apply's bf16 rounding."""
    r = streams(rows, hidden, 9)
    fn, scale, base = weights(hidden, 10, mixes=HC)
    mix = deepseek.mhc_pre_norm_fn_ref(r[:, None], fn, None, 1e-6)
    theirs = deepseek.mhc_head_compute_mix_ref(mix, scale, base, 1e-6)[:, 0]
    ours = ref.hc_head_mix(r, fn, scale, base, 1e-6, 1e-6)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    h = deepseek.mhc_pre_apply_mix_ref(r[:, None], theirs[:, None, :, None])[:, 0]
    exact = (theirs.to(F64)[:, :, None] * r.to(F64)).sum(1)
    bound = (theirs.to(F64)[:, :, None] * r.to(F64)).abs().sum(1)
    assert (
        within_contract(h, exact, bound).all()
        and within_contract(ref.hc_head(r, fn, scale, base, 1e-6, 1e-6), exact, bound).all()
    )
    assert (ref.collapse(r, theirs) == h).float().mean() > 0.99  # the same rounding point
