"""The torch.library ops (torch.ops.mhc_boundary.*, CONTRACT §5): the direct path's bits, eager and compiled with
fullgraph=True, their fake implementations, and the handle that names a rank's BoundaryAllReduce."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    empty_fp8_group_layer_input,
    empty_quantized_layer_input,
    mhc,
    mhc_post,
    mhc_pre_delayed,
    ops,
)
from boundary.params import MHCParams
from boundary.toy import ToyConfig, ToyModel, compare, decode_step, random_tokens
from tests.bf16 import bitwise_equal
from tests.inputs import boundary_inputs

BF16 = torch.bfloat16
H = 512
ROWS = 3
OPS = torch.ops.mhc_boundary
OP_NAMES = [
    "boundary",
    "boundary_ready",
    "post_only",
    "final",
    "hc_head_final",
    "mhc_pre_delayed",
    "mhc_mixes",
    "mhc_post",
    "collapse_norm",
]
SMALL = ToyConfig(hidden_size=H, num_layers=3, vocab=64)


def inputs(rows: int = ROWS, seed: int = 0) -> dict[str, torch.Tensor]:
    """A boundary's inputs (tests/inputs.py), a MoE partial and the coefficients' weights."""
    g = torch.Generator().manual_seed(seed + 1000)
    return boundary_inputs(rows, H, seed) | dict(
        permuted=torch.randn(2 * rows, H, generator=g).to(BF16),
        weights=torch.rand(rows, 2, generator=g),
        idx=torch.randint(-1, 2 * rows, (rows, 2), generator=g, dtype=torch.int32),
        fn=torch.randn(24, 4 * H, generator=g) * 0.01,
        fn_broadcast=torch.randn(24, H, generator=g) * 0.01,
        scale=torch.full((3,), 0.5) + 0.05 * torch.randn(3, generator=g),
        base=torch.randn(24, generator=g) * 0.5,
    )


@pytest.fixture(scope="module")
def ar() -> BoundaryAllReduce:
    return BoundaryAllReduce(H, max_rows=8, device="cpu")


def source(inp: dict, form: str) -> tuple:
    """The boundary ops' partial arguments (x, gemm2_permuted, expert_weights, idx, shared_output) for `form`."""
    if form == "ready":
        return inp["x"], None, None, None, None
    if form == "shared":
        return inp["x"], None, None, None, inp["shared"]
    return None, inp["permuted"], inp["weights"], inp["idx"], inp["shared"]


def direct(ar: BoundaryAllReduce, inp: dict, form: str, pre: bool, **outs: object) -> tuple:
    epilogue = (
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"] if pre else None,
        inp["norm_weight"] if pre else None,
        1e-20 if pre else 0.0,
        outs.pop("mxfp8_out", None),
    )
    if form == "moe":
        return ar.finalize(inp["permuted"], inp["weights"], inp["idx"], inp["shared"], *epilogue, **outs)
    return ar(inp["x"], *epilogue, shared_output=inp["shared"] if form == "shared" else None, **outs)


@pytest.mark.parametrize("form", ["ready", "shared", "moe"])
def test_the_boundary_op_gives_the_direct_paths_bits(ar: BoundaryAllReduce, form: str) -> None:
    inp = inputs()
    mx, fp8, aux = (
        empty_quantized_layer_input(ROWS, H, "cpu"),
        empty_fp8_group_layer_input(ROWS, H, "cpu"),
        (torch.empty(ROWS, H, dtype=BF16)),
    )
    new, out = OPS.boundary(
        ar.handle,
        *source(inp, form),
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
        mx.data,
        mx.scale,
        fp8.data,
        fp8.scale,
        False,
        aux,
    )
    mx2, fp82, aux2 = (
        empty_quantized_layer_input(ROWS, H, "cpu"),
        empty_fp8_group_layer_input(ROWS, H, "cpu"),
        (torch.empty(ROWS, H, dtype=BF16)),
    )
    want_new, want_out = direct(ar, inp, form, True, mxfp8_out=mx2, fp8_out=fp82, aux_out=aux2)
    assert bitwise_equal(new, want_new) and bitwise_equal(out, want_out)
    for a, b in (
        (mx.data, mx2.data),
        (mx.scale, mx2.scale),
        (fp8.data, fp82.data),
        (fp8.scale, fp82.scale),
        (aux, aux2),
    ):
        assert bitwise_equal(a, b)
    only = OPS.post_only(ar.handle, *source(inp, form), inp["residual"], inp["post"], inp["comb"])
    assert bitwise_equal(only, direct(ar, inp, form, False)[0])
    if form == "ready":
        epilogue = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20)
        ready_new, ready_out = OPS.boundary_ready(ar.handle, inp["x"], *epilogue)
        plain_new, plain_out = direct(ar, inp, form, True)
        assert bitwise_equal(ready_new, plain_new) and bitwise_equal(ready_out, plain_out)
        nothing_in_place = (None, None, None, None, False, None)
        full_new, full_out = OPS.boundary(ar.handle, *source(inp, form), *epilogue, *nothing_in_place)
        assert bitwise_equal(full_new, plain_new) and bitwise_equal(full_out, plain_out)
    h = OPS.final(
        ar.handle, *source(inp, form), inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20
    )
    assert bitwise_equal(h, want_out)


def test_the_mhc_ops_give_the_direct_paths_bits() -> None:
    inp = inputs()
    args = (inp["residual"], inp["fn"], inp["scale"], inp["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)
    for kwargs in (
        dict(pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20),
        dict(pre_mix=inp["pre"]),
        {},
    ):
        got = OPS.mhc_pre_delayed(*args, **kwargs)
        for a, b in zip(got, mhc_pre_delayed(*args, **kwargs)):
            assert bitwise_equal(a, b)
    first = OPS.mhc_pre_delayed(
        inp["residual"], inp["fn_broadcast"], *args[2:], x=inp["x"], norm_weight=inp["norm_weight"]
    )
    want = mhc_pre_delayed(inp["residual"], inp["fn_broadcast"], *args[2:], x=inp["x"], norm_weight=inp["norm_weight"])
    assert all(bitwise_equal(a, b) for a, b in zip(first, want))
    mixes = OPS.mhc_mixes(*args)
    assert all(bitwise_equal(a, b) for a, b in zip(mixes, mhc.mixes(inp["residual"], MHCParams(*args[1:]))))
    post = OPS.mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"])
    assert bitwise_equal(post, mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"]))


def test_the_coefficient_ops_hand_the_workspace_owner_to_the_direct_path(monkeypatch) -> None:
    """A simulated rank's coefficients workspace (mhc.prepare_workspace's owner) travels through the ops, which is
    what lets custom_ops=True drive simulated ranks; None (the default) for a real rank."""
    inp = inputs()
    args = (inp["residual"], inp["fn"], inp["scale"], inp["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)
    seen = []
    for name in ("pre_delayed", "mixes"):
        real = getattr(mhc, name)

        def spy(*a, real=real, **k):
            seen.append(k.get("workspace_owner"))
            return real(*a, **k)

        monkeypatch.setattr(mhc, name, spy)
    OPS.mhc_pre_delayed(*args, workspace_owner=3)
    OPS.mhc_mixes(*args, None, "auto", 2)
    OPS.mhc_mixes(*args)
    assert seen == [3, 2, None]


def test_the_fake_implementations_give_shapes_and_dtypes(ar: BoundaryAllReduce) -> None:
    inp = inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(v) for k, v in inp.items()}
        new, out = OPS.boundary(
            ar.handle,
            *source(fake, "moe"),
            fake["residual"],
            fake["post"],
            fake["comb"],
            fake["pre"],
            fake["norm_weight"],
            1e-20,
            None,
            None,
            None,
            None,
            False,
            None,
        )
        only = OPS.post_only(ar.handle, *source(fake, "ready"), fake["residual"], fake["post"], fake["comb"])
        ready = OPS.boundary_ready(
            ar.handle, fake["x"], fake["residual"], fake["post"], fake["comb"], fake["pre"], fake["norm_weight"], 1e-20
        )
        h = OPS.final(
            ar.handle,
            *source(fake, "shared"),
            fake["residual"],
            fake["post"],
            fake["comb"],
            fake["pre"],
            fake["norm_weight"],
            1e-20,
        )
        coeffs = OPS.mhc_pre_delayed(
            fake["residual"],
            fake["fn"],
            fake["scale"],
            fake["base"],
            1e-20,
            1e-6,
            1e-6,
            2.0,
            20,
            fake["pre"],
            None,
            fake["norm_weight"],
            1e-20,
        )
        mixes = OPS.mhc_mixes(fake["residual"], fake["fn"], fake["scale"], fake["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)
        post = OPS.mhc_post(fake["x"], fake["residual"], fake["post"], fake["comb"])
    real_coeffs = mhc_pre_delayed(
        inp["residual"],
        inp["fn"],
        inp["scale"],
        inp["base"],
        1e-20,
        1e-6,
        1e-6,
        2.0,
        20,
        inp["pre"],
        None,
        inp["norm_weight"],
        1e-20,
    )
    real_new, real_out = direct(ar, inp, "moe", True)
    for fake_t, real in [
        (new, real_new),
        (out, real_out),
        (only, real_new),
        *zip(ready, (real_new, real_out)),
        (h, real_out),
        (post, real_new),
        *zip(coeffs, real_coeffs),
        *zip(mixes, (real_coeffs[0], real_coeffs[1], real_coeffs[3])),
    ]:
        assert fake_t.shape == real.shape and fake_t.dtype == real.dtype and fake_t.device == real.device


@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(ar: BoundaryAllReduce, op: str) -> None:
    inp = inputs()
    src = source(inp, "moe")
    epi = (inp["residual"], inp["post"], inp["comb"])
    coeff = (inp["residual"], inp["fn"], inp["scale"], inp["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)
    args = {
        "boundary": (
            ar.handle,
            *src,
            *epi,
            inp["pre"],
            inp["norm_weight"],
            1e-20,
            None,
            None,
            None,
            None,
            False,
            torch.empty(ROWS, H, dtype=BF16),
        ),
        "boundary_ready": (ar.handle, inp["x"], *epi, inp["pre"], inp["norm_weight"], 1e-20),
        "post_only": (ar.handle, *src, *epi),
        "final": (ar.handle, *src, *epi, inp["pre"], inp["norm_weight"], 1e-20),
        "hc_head_final": (
            ar.handle,
            *src,
            *epi,
            inp["fn"][:4].contiguous(),
            inp["scale"][:1].contiguous(),
            inp["base"][:4].contiguous(),
            1e-6,
            1e-6,
            inp["norm_weight"],
            1e-20,
        ),
        "mhc_pre_delayed": (*coeff, inp["pre"], None, inp["norm_weight"], 1e-20, "auto"),
        "mhc_mixes": (*coeff, None, "auto"),
        "mhc_post": (inp["x"], *epi, "auto"),
        "collapse_norm": (inp["residual"], inp["pre"], inp["norm_weight"], 1e-20, "auto"),
    }[op]
    torch.library.opcheck(getattr(OPS, op), args)


def test_a_handle_names_a_live_boundary_all_reduce_only() -> None:
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    other = BoundaryAllReduce(H, max_rows=4, device="cpu")
    assert isinstance(ar.handle, int) and ar.handle != other.handle
    inp = inputs(2)
    handle = ar.handle
    del ar
    gc.collect()
    from boundary import all_reduce

    assert handle not in all_reduce._REGISTRY  # the registry keeps nothing of a boundary that is gone
    with pytest.raises(ValueError, match=rf"^handle {handle} names no live BoundaryAllReduce"):
        OPS.post_only(handle, inp["x"], None, None, None, None, inp["residual"], inp["post"], inp["comb"])
    with pytest.raises(ValueError, match="pass the partial as x, or as gemm2_permuted"):
        OPS.post_only(
            other.handle,
            inp["x"],
            inp["permuted"],
            inp["weights"],
            inp["idx"],
            None,
            inp["residual"],
            inp["post"],
            inp["comb"],
        )


def test_errors_through_the_ops_name_the_layer_attribute() -> None:
    import dataclasses

    model = ToyModel(SMALL)
    b = Boundaries(BoundaryAllReduce(H, max_rows=8, device="cpu"), custom_ops=True)
    step = DecodeStep.for_rows(2)
    state, x = b.first(model.layers[0], model.embed[:2], step)
    state.pending = model.attention(model.layers[0], x)
    layer = dataclasses.replace(model.layers[0], hc_ffn_base=torch.zeros(23))
    with pytest.raises(ValueError, match=r"^layer.hc_ffn_base must have shape \[24\]"):
        b.sublayer(layer, True, state, step)


@pytest.mark.parametrize("where", ["layer", "pending", "final"])
def test_a_meta_tensor_among_real_ones_is_refused_not_given_the_shape_rules_outputs(where: str) -> None:
    """The fake implementation is also each op's Meta kernel, which the dispatcher runs when any argument is on the
    meta device (a weight a loader never materialised): it returned uninitialised real tensors and consumed the call.
    Refused as the direct path refuses it; a call wholly on meta (shape tracing) still gets the shapes."""
    import dataclasses

    model = ToyModel(SMALL)
    b = Boundaries(BoundaryAllReduce(H, max_rows=8, device="cpu"), custom_ops=True)
    step = DecodeStep.for_rows(2)
    state, x = b.first(model.layers[0], model.embed[:2], step)
    state.pending = model.attention(model.layers[0], x)
    if where == "layer":
        layer = dataclasses.replace(model.layers[0], hc_ffn_fn=torch.empty(24, 4 * H, device="meta"))
        with pytest.raises(ValueError, match=r"^layer.hc_ffn_fn must be on cpu, got meta"):
            b.sublayer(layer, True, state, step)
    elif where == "pending":
        real = state.pending
        state.pending = torch.empty(2, H, dtype=torch.bfloat16, device="meta")
        with pytest.raises(ValueError, match=r"^state.pending must be on cpu, got meta"):
            b.sublayer(model.layers[0], True, state, step)
        state.pending = real
    else:
        with pytest.raises(ValueError, match=r"^norm_weight must be on cpu, got meta"):
            b.final(state, torch.empty(H, dtype=torch.bfloat16, device="meta"), 1e-6)
    assert state.pending is not None  # a refused boundary consumes nothing
    meta = {k: v.to("meta") for k, v in boundary_inputs(3, H).items()}
    y = torch.empty(3, H, dtype=torch.bfloat16, device="meta")
    streams, hidden = torch.ops.mhc_boundary.boundary_ready(
        b.all_reduce.handle, y, meta["residual"], meta["post"], meta["comb"], meta["pre"], meta["norm_weight"], 1e-6
    )
    assert streams.is_meta and streams.shape == (3, 4, H) and hidden.is_meta and hidden.shape == (3, H)


def test_the_decode_step_through_the_ops_gives_the_direct_paths_bits() -> None:
    model = ToyModel(SMALL)
    ar = BoundaryAllReduce(H, max_rows=8, device="cpu")
    direct_b, op_b = Boundaries(ar), Boundaries(ar, custom_ops=True)
    for rows in (1, 5):
        tokens = random_tokens(model, rows, rows)
        got = decode_step(model, op_b, tokens, DecodeStep.for_rows(rows))
        assert compare(got, decode_step(model, direct_b, tokens, DecodeStep.for_rows(rows)))["bitwise"]


def test_the_scheduler_takes_a_plain_boundary_through_the_eight_argument_op() -> None:
    """Boundaries(custom_ops=True) takes a ready partial with nothing written in place through `boundary_ready`, and
    the quantized, aux and MoE forms through `boundary`, in the module's own call sequence, with the direct path's
    bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.test_module_calls import module_step

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "mhc_boundary":
                self.ops.append(func._opname)
            return func(*args, **(kwargs or {}))

    model = ToyModel(SMALL)
    ar = BoundaryAllReduce(H, max_rows=8, device="cpu")
    tokens = random_tokens(model, 3, 0)
    seen = Seen()
    with seen:
        got = module_step(model, Boundaries(ar, custom_ops=True), ar, tokens)
    want = module_step(model, Boundaries(ar), ar, tokens)
    # Layers 0 and 1 take their attention output (a ready x) to the plain op; layer 2's, quantized with aux, and the
    # MoE output before it (with a shared addend) take `boundary`.
    assert seen.ops.count("boundary_ready") == 2 and seen.ops.count("boundary") == 2, seen.ops
    for key in ("final", "hidden", "aux"):
        assert bitwise_equal(got[key], want[key]), key
    assert bitwise_equal(got["sublayer"][1], want["sublayer"][1])
    # A MoE output whose routed part is a ready tensor and which has no shared addend takes the plain op too.
    from boundary import MoEOutput

    step = DecodeStep.for_rows(3)
    results = []
    for custom_ops in (True, False):
        b = Boundaries(ar, custom_ops=custom_ops)
        state, x = b.first(model.layers[0], model.embed[tokens], step)
        state.pending = MoEOutput(model.attention(model.layers[0], x), None)
        seen.ops.clear()
        with seen:
            results.append(b.sublayer(model.layers[0], False, state, step)[:2])
        boundary_ops = [op for op in seen.ops if op.startswith("boundary")]
        assert boundary_ops == (["boundary_ready"] if custom_ops else []), boundary_ops
    assert bitwise_equal(results[0][1], results[1][1])


def test_the_compiled_decode_loop_has_no_graph_break_and_gives_the_direct_paths_bits() -> None:
    torch._dynamo.reset()
    model = ToyModel(SMALL)
    ar = BoundaryAllReduce(H, max_rows=8, device="cpu")
    direct_b, op_b = Boundaries(ar), Boundaries(ar, custom_ops=True)
    step = DecodeStep.for_rows(3)
    explained = torch._dynamo.explain(decode_step)(model, op_b, random_tokens(model, 3, 0), step)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    # aot_eager runs the traced aten graph as is, so the model code around the ops keeps its eager bits too.
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    for index in range(3):  # new tokens, the same graph
        tokens = random_tokens(model, 3, index)
        got = compiled(model, op_b, tokens, step)
        assert compare(got, decode_step(model, direct_b, tokens, step))["bitwise"], index


def test_the_ops_compiled_by_inductor_give_the_direct_paths_bits(ar: BoundaryAllReduce) -> None:
    torch._dynamo.reset()
    inp = inputs()
    coeff = (inp["fn"], inp["scale"], inp["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)

    def chain(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor):
        aux = torch.empty_like(x)
        mx = empty_quantized_layer_input(ROWS, H, "cpu")
        new, out = OPS.boundary(
            ar.handle,
            x,
            None,
            None,
            None,
            None,
            residual,
            post,
            comb,
            pre,
            inp["norm_weight"],
            1e-20,
            mx.data,
            mx.scale,
            None,
            None,
            False,
            aux,
        )
        p2, c2, pre2 = OPS.mhc_mixes(new, *coeff)
        streams = OPS.mhc_post(out, new, p2, c2)
        h = OPS.final(ar.handle, x, None, None, None, None, streams, p2, c2, pre2, inp["norm_weight"], 1e-20)
        return new, out, mx.data, mx.scale, aux, p2, c2, pre2, streams, h

    args = (inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"])
    got = torch.compile(chain, fullgraph=True)(*args)
    want = chain(*args)
    for a, b in zip(got, want):
        assert bitwise_equal(a, b)


@pytest.mark.gpu
def test_the_compiled_loop_on_the_gpu_matches_eager_and_a_cuda_graph_replay() -> None:
    torch._dynamo.reset()
    model = ToyModel(SMALL, device="cuda")
    ar = BoundaryAllReduce(H, max_rows=8, device="cuda")
    ar.warmup()
    direct_b, op_b = Boundaries(ar), Boundaries(ar, custom_ops=True)
    step = DecodeStep(rows=4, side_stream=False)
    tokens = random_tokens(model, 4, 0)
    want = decode_step(model, direct_b, tokens, step)
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    assert compare(compiled(model, op_b, tokens, step), want)["bitwise"]
    static = tokens.clone()
    compiled(model, op_b, static, step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(model, op_b, static, step)
    for index in range(1, 3):
        fresh = random_tokens(model, 4, index)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert compare(captured, decode_step(model, direct_b, fresh, step))["bitwise"], index
    ar.check()


def test_partial_args_cover_every_pending_form() -> None:
    inp = inputs()
    from boundary import MoEOutput, UnfinalizedMoEOutput

    assert ops.partial_args(inp["x"]) == (inp["x"], None, None, None, None)
    assert ops.partial_args(MoEOutput(inp["x"], inp["shared"])) == (inp["x"], None, None, None, inp["shared"])
    moe = MoEOutput(UnfinalizedMoEOutput(inp["permuted"], inp["weights"], inp["idx"]), None)
    assert ops.partial_args(moe) == (None, inp["permuted"], inp["weights"], inp["idx"], None)


@pytest.mark.parametrize("name", OP_NAMES)
def test_each_op_schema_names_its_implementations_arguments_in_order(name: str) -> None:
    """Each schema (inferred from the implementation, registered with torch.library.Library) names the
    implementation's parameters, in order, with the same defaults, and marks only the outputs written in place. (The
    fake implementation binds the same names to its shape rule: no second signature to keep in step.)"""
    import inspect

    from boundary import ops

    schema = getattr(torch.ops.mhc_boundary, name).default._schema
    names = [a.name for a in schema.arguments]
    for fn in (getattr(ops, name),):
        params = inspect.signature(fn).parameters
        assert list(params) == names, (fn.__name__, names)
        for arg in schema.arguments:
            default = params[arg.name].default
            if default is inspect.Parameter.empty:
                assert not arg.has_default_value(), (fn.__name__, arg.name)
            else:
                assert arg.default_value == default, (fn.__name__, arg.name)
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == (
        {"mxfp8_data", "mxfp8_scale", "fp8_data", "fp8_scale", "aux_out"} if name == "boundary" else set()
    )
