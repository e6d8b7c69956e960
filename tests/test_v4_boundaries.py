"""V4Boundaries, the DeepSeek-V4 scheme's scheduler (CONTRACT §4d, §5): each call against the reference
(`tests/test_reference_v4.py` holds the reference to a float64 formulation), a whole toy step against the same step
written out with no scheduler, the quantized forms, the errors; on the GPU, the kernels' step against the plain one."""

from __future__ import annotations

import pytest
import torch

from boundary import BoundaryAllReduce, BoundaryState, DecodeStep
from boundary import reference as ref
from boundary.params import MHCParams
from boundary.toy import (
    ToyConfig,
    ToyModel,
    compare,
    decode_step,
    decode_step_v4,
    decode_step_v4_plain,
    random_tokens,
)
from boundary.v4 import V4Boundaries
from tests.bf16 import bitwise_equal
from tests.inputs import attn_params

CPU = torch.device("cpu")
CONFIG = ToyConfig(hidden_size=512, num_layers=3, vocab=64)  # an Engram seam at layer 1


def v4(hidden: int = 512, device: torch.device = CPU) -> V4Boundaries:
    return V4Boundaries(BoundaryAllReduce(hidden, max_rows=16, device=device))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_v4_step_is_the_written_out_step_bit_for_bit(rows: int) -> None:
    model = ToyModel(CONFIG)
    b = v4()
    for index in range(2):
        tokens = random_tokens(model, rows, index)
        out = decode_step_v4(model, b, tokens, DecodeStep(rows=rows, side_stream=False))
        assert compare(out, decode_step_v4_plain(model, tokens))["bitwise"]
        assert out.aux is None


def test_the_v4_step_is_another_scheme_than_v41s() -> None:
    """The same weights through the own-pre scheme and the delayed one give other hidden states."""
    from boundary import Boundaries

    model = ToyModel(CONFIG)
    tokens = random_tokens(model, 3, 0)
    step = DecodeStep(rows=3, side_stream=False)
    own = decode_step_v4(model, v4(), tokens, step)
    delayed = decode_step(model, Boundaries(BoundaryAllReduce(512, max_rows=16, device=CPU)), tokens, step)
    assert not torch.equal(own.hidden, delayed.hidden)


def test_a_sublayer_call_is_the_references_v4_boundary() -> None:
    """sublayer = post with the carried mixes, then the entry on R' (its own mixes, own-pre collapse, norm): the
    reference's v4_boundary on the same inputs, bit for bit."""
    model = ToyModel(CONFIG)
    layer = model.layers[2]
    b, step = v4(), DecodeStep(rows=4, side_stream=False)
    state, _ = b.first(model.layers[0], model.embed[random_tokens(model, 4, 0)], step)
    y = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = ref.v4_boundary(
        y,
        state.residual,
        state.post,
        state.comb,
        attn_params(layer),
        layer.attn_norm.weight,
        layer.attn_norm.variance_epsilon,
    )
    state.pending = y
    got, x, q = b.sublayer(layer, False, state, step)
    assert q is None and state.pending is None  # consumed
    assert bitwise_equal(got.residual, want.residual) and bitwise_equal(x, want.layer_input)
    for g, w in ((got.post, want.post), (got.comb, want.comb), (got.pre, want.pre)):
        assert torch.equal(g, w)


def test_the_first_entry_collapses_the_broadcast_embedding_with_its_own_pre() -> None:
    model = ToyModel(CONFIG)
    first = model.layers[0]
    e = model.embed[random_tokens(model, 3, 0)]
    state, x = v4().first(first, e, DecodeStep(rows=3, side_stream=False))
    broadcast = MHCParams(first.hc_attn_fn_broadcast, *attn_params(first)[1:])
    want = ref.v4_enter(state.residual, broadcast, first.attn_norm.weight, first.attn_norm.variance_epsilon, x=e)
    assert bitwise_equal(x, want.layer_input) and torch.equal(state.pre, want.pre)
    assert not torch.equal(state.pre, ref.one_hot_pre(3))  # V4.1's first site collapses with [1, 0, 0, 0]


def test_the_final_takes_one_launch_at_few_elements_and_two_beyond() -> None:
    """own_pre_final: the one-launch final (the boundary computes hc_head's weights) where it was measured faster."""
    from cute_kernels.boundary.config import own_pre_final

    for rows, hidden in ((1, 4096), (16, 7168), (128, 7168), (256, 7168), (512, 4096)):
        assert own_pre_final(rows, hidden)
    for rows, hidden in ((293, 7168), (513, 4096), (512, 7168), (512, 5120)):
        assert not own_pre_final(rows, hidden)


@pytest.mark.parametrize("one_launch", [True, False])
def test_final_is_post_then_hc_head_then_the_final_norm(one_launch: bool, monkeypatch) -> None:
    from cute_kernels.boundary import config

    monkeypatch.setattr(config, "OWN_PRE_FINAL_MAX_ELEMENTS", config.OWN_PRE_FINAL_MAX_ELEMENTS * one_launch)
    model = ToyModel(CONFIG)
    b, step = v4(), DecodeStep(rows=2, side_stream=False)
    paths: list[str] = []
    head_final, post_only = b._boundaries._calls.head_final, b._boundaries.post_only
    monkeypatch.setattr(b._boundaries._calls, "head_final", lambda *a: paths.append("one") or head_final(*a))
    monkeypatch.setattr(b._boundaries, "post_only", lambda *a: paths.append("two") or post_only(*a))
    state, _ = b.first(model.layers[0], model.embed[random_tokens(model, 2, 0)], step)
    y = torch.randn(2, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    new = ref.mhc_post(y, state.residual, state.post, state.comb)
    h = ref.hc_head(new, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.rms_norm_eps, model.hc_eps)
    want = ref.rms_norm(h, model.final_norm.weight, model.final_norm.variance_epsilon)
    state.pending = y
    got = b.final(state, model, model.final_norm)
    assert bitwise_equal(got, want) and state.pending is None
    state.pending = y
    assert bitwise_equal(b.final(state, model, model.final_norm.weight, model.final_norm.variance_epsilon), want)
    assert paths == ["one" if one_launch else "two"] * 2


@pytest.mark.parametrize("form", ["mxfp8", "fp8_1x128", "fp8_1x128_ue8m0", True])
def test_the_quantized_layer_input_is_the_references_bytes(form) -> None:
    model = ToyModel(CONFIG)
    b, step = v4(), DecodeStep(rows=3, side_stream=False)
    state, _ = b.first(model.layers[0], model.embed[random_tokens(model, 3, 0)], step)
    state.pending = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _, x, q = b.sublayer(model.layers[0], True, state, step, quantize=form)
    if form in ("mxfp8", True):
        data, scale = ref.mxfp8_quantize(x)
    else:
        data, scale = ref.fp8_group_quantize(x, ue8m0=form.endswith("ue8m0"))
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))


def test_errors_name_the_argument() -> None:
    model = ToyModel(CONFIG)
    b, step = v4(), DecodeStep(rows=2, side_stream=False)
    with pytest.raises(TypeError, match="all_reduce must be a BoundaryAllReduce"):
        V4Boundaries("tp")  # type: ignore[arg-type]
    state, _ = b.first(model.layers[0], model.embed[random_tokens(model, 2, 0)], step)
    with pytest.raises(ValueError, match="state.pending is None"):
        b.sublayer(model.layers[0], True, state, step)
    state.pending = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantize"):
        b.sublayer(model.layers[0], True, state, step, quantize="nvfp4")
    with pytest.raises(TypeError, match="ffn"):
        b.sublayer(model.layers[0], 1, state, step)  # type: ignore[arg-type]
    norm = model.layers[0].ffn_norm
    weight, eps = norm.weight, norm.variance_epsilon
    norm.weight = weight.float()
    with pytest.raises(TypeError, match="layer.ffn_norm.weight must have dtype torch.bfloat16"):
        b.sublayer(model.layers[0], True, state, step)
    norm.weight, norm.variance_epsilon = weight, float("nan")
    with pytest.raises(ValueError, match="layer.ffn_norm.variance_epsilon must be finite"):
        b.sublayer(model.layers[0], True, state, step)
    norm.variance_epsilon = eps
    assert state.pending is not None  # a refused call consumes nothing, the norm's refusals included

    class NoHead:
        hc_head_fn = model.hc_head_fn

    with pytest.raises(TypeError, match="without hc_head_scale"):
        b.final(state, NoHead(), model.final_norm)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="eps is missing"):
        b.final(state, model, model.final_norm.weight)
    with pytest.raises(TypeError, match="norm_weight"):
        b.final(state, model, model.final_norm.weight.float(), 1e-6)
    assert state.pending is not None  # a refused final consumes nothing either
    with pytest.raises(TypeError, match="step must be a DecodeStep"):
        b.first(model.layers[0], model.embed[:2], 2)  # type: ignore[arg-type]
    assert isinstance(state, BoundaryState)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("rows", "one_launch_final"), [(1, True), (16, True), (16, False)])
def test_the_v4_step_on_the_kernels_tracks_the_written_out_step(rows: int, one_launch_final: bool, monkeypatch) -> None:
    """On the kernels (the fused residual-only boundary, the coefficients, the layer-input kernel; the final in one
    launch or two) the V4 step tracks the written-out one: each boundary may differ by a bf16 ulp and each mix by the
    projection's fp32 order."""
    from cute_kernels.boundary import config

    monkeypatch.setattr(config, "OWN_PRE_FINAL_MAX_ELEMENTS", config.OWN_PRE_FINAL_MAX_ELEMENTS * one_launch_final)
    hidden = 4096
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=3), device="cuda")
    ar = BoundaryAllReduce(hidden, max_rows=16, device="cuda")
    b = V4Boundaries(ar)
    b.warmup(progress=False, quantize=("mxfp8",))
    tokens = random_tokens(model, rows, 0)
    out = decode_step_v4(model, b, tokens, DecodeStep(rows=rows, side_stream=False))
    plain = decode_step_v4_plain(model, tokens)
    diff = compare(out, plain)
    assert diff["max_rel"] < 5e-2, diff
    cos = torch.nn.functional.cosine_similarity(out.hidden.float().flatten(), plain.hidden.float().flatten(), dim=0)
    assert cos > 0.999, float(cos)
    with pytest.raises(ValueError, match="critical path"):
        decode_step_v4(model, b, tokens, DecodeStep(rows=rows, side_stream=True))
    # Through the custom ops, captured in a CUDA graph and replayed on new tokens: the eager direct path's bits.
    step = DecodeStep(rows=rows, side_stream=False)
    through_ops = V4Boundaries(ar, custom_ops=True)
    static = tokens.clone()
    decode_step_v4(model, through_ops, static, step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_step_v4(model, through_ops, static, step)
    for index in (1, 2):
        static.copy_(random_tokens(model, rows, index))
        graph.replay()
        torch.cuda.synchronize()
        assert compare(captured, decode_step_v4(model, b, static, step))["bitwise"], index
    ar.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("rows", "one_launch_final"), [(4, True), (4, False)])
def test_a_graph_replayed_after_weights_updated_reads_hc_heads_new_weights(
    rows: int, one_launch_final: bool, monkeypatch
) -> None:
    """hc_head's scale, base and fn updated as a loader writes them (`param.data.copy_`, no version bump), then
    `weights_updated()`: a V4 step captured before, replayed, gives the eager step's bits on the new weights; without
    the call the replay keeps the old copy (the negative control)."""
    from cute_kernels.boundary import config

    monkeypatch.setattr(config, "OWN_PRE_FINAL_MAX_ELEMENTS", config.OWN_PRE_FINAL_MAX_ELEMENTS * one_launch_final)
    hidden = 4096
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=2), device="cuda")
    b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=8, device="cuda"))
    b.warmup(progress=False, quantize=("mxfp8",))
    step, tokens = DecodeStep(rows=rows, side_stream=False), random_tokens(model, rows, 0)
    decode_step_v4(model, b, tokens, step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_step_v4(model, b, tokens, step)
    before = decode_step_v4(model, b, tokens, step).hidden.clone()
    g = torch.Generator(device="cuda").manual_seed(9)
    model.hc_head_scale.data.copy_(model.hc_head_scale * 3)
    model.hc_head_base.data.copy_(torch.randn(4, device="cuda", generator=g))
    model.hc_head_fn.data.copy_(model.hc_head_fn.flip(1))
    graph.replay()
    torch.cuda.synchronize()
    stale = captured.hidden.clone()  # not seen: scale and base (and fn past one launch) are the old copies
    b.weights_updated()
    graph.replay()
    torch.cuda.synchronize()
    want = decode_step_v4(model, b, tokens, step).hidden
    assert bitwise_equal(captured.hidden, want)
    assert not bitwise_equal(want, before) and not bitwise_equal(stale, want)


def test_the_v4_step_through_the_custom_ops_compiles_whole_with_the_direct_paths_bits() -> None:
    """V4Boundaries(custom_ops=True) drives post_only, mhc_mixes and collapse_norm as torch.ops.mhc_boundary ops: the
    decode step traces as one graph with no break, and gives the direct path's bits eagerly and compiled."""
    torch._dynamo.reset()
    model = ToyModel(CONFIG)
    ar = BoundaryAllReduce(512, max_rows=8, device=CPU)
    direct, through_ops = V4Boundaries(ar), V4Boundaries(ar, custom_ops=True)
    step = DecodeStep(rows=3, side_stream=False)
    tokens = random_tokens(model, 3, 0)
    assert compare(decode_step_v4(model, through_ops, tokens, step), decode_step_v4(model, direct, tokens, step))[
        "bitwise"
    ]
    explained = torch._dynamo.explain(decode_step_v4)(model, through_ops, tokens, step)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(decode_step_v4, fullgraph=True, backend="aot_eager")
    for index in range(2):
        tokens = random_tokens(model, 3, index)
        got = compiled(model, through_ops, tokens, step)
        assert compare(got, decode_step_v4(model, direct, tokens, step))["bitwise"], index


def test_the_step_through_the_ops_compiles_with_dynamic_shapes_and_a_bad_input_says_what() -> None:
    """`dynamic=True` makes the layer's and the head's floats symbolic: the host checks must not call math on them
    (they are checked when the op runs). A bad input under fullgraph reaches the caller quoting our message (Dynamo
    cannot trace an attribute set on an exception; it said only that before)."""
    torch._dynamo.reset()
    model = ToyModel(CONFIG)
    ar = BoundaryAllReduce(512, max_rows=32, device=CPU)
    direct, through_ops = V4Boundaries(ar), V4Boundaries(ar, custom_ops=True)

    def step_of(model: ToyModel, boundaries: V4Boundaries, tokens: torch.Tensor):  # noqa: ANN202
        return decode_step_v4(model, boundaries, tokens, DecodeStep(tokens.shape[0], False))

    compiled = torch.compile(step_of, fullgraph=True, backend="aot_eager", dynamic=True)
    for rows in (3, 5, 17):
        tokens = random_tokens(model, rows, rows)
        assert compare(compiled(model, through_ops, tokens), step_of(model, direct, tokens))["bitwise"], rows
    torch._dynamo.reset()
    model.hc_head_fn = model.hc_head_fn.to(torch.bfloat16)
    with pytest.raises(Exception, match=r"head.hc_head_fn must have dtype torch.float32"):
        torch.compile(step_of, fullgraph=True, backend="aot_eager")(model, through_ops, random_tokens(model, 3, 0))


def test_the_collapse_norm_op_has_a_fake_of_the_layer_inputs_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        r = torch.empty(5, 4, 512, dtype=torch.bfloat16)
        out = torch.ops.mhc_boundary.collapse_norm(
            r, torch.empty(5, 4), torch.empty(512, dtype=torch.bfloat16), 1e-6, "auto"
        )
    assert out.shape == (5, 512) and out.dtype == torch.bfloat16


def test_the_own_pre_and_head_input_ops_have_fakes_of_their_outputs_shapes() -> None:
    """mhc_own_pre: (post [T, hc], comb [T, hc, hc], pre [T, hc] fp32, layer input [T, H] bf16); hc_head_input: the
    final hidden state [T, H] bf16."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        r = torch.empty(5, 4, 512, dtype=torch.bfloat16)
        f32 = torch.float32
        w = torch.empty(512, dtype=torch.bfloat16)
        post, comb, pre, x = torch.ops.mhc_boundary.mhc_own_pre(
            r,
            torch.empty(24, 2048),
            torch.empty(3),
            torch.empty(24),
            1e-6,
            1e-6,
            1e-6,
            2.0,
            20,
            w,
            1e-6,
            None,
            None,
            None,
        )
        h = torch.ops.mhc_boundary.hc_head_input(
            r, torch.empty(4, 2048), torch.empty(1), torch.empty(4), 1e-6, 1e-6, w, 1e-6
        )
    assert (post.shape, comb.shape, pre.shape, x.shape) == ((5, 4), (5, 4, 4), (5, 4), (5, 512))
    assert post.dtype == comb.dtype == pre.dtype == f32 and x.dtype == torch.bfloat16
    assert h.shape == (5, 512) and h.dtype == torch.bfloat16


def test_the_own_pre_op_takes_its_quantized_form_whole_or_not_at_all() -> None:
    """mhc_own_pre: form, data and scale together or none of them; anything else is a TypeError naming them."""
    layer = ToyModel(CONFIG).layers[0]
    r = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    data = torch.empty(2, 512, dtype=torch.float8_e4m3fn)
    args = (r, *attn_params(layer), layer.attn_norm.weight, 1e-6)
    for form, d, s in (
        ("mxfp8", None, None),
        (None, data, torch.empty(8, dtype=torch.uint8)),
        ("fp8_1x128", data, None),
    ):
        with pytest.raises(TypeError, match="form, data and scale together"):
            torch.ops.mhc_boundary.mhc_own_pre(*args, d, s, form, "reference")


@pytest.mark.parametrize("one_launch_final", [True, False])
def test_on_the_kernels_a_boundary_is_one_coefficients_launch_that_collapses_with_its_own_pre(
    one_launch_final: bool, monkeypatch
) -> None:
    """The kernel path's plumbing, with the coefficients and layer-input launches stubbed by the reference on the CPU:
    the first entry is the coefficients kernel on the embedding (no layer input), then the layer-input kernel with the
    very pre it returned; every later entry is one coefficients launch of the own-pre variant (its layer input, and
    its quantized form, from the pre it computes); the one-launch final step launches no coefficients kernel (the
    boundary computes hc_head's weights itself: test_boundary_own_pre), the two-launch one a coefficients launch of
    the own-pre variant on hc_head's weights; the step's bits are the reference path's."""
    from boundary import mhc
    from cute_kernels.boundary import config

    monkeypatch.setattr(config, "OWN_PRE_FINAL_MAX_ELEMENTS", config.OWN_PRE_FINAL_MAX_ELEMENTS * one_launch_final)

    calls: list[tuple] = []

    def coefficients(x, fn, scale, base, *, broadcast, post_out, comb_out, pre_out, layer_input_out, **kw):
        own, quant = kw.get("own_pre", False), kw.get("quant")
        calls.append(("coefficients", broadcast, own, quant, pre_out))
        repeat = kw["sinkhorn_repeat"]
        p = MHCParams(fn, scale, base, *(kw[k] for k in ("rms_eps", "pre_eps", "sinkhorn_eps", "post_mult")), repeat)
        got = ref.coefficients(x if broadcast else x.reshape(x.shape[0], -1), p)
        post_out.copy_(got.post), comb_out.copy_(got.comb), pre_out.copy_(got.pre)
        assert (layer_input_out is not None) == own  # only the own-pre variant writes a layer input here
        if own:
            layer_input_out.copy_(ref.rms_norm(ref.collapse(x, got.pre), kw["norm_weight"], kw["norm_eps"]))
            if quant is not None:
                ref.quantize_into(layer_input_out, kw["quant_data"], kw["quant_scale"], quant)

    def layer_input(x, pre_mix, norm_weight, norm_eps, out, *, arch, quant=None, quant_data=None, quant_scale=None):
        calls.append(("layer input", quant, pre_mix))
        out.copy_(ref.rms_norm(ref.collapse(x, pre_mix), norm_weight, norm_eps))
        if quant is not None:
            ref.quantize_into(out, quant_data, quant_scale, quant)

    monkeypatch.setattr(mhc, "kernel_arch", lambda device, backend: None if backend == "reference" else "sm_90a")
    monkeypatch.setattr(mhc, "prepare_workspace", lambda *args, **kwargs: None)
    monkeypatch.setattr(mhc, "_check_kernel_args", lambda *args, **kwargs: None)
    monkeypatch.setattr(mhc, "mhc_coefficients", coefficients)
    monkeypatch.setattr(mhc, "mhc_layer_input", layer_input)
    model = ToyModel(ToyConfig(hidden_size=1024, num_layers=3, vocab=64))  # a quantized form on the kernels: H % 1024
    tokens = random_tokens(model, 3, 0)
    step = DecodeStep(rows=3, side_stream=False)
    kernels = v4(1024)
    kernels.backend = "kernel"  # the mixes and the layer input on the (stubbed) kernels; the reduction the reference's
    state, x = kernels.first(model.layers[0], model.embed[tokens], step)
    assert [c[:2] for c in calls] == [("coefficients", True), ("layer input", None)]
    assert calls[1][2] is calls[0][4] and torch.equal(state.pre, calls[0][4])  # collapsed with the pre it computed
    calls.clear()
    state.pending = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _, x2, q = kernels.sublayer(model.layers[0], True, state, step, quantize="fp8_1x128_ue8m0")
    assert [c[:4] for c in calls] == [("coefficients", False, True, "fp8_1x128_ue8m0")]  # one launch
    assert q.ue8m0 and q.quant_key == "fp8_e4m3_ue8m0_1x128_colmajor"  # the kernel's form is the one asked for
    calls.clear()
    out = decode_step_v4(model, kernels, tokens, step)
    assert compare(out, decode_step_v4_plain(model, tokens))["bitwise"]
    assert ("coefficients", False, True, "mxfp8") in [c[:4] for c in calls]  # the last MoE entry's MXFP8
    # The first entry's two launches, then one per later entry (the Engram seam's pre too); the final's, if any.
    assert [c[0] for c in calls[:2]] == ["coefficients", "layer input"]
    assert all(c[0] == "coefficients" and c[2] for c in calls[2:])
    assert len(calls) == 2 + (2 * len(model.layers) - 1) + (not one_launch_final)


def test_hc_heads_kernel_weights_are_built_once_per_head_and_again_after_an_in_place_update() -> None:
    """mhc._head_weights: fn and base as the first hc of the 24 mixes, zeros after; cached per head, and rewritten in
    place when fn, scale or base changed in place."""
    from boundary import mhc

    g = torch.Generator().manual_seed(5)
    fn, scale, base = torch.randn(4, 4 * 256, generator=g), torch.tensor([0.5]), torch.randn(4, generator=g)
    fn24, scale3, base24 = mhc._head_weights(fn, scale, base)
    assert torch.equal(fn24[:4], fn) and not fn24[4:].any() and torch.equal(base24[:4], base) and not base24[4:].any()
    assert scale3[0] == 0.5 and mhc._head_weights(fn, scale, base)[0] is fn24  # cached
    fn.mul_(2)
    assert mhc._head_weights(fn, scale, base)[0] is fn24 and torch.equal(fn24[:4], fn)  # rewritten in place
    scale.fill_(0.25)
    assert mhc._head_weights(fn, scale, base)[1][0] == 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_hc_heads_weights_on_the_kernels_are_the_references_within_fp32(hidden: int) -> None:
    """mhc.head_mix on the kernels (the coefficients kernel's pre) against reference.hc_head_mix: the same formula, the
    projection's fp32 order apart, at 1-512 rows."""
    from boundary import mhc

    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1), device="cuda")
    BoundaryAllReduce(hidden, max_rows=512, device="cuda").warmup(progress=False, quantize=())
    for rows in (1, 7, 16, 129, 512):
        g = torch.Generator(device="cuda").manual_seed(rows)
        residual = torch.randn(rows, 4, hidden, device="cuda", generator=g).to(torch.bfloat16)
        head = (model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.rms_norm_eps, model.hc_eps)
        got = mhc.head_mix(residual, *head)
        want = ref.hc_head_mix(residual, *head)
        assert (got - want).abs().max() < 1e-5, rows


def ready_moe(model: ToyModel) -> ToyModel:
    """A copy of a (boundaries-only) model whose MoE returns its partial finalized by the reference (a ready tensor), so
    that no boundary finalizes a MoE output in the kernel (CONTRACT §2: that partial may be 1 ulp off)."""
    import copy

    ready = copy.copy(model)

    def moe(layer, x):
        out = model.moe(layer, x)
        routed = out.routed
        args = (routed.gemm2_permuted, routed.expert_weights, routed.expanded_idx_to_permuted_idx)
        return ref.moe_finalize(*args, out.shared_output)

    ready.moe = moe  # type: ignore[method-assign]
    return ready


def recorded_posts(boundaries: V4Boundaries, log: list) -> None:
    """Record each residual-only boundary of `boundaries` (every V4 boundary's reduction and post) outside a graph
    capture: copies of its ready partial, the streams and mixes it read, and the new streams."""
    inner = boundaries._boundaries
    post = inner._post

    def recording(state):
        if torch.cuda.is_current_stream_capturing():
            return post(state)
        args = (state.pending, state.residual, state.post, state.comb)
        args = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)
        out = post(state)
        log.append((*args, out.clone()))  # the step may inject into the new streams in place (an Engram seam)
        return out

    inner._post = recording


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("moe", ["ready", "in kernel"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_v4_simulated_ranks_step_on_the_rank_order_sums(world: int, moe: str) -> None:
    """W simulated ranks run the V4 step at once on one GPU (sublayers as fixed outputs), eagerly and captured in one
    CUDA graph replayed on new tokens: no rank gives up waiting, every rank gets the same bits, and the step tracks the
    one-rank kernel step whose sublayers return every rank's partial summed in rank order. With ready partials every
    boundary of the eager step is exact (CONTRACT §2): its new streams within 1 ulp plus the fp32 reassociation bound
    of their float64 value from the rank-order sum of the ranks' partials.

    Why not the one-rank step's bits (this test's form of 2026-12-03, failed on the H200): the peer and the one-rank
    boundary kernels each round the post within CONTRACT §2 but not always to the same word (a diagnosis on
    2026-12-04 found 1-3 words of 65536 one ulp apart per step, each side sometimes the reference's), and the next
    coefficients carry such a word on."""
    from bench.step import boundaries_only, summed_sublayers
    from tests.bf16 import within_contract

    hidden, rows = 4096, 4
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=8, device="cuda", timeout_us=1_000_000)
    V4Boundaries(ranks[0]).warmup(progress=False, quantize=("mxfp8",))
    config = ToyConfig(hidden_size=hidden, num_layers=2)
    models = [boundaries_only(ToyModel(config, rank=r, world_size=world, device="cuda"), rows) for r in range(world)]
    summed = summed_sublayers(models)
    if moe == "ready":
        models = [ready_moe(model) for model in models]
    torch.cuda.synchronize()
    boundaries = [V4Boundaries(ar) for ar in ranks]
    logs: list[list] = [[] for _ in range(world)]
    for b, log in zip(boundaries, logs):
        recorded_posts(b, log)
    step = DecodeStep(rows=rows, side_stream=False)
    static = random_tokens(models[0], rows, 0).clone()
    one = V4Boundaries(BoundaryAllReduce(hidden, max_rows=8, device="cuda"))

    def every_rank() -> list:
        calls = [lambda ar: decode_step_v4(models[ar.rank], boundaries[ar.rank], static, step)] * world
        return BoundaryAllReduce.run_simulated(ranks, calls)

    def check(outs: list, index: int) -> None:
        torch.cuda.synchronize()
        for ar in ranks:
            ar.check()  # no rank gave up waiting: a stall shows here, before the bits
        want = decode_step_v4(summed, one, static, step)
        for r in range(world):
            assert compare(outs[r], outs[0])["bitwise"], (index, r)
        assert compare(outs[0], want)["max_rel"] < 5e-2, index

    check(every_rank(), 0)  # also sizes each rank's coefficients workspace, outside the capture
    # Every boundary of the step but the final (the Engram seam's too): the final is one boundary that computes
    # hc_head's weights itself, held by the step's output below.
    assert len(logs[0]) == 2 * config.num_layers - 1
    if moe == "ready":
        for i, calls in enumerate(zip(*logs)):
            _, residual, post, comb, out = calls[0]
            y = ref.rank_sum([call[0] for call in calls]).double()
            post, comb, residual = post.double(), comb.double(), residual.double()
            exact = post[:, :, None] * y[:, None, :] + torch.einsum("tkj,tkh->tjh", comb, residual)
            terms = (post[:, :, None] * y[:, None, :]).abs() + torch.einsum("tkj,tkh->tjh", comb.abs(), residual.abs())
            assert bool(within_contract(out, exact, terms).all()), i
            assert all(bitwise_equal(call[4], out) for call in calls), i
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = every_rank()
    for index in range(1, 4):
        static.copy_(random_tokens(models[0], rows, index))
        graph.replay()
        check(outs, index)


def test_a_quantized_form_the_kernels_cannot_write_is_refused_before_the_reduction(monkeypatch) -> None:
    """On the kernels a quantized layer input needs H a multiple of 1024: at H 512 sublayer(quantize=...) raises a
    ValueError naming it, and state.pending is still there (a refused call consumes nothing)."""
    from boundary import mhc

    monkeypatch.setattr(mhc, "kernel_arch", lambda device, backend: "sm_90a")
    model = ToyModel(CONFIG)
    b = v4()
    state = BoundaryState(*(torch.zeros(2, 4, 512, dtype=torch.bfloat16), torch.ones(2, 4), torch.ones(2, 4, 4)), None)
    pending = torch.zeros(2, 512, dtype=torch.bfloat16)
    state.pending = pending
    with pytest.raises(ValueError, match="multiple of 1024"):
        b.sublayer(model.layers[0], True, state, DecodeStep(rows=2, side_stream=False), quantize="fp8_1x128")
    assert state.pending is pending


def test_a_model_made_in_inference_mode_runs_in_and_out_of_it() -> None:
    """Engines build or load under torch.inference_mode(): inference tensors keep no version counter, which the
    kernel forms of hc_head's weights read (V4's final failed in both modes)."""
    with torch.inference_mode():
        model = ToyModel(ToyConfig(hidden_size=256, num_layers=2))
    b = V4Boundaries(BoundaryAllReduce(256, max_rows=4, device=CPU))
    tokens = random_tokens(model, 2, 0)
    want = decode_step_v4_plain(model, tokens)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            assert compare(decode_step_v4(model, b, tokens, DecodeStep(2, side_stream=False)), want)["bitwise"]
