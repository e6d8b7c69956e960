"""DeepSeek-V4's own-pre entry in one launch (`boundary.mhc.own_pre`, the coefficients kernel's own-pre variant; CONTRACT
§4d): the CTAs that finish the rows collapse and normalise them with the pre they computed. Its outputs are, bit for
bit, the two-launch form's (`mhc.mixes`, then the layer-input kernel `mhc.collapse_norm` with that pre), the
quantized bytes included, at every schedule, at 1-512 rows, on adversarial rows and in graph replays; the final
step's one launch (`mhc.head_input`) is `head_mix` then `collapse_norm`, bit for bit.

Run: python -m pytest -q -m gpu tests/test_own_pre_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from boundary import BoundaryAllReduce, mhc
from boundary.params import MHCParams
from boundary.toy import ToyConfig, ToyModel
from boundary.types import empty_layer_input_form
from cute_kernels.coefficients import api as coefficients_api
from cute_kernels.coefficients.tuning import Choice
from tests.inputs import attn_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

BF16 = torch.bfloat16
FORMS = (None, "mxfp8", "fp8_1x128", "fp8_1x128_ue8m0")
EPS = 1e-6
_MODELS: dict[int, ToyModel] = {}


def model(H: int) -> ToyModel:
    """A one-layer toy of hidden size H on the GPU with its kernels warmed (the own-pre variants included)."""
    if H not in _MODELS:
        _MODELS[H] = ToyModel(ToyConfig(hidden_size=H, num_layers=1), device="cuda")
        ar = BoundaryAllReduce(H, max_rows=512, device="cuda")
        ar.warmup(progress=False, quantize=FORMS[1:] if H % 1024 == 0 else (), own_pre=True)
    return _MODELS[H]


def streams(rows: int, H: int, seed: int, adversarial: bool = False) -> torch.Tensor:
    """Streams [T, 4, H] bf16; `adversarial`: rows of zeros, huge and tiny values, one large element, a NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = torch.randn(rows, 4, H, generator=g, device="cuda")
    if adversarial:
        r[0] = 0.0
        if rows > 1:
            r[1] *= 1e30
        if rows > 2:
            r[2] *= 1e-30
        if rows > 3:
            r[3, :, 7] = 3e4
        if rows > 4:
            r[4, 2, 100] = float("nan")
    return r.to(BF16)


def poisoned(rows: int, H: int, form: str | None):
    """An empty quantized layer input whose every byte is 0xA5 (None: none)."""
    if form is None:
        return None
    out = empty_layer_input_form(form, rows, H, torch.device("cuda"))
    out.data.view(torch.uint8).fill_(0xA5)
    out.scale.view(torch.uint8).fill_(0xA5)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def two_launches(residual: torch.Tensor, p: MHCParams, weight: torch.Tensor, form: str | None) -> tuple:
    """The own-pre entry as two launches: the mixes, then the layer-input kernel with their pre."""
    post, comb, pre = mhc.mixes(residual, p)
    q = poisoned(residual.shape[0], residual.shape[2], form)
    layer_input = mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=q)
    return post, comb, pre, layer_input, q


def assert_same(got: tuple, q_got, want: tuple, q_want, what: object) -> None:
    for name, a, b in zip(("post", "comb", "pre", "layer input"), got, want):
        assert same_bits(a, b), (what, name)
    if q_want is not None:
        assert same_bits(q_got.data, q_want.data), (what, "quantized data")
        assert same_bits(q_got.scale, q_want.scale), (what, "quantized scale")


@pytest.mark.parametrize("H", (4096, 7168, 5120, 1024))
@pytest.mark.parametrize("form", FORMS)
def test_one_launch_is_the_two_launch_entry_bit_for_bit(H: int, form: str | None) -> None:
    """own_pre against mixes + collapse_norm at 1-512 rows (random and adversarial rows), quantized bytes included. At
    H 1024 a finishing CTA's pass holds two rows (rows_per_pass 2: a pass row past the share at 1 row)."""
    if form is not None and H % 1024:
        pytest.skip("a quantized form needs H a multiple of 1024")
    layer = model(H).layers[0]
    p, weight = attn_params(layer), layer.attn_norm.weight
    for rows in (1, 3, 16, 33, 129, 512):
        for adversarial in (False, True):
            residual = streams(rows, H, seed=rows, adversarial=adversarial)
            want = two_launches(residual, p, weight, form)
            q = poisoned(rows, H, form)
            got = mhc.own_pre(residual, p, weight, EPS, quantized_out=q)
            assert_same(got, q, want[:4], want[4], (rows, adversarial))


@pytest.mark.parametrize("H", (4096, 7168))
def test_every_schedule_gives_the_same_bits(H: int) -> None:
    """The own-pre variant at the partials schedule (its finish kernel collapses the row), other tiles and row splits:
    the shipped config's bits (the layer input's order is the layer-input kernel's whatever the CTA's shape)."""
    layer = model(H).layers[0]
    p, weight = attn_params(layer), layer.attn_norm.weight
    choices = (
        Choice(32, schedule="partials"),
        Choice(32, push_vec=True, row_split=2),
        Choice(16),
        Choice(32),
        Choice(64, push_vec=True),
        Choice(256, row_split=4, schedule="partials"),
    )
    for rows in (1, 16, 129):
        residual = streams(rows, H, seed=10 + rows)
        want = mhc.own_pre(residual, p, weight, EPS)
        for choice in choices:
            outs = [torch.empty_like(w) for w in want]
            ws = mhc.prepare_workspace(H, rows, residual.device)
            coefficients_api.mhc_coefficients(
                residual,
                p.fn,
                p.scale,
                p.base,
                rms_eps=p.rms_eps,
                pre_eps=p.pre_eps,
                sinkhorn_eps=p.sinkhorn_eps,
                post_mult=p.post_mult,
                sinkhorn_repeat=p.sinkhorn_repeat,
                broadcast=False,
                workspace=ws,
                post_out=outs[0],
                comb_out=outs[1],
                pre_out=outs[2],
                norm_weight=weight,
                norm_eps=EPS,
                layer_input_out=outs[3],
                own_pre=True,
                arch="sm_90a",
                config=choice.config(H, False),
            )
            assert_same(outs, None, want, None, (rows, choice))


@pytest.mark.parametrize("H", (4096, 7168))
def test_the_final_step_is_head_mix_then_collapse_norm_bit_for_bit(H: int) -> None:
    m = model(H)
    head = (m.hc_head_fn, m.hc_head_scale, m.hc_head_base, m.rms_norm_eps, m.hc_eps)
    for rows in (1, 16, 129, 512):
        residual = streams(rows, H, seed=20 + rows)
        p = mhc.head_mix(residual, *head)
        want = mhc.collapse_norm(residual, p, m.final_norm.weight, EPS)
        assert same_bits(mhc.head_input(residual, *head, m.final_norm.weight, EPS), want), rows


def test_graph_replays_give_the_eager_bits() -> None:
    """own_pre with its MXFP8 form captured once in a CUDA graph and replayed on new streams: each replay's outputs
    are the eager call's on the same streams."""
    H, rows = 7168, 16
    layer = model(H).layers[0]
    p, weight = attn_params(layer), layer.attn_norm.weight
    static = streams(rows, H, seed=30)
    q = poisoned(rows, H, "mxfp8")
    mhc.own_pre(static, p, weight, EPS, quantized_out=q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mhc.own_pre(static, p, weight, EPS, quantized_out=q)
    for index in range(1, 4):
        static.copy_(streams(rows, H, seed=30 + index))
        graph.replay()
        q_want = poisoned(rows, H, "mxfp8")
        want = mhc.own_pre(static, p, weight, EPS, quantized_out=q_want)
        torch.cuda.synchronize()
        assert_same(outs, q, want, q_want, index)
