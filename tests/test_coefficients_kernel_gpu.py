"""The coefficients kernel on the GPU against the fp32 reference: accuracy, batch invariance, inline form, graphs.

Run: python -m pytest -q -m gpu tests/test_coefficients_kernel_gpu.py
Timing sweep (not a test): python -m tests.test_coefficients_kernel_gpu
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import pytest
import torch

from boundary import reference as ref
from cute_kernels.coefficients import (
    SENTINEL,
    CoefficientsConfig,
    CoefficientsWorkspace,
    mhc_coefficients,
    mhc_layer_input,
)
from cute_kernels.coefficients.tuning import coefficients_config
from cute_kernels.coefficients.variant import CoefficientsVariant
from cute_kernels.compile import arch_for_device
from tests.bf16 import bitwise_equal, max_ulp

pytestmark = pytest.mark.gpu

BF16, F32 = torch.bfloat16, torch.float32
HIDDEN = (4096, 5120, 7168)
ROWS = (1, 2, 7, 16, 64, 129, 512)
MAX_ROWS = 512
EPS = dict(rms_eps=1e-6, pre_eps=1e-6, sinkhorn_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20)
NORM_EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    """Every shipped coefficients and layer-input kernel of the hidden sizes here, compiled side by side once (the
    warmup's jobs, on every core) before the first test: the tests then load them instead of compiling one at a time.
    The knob configs some tests try compile on their first call."""
    from cute_kernels.coefficients import api
    from cute_kernels.compile import warmup

    device = torch.device("cuda")
    arch = arch_for_device(device)
    jobs = [job for H in HIDDEN for job in api.warmup_jobs(H, arch=arch, max_rows=MAX_ROWS, unnormed=True)]
    warmup(jobs, progress=False, desc="coefficients kernels", device=device)


class Weights(NamedTuple):
    """One sublayer's mHC parameters on the GPU."""

    fn: torch.Tensor  # [24, 4H]
    fn_broadcast: torch.Tensor  # [24, H]
    scale: torch.Tensor
    base: torch.Tensor
    norm_weight: torch.Tensor  # [H] bf16


class Out(NamedTuple):
    """What one call wrote."""

    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor
    layer_input: torch.Tensor | None


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@functools.cache
def weights(H: int) -> Weights:
    g = gen(H)
    fn = torch.randn(24, 4 * H, device="cuda", generator=g) * 1e-2
    scale = torch.full((3,), 0.5, device="cuda")
    base = torch.randn(24, device="cuda", generator=g) * 0.5
    w = (1.0 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(BF16)
    return Weights(fn, fn.view(24, 4, H).sum(1).contiguous(), scale, base, w)


@functools.cache
def workspace(H: int) -> CoefficientsWorkspace:
    return CoefficientsWorkspace(H, MAX_ROWS, "cuda")


@functools.cache
def arch() -> str:
    return arch_for_device(torch.device("cuda"))


def streams(rows: int, H: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, 4, H, device="cuda", generator=gen(seed)).to(BF16)


def carried_pre(rows: int, seed: int = 2) -> torch.Tensor:
    return torch.rand(rows, 4, device="cuda", generator=gen(seed)) + 1e-6


def call(
    x: torch.Tensor,
    *,
    broadcast: bool = False,
    inline: bool = False,
    pre_mix: torch.Tensor | None = None,
    ws: CoefficientsWorkspace | None = None,
    out: Out | None = None,
    rms_eps: float = EPS["rms_eps"],
    stream: torch.cuda.Stream | None = None,
    config: CoefficientsConfig | None = None,
) -> Out:
    """One kernel launch on the current stream; allocates the outputs unless given."""
    rows, H = x.shape[0], x.shape[-1]
    wt = weights(H)
    if out is None:
        out = Out(
            torch.empty(rows, 4, device="cuda"),
            torch.empty(rows, 4, 4, device="cuda"),
            torch.empty(rows, 4, device="cuda"),
            torch.empty(rows, H, dtype=BF16, device="cuda") if inline else None,
        )
    kwargs = dict(EPS, rms_eps=rms_eps)
    mhc_coefficients(
        x,
        wt.fn_broadcast if broadcast else wt.fn,
        wt.scale,
        wt.base,
        **kwargs,
        broadcast=broadcast,
        workspace=ws if ws is not None else workspace(H),
        post_out=out.post,
        comb_out=out.comb,
        pre_out=out.pre,
        pre_mix=pre_mix if inline else None,
        norm_weight=wt.norm_weight if inline else None,
        norm_eps=NORM_EPS if inline else None,
        layer_input_out=out.layer_input,
        arch=arch(),
        stream=stream,
        config=config,
    )
    return out


def layer_input_only(
    x: torch.Tensor,
    pre_mix: torch.Tensor | None,
    *,
    broadcast: bool = False,
    norm_eps: float = NORM_EPS,
) -> torch.Tensor:
    """One launch of the layer-input-only kernel; returns the new [T, H] bf16 layer input."""
    rows, H = x.shape[0], x.shape[-1]
    out = torch.empty(rows, H, dtype=BF16, device="cuda")
    mhc_layer_input(x, pre_mix, weights(H).norm_weight, norm_eps, out, arch=arch(), broadcast=broadcast)
    return out


def reference(x: torch.Tensor, *, broadcast: bool = False, rms_eps: float = EPS["rms_eps"]) -> ref.Coefficients:
    """The fp32 torch math with fn unrounded (no TF32)."""
    rows, H = x.shape[0], x.shape[-1]
    wt = weights(H)
    flat = x if broadcast else x.reshape(rows, 4 * H)
    fn = wt.fn_broadcast if broadcast else wt.fn
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return ref.mhc_coefficients(flat, fn, wt.scale, wt.base, **dict(EPS, rms_eps=rms_eps))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def assert_matches(got: Out, want: ref.Coefficients) -> None:
    torch.testing.assert_close(got.post, want.post, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got.comb, want.comb, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got.pre, want.pre, atol=1e-3, rtol=1e-3)
    col_sums = got.comb.sum(-2)  # over the source index
    assert (col_sums - 1).abs().max().item() <= 1e-4


def assert_counters_clean(ws: CoefficientsWorkspace) -> None:
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0, "arrival counters were not reset"
    assert bool((ws.partials.view(torch.int32) == SENTINEL).all()), "partial slots were not cleared"


# --- accuracy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_standard_matches_reference(H: int, rows: int) -> None:
    x = streams(rows, H, seed=rows)
    got = call(x)
    assert_matches(got, reference(x))
    assert_counters_clean(workspace(H))


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("rows", (1, 16, 129, 512))
def test_broadcast_matches_reference(H: int, rows: int) -> None:
    e = torch.randn(rows, H, device="cuda", generator=gen(rows)).to(BF16)
    got = call(e, broadcast=True)
    assert_matches(got, reference(e, broadcast=True))
    # The broadcast projection is the full projection of 4 identical streams (up to rounding).
    full = reference(e.unsqueeze(1).expand(rows, 4, H).contiguous())
    torch.testing.assert_close(got.comb, full.comb, atol=1e-3, rtol=1e-3)
    assert_counters_clean(workspace(H))


def test_tiny_eps_and_a_zero_row() -> None:
    H = 7168
    x = streams(9, H, seed=5)
    x[3] = 0
    got = call(x, rms_eps=1e-20)
    assert_matches(got, reference(x, rms_eps=1e-20))


# --- batch invariance --------------------------------------------------------------------------


@pytest.mark.parametrize("H", (4096, 7168))
@pytest.mark.parametrize("broadcast", (False, True))
def test_a_row_gives_the_same_bits_whatever_the_row_count(H: int, broadcast: bool) -> None:
    shape = (MAX_ROWS, H) if broadcast else (MAX_ROWS, 4, H)
    x = torch.randn(*shape, device="cuda", generator=gen(7)).to(BF16)
    full = call(x, broadcast=broadcast)
    for start, rows in ((0, 1), (5, 1), (63, 1), (64, 1), (511, 1), (200, 7), (3, 16), (300, 129), (1, 64)):
        part = call(x[start : start + rows], broadcast=broadcast)
        for name in ("post", "comb", "pre"):
            whole = getattr(full, name)[start : start + rows]
            assert bitwise_equal(getattr(part, name), whole), f"{name} of rows {start}..{start + rows - 1}"


# --- the inline form: layer input ---------------------------------------------------------------


@pytest.mark.parametrize("H", (4096, 7168))
@pytest.mark.parametrize("rows", (1, 16, 129))
@pytest.mark.parametrize("carried", (True, False))
def test_inline_layer_input(H: int, rows: int, carried: bool) -> None:
    x = streams(rows, H, seed=11)
    pre_mix = carried_pre(rows) if carried else None
    got = call(x, inline=True, pre_mix=pre_mix)
    c = ref.collapse(x, pre_mix) if carried else x[:, 0].clone()
    want = ref.rms_norm(c, weights(H).norm_weight, NORM_EPS)
    assert max_ulp(got.layer_input, want) <= 1
    # The coefficients are the very same as without the layer input (same projection code).
    alone = call(x)
    for name in ("post", "comb", "pre"):
        assert bitwise_equal(getattr(got, name), getattr(alone, name)), name
    assert_counters_clean(workspace(H))


@pytest.mark.parametrize("rows", (1, 16, 129))
def test_inline_broadcast_normalizes_the_embedding_row(rows: int) -> None:
    H = 7168
    e = torch.randn(rows, H, device="cuda", generator=gen(13)).to(BF16)
    got = call(e, broadcast=True, inline=True)
    want = ref.rms_norm(e, weights(H).norm_weight, NORM_EPS)
    assert max_ulp(got.layer_input, want) <= 1
    assert_matches(got, reference(e, broadcast=True))


def test_inline_collapse_is_exact_before_the_norm() -> None:
    # Rows whose collapse is +-1 everywhere have sum(c^2)/H == 1, so with eps 0 the norm is exact
    # and out must be c * w bit for bit: stream 0 copied for the one-hot pre, and for the carried
    # pre a collapse of 1.003 that must be rounded to bf16 1.0 before the norm.
    H, rows = 4096, 5
    sign = torch.where(torch.rand(rows, H, device="cuda", generator=gen(17)) < 0.5, -1.0, 1.0)
    x = torch.randn(rows, 4, H, device="cuda", generator=gen(19)).to(BF16)
    x[:, 0] = sign.to(BF16)
    wt = weights(H)
    out = Out(
        *(torch.empty(rows, *s, device="cuda") for s in ((4,), (4, 4), (4,))),
        torch.empty(rows, H, dtype=BF16, device="cuda"),
    )
    kwargs = dict(EPS, broadcast=False, workspace=workspace(H), post_out=out.post, comb_out=out.comb, pre_out=out.pre)
    mhc_coefficients(
        x,
        wt.fn,
        wt.scale,
        wt.base,
        **kwargs,
        norm_weight=wt.norm_weight,
        norm_eps=0.0,
        layer_input_out=out.layer_input,
        arch=arch(),
    )
    assert bitwise_equal(out.layer_input, (sign * wt.norm_weight.float()).to(BF16))
    x[:, 0] = (sign * 1.003).to(BF16)  # bf16(1.003) = 1.0
    x[:, 1:] = 0
    x[:, 1] = (sign * 0.003).to(BF16)
    pre_mix = torch.ones(rows, 4, device="cuda")
    assert torch.all(ref.collapse(x, pre_mix).abs() == 1.0)
    mhc_coefficients(
        x,
        wt.fn,
        wt.scale,
        wt.base,
        **kwargs,
        pre_mix=pre_mix,
        norm_weight=wt.norm_weight,
        norm_eps=0.0,
        layer_input_out=out.layer_input,
        arch=arch(),
    )
    assert bitwise_equal(out.layer_input, (sign * wt.norm_weight.float()).to(BF16))


# --- the layer-input-only kernel -----------------------------------------------------------------


@pytest.mark.parametrize("H", (4096, 5120, 7168))
@pytest.mark.parametrize("rows", (1, 3, 16, 129, 512))
@pytest.mark.parametrize("carried", (True, False))
def test_layer_input_only(H: int, rows: int, carried: bool) -> None:
    x = streams(rows, H, seed=23)
    pre_mix = carried_pre(rows) if carried else None
    got = layer_input_only(x, pre_mix)
    c = ref.collapse(x, pre_mix) if carried else x[:, 0].clone()
    want = ref.rms_norm(c, weights(H).norm_weight, NORM_EPS)
    assert max_ulp(got, want) <= 1
    if rows <= 129:
        # The very same bits as the inline form's layer input (same collapse and reduction order).
        inline = call(x, inline=True, pre_mix=pre_mix)
        assert bitwise_equal(got, inline.layer_input)


@pytest.mark.parametrize("rows", (1, 16, 512))
def test_layer_input_only_broadcast(rows: int) -> None:
    H = 7168
    e = torch.randn(rows, H, device="cuda", generator=gen(29)).to(BF16)
    got = layer_input_only(e, None, broadcast=True)
    assert max_ulp(got, ref.rms_norm(e, weights(H).norm_weight, NORM_EPS)) <= 1
    # The embedding row is stream 0 of the broadcast streams.
    assert bitwise_equal(got, layer_input_only(e.unsqueeze(1).expand(rows, 4, H).contiguous(), None))


def test_layer_input_only_is_exact_before_the_norm() -> None:
    # As test_inline_collapse_is_exact_before_the_norm: with eps 0 and c = +-1, out = c * w bit for bit.
    H, rows = 4096, 37
    sign = torch.where(torch.rand(rows, H, device="cuda", generator=gen(31)) < 0.5, -1.0, 1.0)
    x = torch.randn(rows, 4, H, device="cuda", generator=gen(37)).to(BF16)
    x[:, 0] = sign.to(BF16)
    want = (sign * weights(H).norm_weight.float()).to(BF16)
    assert bitwise_equal(layer_input_only(x, None, norm_eps=0.0), want)
    x[:, 0] = (sign * 1.003).to(BF16)  # bf16(1.003) = 1.0
    x[:, 1:] = 0
    x[:, 1] = (sign * 0.003).to(BF16)
    pre_mix = torch.ones(rows, 4, device="cuda")
    assert bitwise_equal(layer_input_only(x, pre_mix, norm_eps=0.0), want)


def test_layer_input_only_batch_invariance_and_graph() -> None:
    H = 7168
    x = streams(MAX_ROWS, H, seed=41)
    pre_mix = carried_pre(MAX_ROWS)
    full = layer_input_only(x, pre_mix)
    for start, rows in ((0, 1), (77, 3), (300, 129)):
        part = layer_input_only(x[start : start + rows], pre_mix[start : start + rows])
        assert bitwise_equal(part, full[start : start + rows])
    # Captured in a graph, and ordered after the producer of its pre-mix (PDL wait).
    rows = 16
    xs, pm = x[:rows].clone(), pre_mix[:rows].clone()
    out = torch.empty(rows, H, dtype=BF16, device="cuda")
    mhc_layer_input(xs, pm, weights(H).norm_weight, NORM_EPS, out, arch=arch())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_layer_input(xs, pm, weights(H).norm_weight, NORM_EPS, out, arch=arch())
    for step in range(3):
        xs.copy_(streams(rows, H, seed=500 + step))
        pm.copy_(carried_pre(rows, seed=600 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert max_ulp(out, ref.rms_norm(ref.collapse(xs, pm), weights(H).norm_weight, NORM_EPS)) <= 1


def test_layer_input_only_after_the_projection_that_makes_its_pre() -> None:
    # The next pre written by one coefficients launch is the next layer-input-only launch's pre_mix.
    H, rows = 5120, 16
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    pre = carried_pre(rows)
    layer_inputs, pres = [], [pre]
    for step in range(4):
        x = streams(rows, H, seed=700 + step)
        layer_inputs.append((x, layer_input_only(x, pres[-1])))
        pres.append(call(x, ws=ws).pre)
    torch.cuda.synchronize()
    for (x, got), pre in zip(layer_inputs, pres):
        assert max_ulp(got, ref.rms_norm(ref.collapse(x, pre), weights(H).norm_weight, NORM_EPS)) <= 1


# --- config knobs: the same bits as the default -----------------------------------------------


def knob_configs(H: int, broadcast: bool) -> list[CoefficientsConfig]:
    """Tile-schedule configs away from the defaults: all share the default's split along K, so must give its bits."""
    f = functools.partial(CoefficientsConfig.for_shape, H, broadcast)
    return [
        f(64),
        f(128),
        f(32),
        f(16),
        # 16-byte DSMEM pushes, warps split over the m-tiles, launch bounds.
        f(64, push_vec=True),
        f(32, push_vec=True, row_split=2),
        f(64, push_vec=True, row_split=2, min_blocks=2),
        f(128, push_vec=True, row_split=4),
        f(32, push_vec=True, min_blocks=4),
    ]


@pytest.mark.parametrize("H", (4096, 7168))
@pytest.mark.parametrize("variant", ("standard", "broadcast", "inline"))
def test_knob_configs_give_the_default_bits(H: int, variant: str) -> None:
    broadcast, inline = variant == "broadcast", variant == "inline"
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    for rows in (1, 7, 129, 512):
        x = streams(rows, H, seed=rows + 50)
        if broadcast:
            x = x[:, 1].contiguous()
        pre_mix = carried_pre(rows) if inline else None
        want = call(x, broadcast=broadcast, inline=inline, pre_mix=pre_mix, ws=ws)
        if rows == 129:
            assert_matches(want, reference(x, broadcast=broadcast))
        for config in knob_configs(H, broadcast):
            got = call(x, broadcast=broadcast, inline=inline, pre_mix=pre_mix, ws=ws, config=config)
            for name in Out._fields:
                a, b = getattr(got, name), getattr(want, name)
                assert (a is None and b is None) or bitwise_equal(a, b), f"{name}, {rows} rows, {config}"
            assert_counters_clean(ws)


@pytest.mark.parametrize("H", (5120, 7168))
def test_tall_tile_batch_invariance(H: int) -> None:
    # A call of the whole batch in 128-row tiles, calls of row ranges in 64-row tiles: same bits.
    x = torch.randn(MAX_ROWS, 4, H, device="cuda", generator=gen(43)).to(BF16)
    full = call(x, config=CoefficientsConfig.for_shape(H, False, 128))
    for start, rows in ((0, 1), (63, 1), (511, 1), (200, 7), (3, 16), (300, 129), (1, 64)):
        part = call(x[start : start + rows], config=CoefficientsConfig.for_shape(H, False, 64))
        for name in ("post", "comb", "pre"):
            assert bitwise_equal(getattr(part, name), getattr(full, name)[start : start + rows]), name


@pytest.mark.parametrize("H", (5120, 7168))
def test_v3_knobs_batch_invariance(H: int) -> None:
    # A call of the whole batch with one knob config, calls of row ranges with another: same bits.
    f = functools.partial(CoefficientsConfig.for_shape, H, False)
    whole = f(64, push_vec=True, row_split=2, min_blocks=2)
    ranges = f(32, push_vec=True)
    x = torch.randn(MAX_ROWS, 4, H, device="cuda", generator=gen(45)).to(BF16)
    full = call(x, config=whole)
    for start, rows in ((0, 1), (63, 1), (511, 1), (200, 7), (3, 16), (300, 129), (1, 64)):
        part = call(x[start : start + rows], config=ranges)
        for name in ("post", "comb", "pre"):
            assert bitwise_equal(getattr(part, name), getattr(full, name)[start : start + rows]), name


def wait_or_fail(seconds: float = 20.0) -> None:
    """Synchronize, or fail the test (instead of hanging the run) when the GPU has not finished in time."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            pytest.fail(f"the kernel has not finished after {seconds} s: the handoff hangs")
        time.sleep(1e-3)


NAN_CONFIGS = [
    None,
    CoefficientsConfig.for_shape(7168, False, 64),
    CoefficientsConfig.for_shape(7168, False, 32, push_vec=True, row_split=2),
    CoefficientsConfig.for_shape(7168, False, 64, push_vec=True, row_split=2, min_blocks=2),
]


@pytest.mark.parametrize("config", NAN_CONFIGS, ids=["default", "tile64", "vec-split", "vec-split-mb2"])
@pytest.mark.parametrize("rows", (40, 512))
def test_nan_and_inf_rows_do_not_hang_and_stay_in_their_row(config: CoefficientsConfig | None, rows: int) -> None:
    # The ticket handoff polls the workspace until no slot holds the NaN sentinel: a NaN partial
    # (a NaN or an Inf in the streams) must never read as the sentinel, or the poll never ends.
    H = 7168
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    clean = streams(rows, H, seed=49)
    pre_mix = carried_pre(rows)
    want = call(clean, inline=True, pre_mix=pre_mix, ws=ws, config=config)
    wait_or_fail()
    bad_rows = [3, 17, rows - 1]
    x = clean.clone()
    x[3, 1, 100] = float("nan")
    x[17, 0, 5] = float("inf")
    x[rows - 1, 3, H - 1] = float("-inf")
    got = call(x, inline=True, pre_mix=pre_mix, ws=ws, config=config)
    wait_or_fail()
    good = torch.ones(rows, dtype=torch.bool, device="cuda")
    good[bad_rows] = False
    for name in Out._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert bitwise_equal(a[good], b[good]), f"{name} of the finite rows changed"
    for name in ("post", "comb", "pre"):
        assert bool(getattr(got, name)[bad_rows].isnan().all()), f"{name} of the NaN / Inf rows is not all NaN"
    assert bool(got.layer_input[3].isnan().all())
    assert_counters_clean(ws)
    # And the next call on the same workspace is unaffected.
    again = call(clean, inline=True, pre_mix=pre_mix, ws=ws, config=config)
    wait_or_fail()
    for name in Out._fields:
        assert bitwise_equal(getattr(again, name), getattr(want, name)), name
    assert_counters_clean(ws)


def test_graph_replay_and_mixed_schedules_keep_the_workspace_clean() -> None:
    H, rows = 7168, 40
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    config = CoefficientsConfig.for_shape(H, False, 64)  # the tile schedule's ticket handoff
    other = coefficients_config(H, CoefficientsVariant(), rows, arch=arch())  # the split partials tile
    x = streams(rows, H, seed=47)
    pre_mix = carried_pre(rows)
    out = call(x, inline=True, pre_mix=pre_mix, ws=ws, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(x, inline=True, pre_mix=pre_mix, ws=ws, out=out, config=config)
    for step in range(3):
        x.copy_(streams(rows, H, seed=800 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(x))
        assert_counters_clean(ws)
        # The other schedule on the same workspace right after.
        assert_matches(call(x, ws=ws, config=other), reference(x))
        assert_counters_clean(ws)


# --- launches in a row, streams, CUDA graphs, workspace reuse -----------------------------------


def test_chained_launches_read_the_previous_output() -> None:
    # Each call's carried pre is the previous call's output: the PDL wait must order them.
    H, rows, steps = 7168, 16, 6
    xs = [streams(rows, H, seed=100 + i) for i in range(steps)]
    pre = carried_pre(rows)
    outs = []
    for x in xs:
        outs.append(call(x, inline=True, pre_mix=pre))
        pre = outs[-1].pre
    torch.cuda.synchronize()
    pre = carried_pre(rows)
    for x, got in zip(xs, outs):
        want = ref.rms_norm(ref.collapse(x, pre), weights(H).norm_weight, NORM_EPS)
        assert max_ulp(got.layer_input, want) <= 1
        assert_matches(got, reference(x))
        pre = got.pre
    assert_counters_clean(workspace(H))


def test_side_stream_and_workspace_reuse_across_row_counts() -> None:
    H = 5120
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    side = torch.cuda.Stream()
    for rows in (512, 1, 129, 7, 64, 512, 2):
        x = streams(rows, H, seed=rows + 1000)
        side.wait_stream(torch.cuda.current_stream())
        if rows % 2:
            with torch.cuda.stream(side):
                got = call(x, ws=ws)
        else:
            got = call(x, ws=ws, stream=side)
        torch.cuda.current_stream().wait_stream(side)
        assert_matches(got, reference(x))
        e = x[:, 2].contiguous()
        assert_matches(call(e, broadcast=True, ws=ws), reference(e, broadcast=True))
        assert_counters_clean(ws)


@pytest.mark.parametrize("inline", (False, True))
def test_cuda_graph_replay_with_inputs_changed_in_place(inline: bool) -> None:
    H, rows = 7168, 16
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    x = streams(rows, H, seed=21)
    pre_mix = carried_pre(rows)
    out = call(x, inline=inline, pre_mix=pre_mix, ws=ws)  # compiles before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(x, inline=inline, pre_mix=pre_mix, ws=ws, out=out)
    for step in range(3):
        x.copy_(streams(rows, H, seed=300 + step))
        pre_mix.copy_(carried_pre(rows, seed=400 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(x))
        if inline:
            want = ref.rms_norm(ref.collapse(x, pre_mix), weights(H).norm_weight, NORM_EPS)
            assert max_ulp(out.layer_input, want) <= 1
        assert_counters_clean(ws)


# --- timing sweep (python -m tests.test_coefficients_kernel_gpu) --------------------------------


def _time_us(fn, launches: int = 20, reps: int = 20) -> float:
    """GPU time per launch of `launches` back-to-back calls replayed as one CUDA graph (median)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return sorted(times)[len(times) // 2]


def main() -> None:
    print(f"{'H':>5} {'rows':>5} {'standard us':>12} {'broadcast us':>13} {'inline us':>10} {'floor us':>9}")
    for H in HIDDEN:
        for rows in (1, 4, 16, 64, 256, 512):
            x = streams(rows, H)
            e = x[:, 0].contiguous()
            pre_mix = carried_pre(rows)
            std = _time_us(functools.partial(call, x))
            bc = _time_us(functools.partial(call, e, broadcast=True))
            inl = _time_us(functools.partial(call, x, inline=True, pre_mix=pre_mix))
            floor = (24 * 4 * H * 4 + rows * 4 * H * 2) / 4.3e6
            print(f"{H:>5} {rows:>5} {std:>12.2f} {bc:>13.2f} {inl:>10.2f} {floor:>9.2f}")


if __name__ == "__main__":
    main()


# --- the partials schedule (two launches, no cluster): the default's bits ------------------------


def partials_config(H: int, broadcast: bool, rows_per_tile: int = 64, **knobs) -> CoefficientsConfig:
    return CoefficientsConfig.for_shape(H, broadcast, rows_per_tile, schedule="partials", **knobs)


def assert_default_bits(
    H: int, broadcast: bool, configs: tuple, row_counts: tuple, seed: int, reference_rows: int | None = None
) -> None:
    """Each config gives the default's bits at every row count (and the default matches the reference
    at `reference_rows`); the counters are clean after each row count."""
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    for rows in row_counts:
        x = streams(rows, H, seed=rows + seed)
        if broadcast:
            x = x[:, 1].contiguous()
        want = call(x, broadcast=broadcast, ws=ws)
        if rows == reference_rows:
            assert_matches(want, reference(x, broadcast=broadcast))
        for config in configs:
            got = call(x, broadcast=broadcast, ws=ws, config=config)
            wait_or_fail()
            for name in ("post", "comb", "pre"):
                assert bitwise_equal(getattr(got, name), getattr(want, name)), f"{name}, {rows} rows, {config}"
        assert_counters_clean(ws)


@pytest.mark.parametrize("H", (4096, 5120, 7168))
@pytest.mark.parametrize("broadcast", (False, True))
def test_partials_schedule_gives_the_default_bits(H: int, broadcast: bool) -> None:
    configs = (partials_config(H, broadcast), partials_config(H, broadcast, 32, row_split=2))
    assert_default_bits(H, broadcast, configs, (1, 7, 64, 65, 129, 300, 512), seed=80, reference_rows=300)


@pytest.mark.parametrize(
    "knobs,rows,inf_row",
    (
        (dict(min_blocks=3), 200, 150),
        (dict(min_blocks=3, stage_rows=True), 300, 290),  # v8: rows staged in shared memory
        (dict(rows_per_tile=32, stage_rows=True), 300, 290),
        (dict(rows_per_tile=512, row_split=2, stage_rows=True, stage_depth=2), 300, 290),
        (dict(rows_per_tile=512, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2), 300, 290),
    ),
)
def test_partials_schedule_nan_rows_and_graph_replay(knobs: dict, rows: int, inf_row: int) -> None:
    H = 7168
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    config = partials_config(H, False, **knobs)
    x = streams(rows, H, seed=81)
    want = call(x, ws=ws)
    bad = x.clone()
    bad[5, 2, 11] = float("nan")
    bad[inf_row, 0, 3] = float("inf")
    got = call(bad, ws=ws, config=config)
    wait_or_fail()
    good = torch.ones(rows, dtype=torch.bool, device="cuda")
    good[[5, inf_row]] = False
    for name in ("post", "comb", "pre"):
        assert bitwise_equal(getattr(got, name)[good], getattr(want, name)[good]), name
        assert bool(getattr(got, name)[[5, inf_row]].isnan().all()), name
    out = call(x, ws=ws, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # back to back: each call's finish launch must end before the next writes
            call(x, ws=ws, out=out, config=config)
    for step in range(2):
        x.copy_(streams(rows, H, seed=910 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(x))
    assert_counters_clean(ws)


@pytest.mark.parametrize("H", (4096, 5120, 7168))
@pytest.mark.parametrize("variant", ("inline", "first"))
def test_partials_schedule_inline_gives_the_default_bits(H: int, variant: str) -> None:
    # With a layer input the first launch keeps its layer-input clusters; the coefficients and the
    # layer input both keep the default's bits. The row counts straddle the defaults' bands (H 5120
    # inline: the 32-row tile to 11 rows, 32-row partials tiles from 12, 64-row ones from 209), and
    # the first band's tile config runs at every row count, so each band switch keeps the bits.
    broadcast = variant == "first"
    ws = CoefficientsWorkspace(H, MAX_ROWS, "cuda")
    configs = (
        coefficients_config(H, CoefficientsVariant.of(broadcast, True, True), 1, arch=arch()),
        partials_config(H, broadcast, 32),
        partials_config(H, broadcast, 64),
        partials_config(H, broadcast, 64, row_split=2),
    )
    for rows in (1, 11, 12, 16, 129, 209, 300, 512):
        x = streams(rows, H, seed=rows + 90)
        if broadcast:
            x = x[:, 0].contiguous()
        pre_mix = None if broadcast else carried_pre(rows)
        want = call(x, broadcast=broadcast, inline=True, pre_mix=pre_mix, ws=ws)
        for config in configs:
            got = call(x, broadcast=broadcast, inline=True, pre_mix=pre_mix, ws=ws, config=config)
            wait_or_fail()
            for name in Out._fields:
                assert bitwise_equal(getattr(got, name), getattr(want, name)), f"{name}, {rows} rows, {config}"
        assert_counters_clean(ws)


# --- the partials schedule with taller tiles and rows staged in shared memory (v8) ------------------


@pytest.mark.parametrize("H", (4096, 5120, 7168))
@pytest.mark.parametrize("broadcast", (False, True))
def test_partials_tall_and_staged_tiles_give_the_default_bits(H: int, broadcast: bool) -> None:
    # Taller tiles (128 and 256 rows, split or not) and the per-lane cp.async staging change only which
    # CTA multiplies a row and how its words reach the MMAs: every config, every row count, the same bits.
    configs = (
        partials_config(H, broadcast, 128, row_split=2),
        partials_config(H, broadcast, 256),
        partials_config(H, broadcast, 16, stage_rows=True),
        partials_config(H, broadcast, 32, stage_rows=True, row_split=2),
        partials_config(H, broadcast, 64, stage_rows=True),
        partials_config(H, broadcast, 128, stage_rows=True, row_split=2),
        # A staging ring: 2-3 of the tile's 64-row batches in flight, each slot refilled after its MMAs.
        partials_config(H, broadcast, 512, stage_rows=True, stage_depth=2, row_split=2),
        partials_config(H, broadcast, 256, stage_rows=True, stage_depth=3, row_split=4),
        partials_config(H, broadcast, 512, stage_rows=True, stage_depth=4),
        # Two buffers of warp sums, one barrier per batch.
        partials_config(H, broadcast, 512, stage_rows=True, stage_depth=2, row_split=4, sum_buffers=2),
        partials_config(H, broadcast, 128, row_split=2, sum_buffers=2),
    )
    assert_default_bits(H, broadcast, configs, (1, 7, 33, 64, 65, 129, 300, 512), seed=120)
