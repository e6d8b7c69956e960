"""The package on the GPU: BoundaryAllReduce and the mHC ops on the kernels, held to the reference."""

from __future__ import annotations

import pytest
import torch

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    empty_quantized_layer_input,
    mhc_post,
    mhc_pre_delayed,
    mhc_pre_delayed_overlap,
)
from boundary import reference as ref
from boundary.toy import ToyConfig, ToyModel, compare, decode_step, decode_step_plain, random_tokens
from tests.bf16 import bitwise_equal, max_ulp
from tests.inputs import boundary_inputs

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
H = 5120


def inputs(rows: int, hidden: int = H, seed: int = 0) -> dict[str, torch.Tensor]:
    return boundary_inputs(rows, hidden, seed, "cuda")


def check_against_reference(y, inp, new, out, q=None, aux=None, eps=1e-20):
    """R' within 1 ulp of the reference; the rest against the reference applied to the kernel's own R'."""
    want = ref.mhc_post(y, inp["residual"], inp["post"], inp["comb"])
    assert max_ulp(new, want) <= 1
    if out is not None:
        assert max_ulp(out, ref.rms_norm(ref.collapse(new, inp["pre"]), inp["norm_weight"], eps)) <= 1
    if q is not None:
        data, scale = ref.mxfp8_quantize(out)
        assert bitwise_equal(q.scale, scale)
        assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    if aux is not None:
        assert max_ulp(aux, ref.mean_of_streams(new)) <= 1


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_boundary_all_reduce_kernel_path(rows: int) -> None:
    ar = BoundaryAllReduce(H, max_rows=64, device="cuda")
    assert ar.path == "kernel" and ar.arch in ("sm_90a", "sm_100a")
    inp = inputs(rows)
    before = {k: v.clone() for k, v in inp.items()}
    q = empty_quantized_layer_input(rows, H, "cuda")
    aux = torch.empty(rows, H, dtype=BF16, device="cuda")
    new, out = ar(
        inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20, q, aux_out=aux
    )
    check_against_reference(inp["x"], inp, new, out, q, aux)
    new, out = ar(
        inp["x"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
        None,
        shared_output=inp["shared"],
    )
    check_against_reference(ref.add_shared(inp["x"], inp["shared"]), inp, new, out)
    new, none = ar(inp["x"], inp["residual"], inp["post"], inp["comb"], None, None, 0.0, None)
    assert none is None
    check_against_reference(inp["x"], inp, new, None)
    for k, v in inp.items():
        assert bitwise_equal(v, before[k]), f"{k} was modified"
    ar.check()


def test_boundary_all_reduce_finalize_kernel_path() -> None:
    rows, k = 9, 6
    ar = BoundaryAllReduce(H, max_rows=16, device="cuda")
    inp = inputs(rows)
    g = torch.Generator(device="cuda").manual_seed(3)
    permuted = torch.randn(rows * k + 2, H, generator=g, device="cuda").to(BF16)
    permuted[-2:] = float("nan")  # never read
    weights = torch.rand(rows, k, generator=g, device="cuda")
    idx = torch.randperm(rows * k, generator=g, device="cuda").to(torch.int32).view(rows, k)
    idx[0, 2] = idx[5, 0] = -1
    idx[3] = -1
    new, out = ar.finalize(
        permuted,
        weights,
        idx,
        inp["shared"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
        None,
    )
    # The MoE combine may fuse multiply-adds: y within 1 ulp of the reference, then as above.
    y = ref.moe_finalize(permuted, weights, idx, inp["shared"])
    want = ref.mhc_post(y, inp["residual"], inp["post"], inp["comb"])
    assert max_ulp(new, want) <= 2 and not new.isnan().any()
    assert max_ulp(out, ref.rms_norm(ref.collapse(new, inp["pre"]), inp["norm_weight"], 1e-20)) <= 1


def test_mhc_ops_on_the_kernels_match_the_reference() -> None:
    rows = 16
    inp = inputs(rows)
    g = torch.Generator(device="cuda").manual_seed(4)
    fn = torch.randn(24, 4 * H, generator=g, device="cuda") * 1e-2
    scale, base = torch.full((3,), 0.5, device="cuda"), torch.randn(24, generator=g, device="cuda") * 0.5
    new = mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"])
    assert max_ulp(new, ref.mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"])) <= 1
    args = (inp["residual"], fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    got = mhc_pre_delayed(*args, pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20)
    want = ref.mhc_pre_delayed(*args, pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20)
    for a, b in ((got[0], want[0]), (got[1], want[1]), (got[3], want[3])):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert max_ulp(got[2], want[2]) <= 1
    side = torch.cuda.Stream()
    overlap = mhc_pre_delayed_overlap(
        *args, pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20, stream=side
    )
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(overlap, got):  # the split form (layer input alone + mixes) gives the inline form's bits
        assert bitwise_equal(a, b)
    broadcast = mhc_pre_delayed(
        inp["residual"][:, :1].expand(-1, 4, -1).contiguous(),
        fn.view(24, 4, H).sum(1),
        scale,
        base,
        1e-20,
        1e-6,
        1e-6,
        2.0,
        20,
        x=inp["residual"][:, 0].contiguous(),
        norm_weight=inp["norm_weight"],
        norm_eps=1e-20,
    )
    assert max_ulp(broadcast[2], ref.rms_norm(inp["residual"][:, 0], inp["norm_weight"], 1e-20)) <= 1


def test_a_malformed_call_on_the_kernel_path_names_its_argument() -> None:
    """The host's fast path leaves a tensor's type, dtype, shape, strides, address and device to the compiled kernel's
    TVM-FFI entry: each such fault is refused there before anything launches, and the full checks then raise the
    error that names the argument (CONTRACT §5 Errors). The misaligned partial goes last (were it to launch, its
    16-byte loads would fault the context); after every fault a good call still returns the reference's bits."""
    rows = 3
    ar = BoundaryAllReduce(H, max_rows=4, device="cuda")
    inp = inputs(rows)
    good = dict(x=inp["x"], residual=inp["residual"], post=inp["post"], comb=inp["comb"], pre=inp["pre"])
    good["norm_weight"] = inp["norm_weight"]
    names = ("x", "residual", "post", "comb", "pre", "norm_weight")
    faults = [
        ("x", dict(x=inp["x"].float())),
        ("x", dict(x=inp["x"][:, :128])),
        ("x", dict(x=torch.zeros(H, rows, dtype=BF16, device="cuda").t())),
        ("x", dict(x=inp["x"].cpu())),
        ("x", dict(x=[1, 2])),
        ("residual", dict(residual=inp["residual"][:, :3])),
        ("post", dict(post=inp["post"].double())),
        ("post", dict(post=inp["post"].cpu())),
        ("comb", dict(comb=inp["comb"][:, :, :3])),
        ("comb", dict(comb=inp["comb"].transpose(1, 2))),
        ("pre", dict(pre=inp["pre"][:2])),
        ("norm_weight", dict(norm_weight=inp["norm_weight"].float())),
        ("x", dict(x=torch.zeros(rows * H + 1, dtype=BF16, device="cuda")[1:].view(rows, H))),
    ]
    for name, change in faults:
        args = good | change
        assert ar._fits(args["residual"], args["post"], args["pre"], args["norm_weight"], 1e-6, None), (name, change)
        with pytest.raises((TypeError, ValueError), match=rf"^{name} "):
            ar(*(args[n] for n in names), 1e-6, None)
    torch.cuda.synchronize()
    new, out = ar(*(good[n] for n in names), 1e-20, None)
    check_against_reference(inp["x"], inp, new, out)


def test_a_warmup_for_the_layers_sinkhorn_count_leaves_their_calls_nothing_to_load() -> None:
    """The Sinkhorn count is compiled into the coefficients kernels: after warmup(sinkhorn_repeat=7) a model with 7
    Sinkhorn iterations compiles and loads nothing at its calls (inline and on a side stream, 1-16 rows); the
    control, a count no warmup saw, does."""
    from cute_kernels import compile as cc

    BoundaryAllReduce(H, max_rows=16, device="cuda").warmup(quantize=(), sinkhorn_repeat=7, progress=False)
    g = torch.Generator(device="cuda").manual_seed(5)
    fn = torch.randn(24, 4 * H, generator=g, device="cuda") * 1e-2
    scale, base = torch.full((3,), 0.5, device="cuda"), torch.randn(24, generator=g, device="cuda") * 0.5
    side = torch.cuda.Stream()

    def loads(repeat: int) -> int:
        """The compiles and disk loads of the coefficients calls of a model with `repeat` Sinkhorn iterations."""
        before = cc.STATS.compiles + cc.STATS.disk_hits
        for rows in (1, 5, 16):
            inp = inputs(rows)
            args = (inp["residual"], fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, repeat)
            mhc_pre_delayed(*args, pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20)
            mhc_pre_delayed_overlap(
                *args, pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20, stream=side
            )
        torch.cuda.synchronize()
        return cc.STATS.compiles + cc.STATS.disk_hits - before

    assert loads(7) == 0
    assert loads(9) > 0, "the control loaded nothing: the count is not what picks the kernel"


def _kernels_launched(call) -> list[str]:
    """The CUDA kernels `call()` launches, by name (torch's profiler)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("rows", [1, 16, 129, 512])
@pytest.mark.parametrize("collapse", ["carried", "stream 0", "embedding"])
def test_mhc_pre_delayed_without_a_norm_weight_is_one_launch_of_the_exact_collapse(rows: int, collapse: str) -> None:
    """Without norm_weight the layer input is the collapse itself, bit for bit (CONTRACT §3), written by the
    coefficients launch as the normalised form is: the public op launches what the normalised one does."""
    hidden = 7168
    inp = inputs(rows, hidden, seed=rows)
    g = torch.Generator(device="cuda").manual_seed(5)
    fn = torch.randn(24, 4 * hidden, generator=g, device="cuda") * 1e-2
    scale, base = torch.full((3,), 0.5, device="cuda"), torch.randn(24, generator=g, device="cuda") * 0.5
    residual, kw = inp["residual"], {}
    if collapse == "carried":
        kw, want = dict(pre_mix=inp["pre"]), ref.collapse(residual, inp["pre"])
    elif collapse == "stream 0":
        want = residual[:, 0].clone()
    else:
        residual = residual[:, :1].expand(-1, 4, -1).contiguous()
        kw, fn, want = dict(x=residual[:, 0].contiguous()), fn.view(24, 4, hidden).sum(1), residual[:, 0].clone()
    args = (residual, fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    normed = mhc_pre_delayed(*args, **kw, norm_weight=inp["norm_weight"], norm_eps=1e-20)
    got = mhc_pre_delayed(*args, **kw)
    assert bitwise_equal(got[2], want)
    for a, b in zip((got[0], got[1], got[3]), (normed[0], normed[1], normed[3])):  # the same projection code
        assert bitwise_equal(a, b)
    side = torch.cuda.Stream()
    overlap = mhc_pre_delayed_overlap(*args, **kw, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(overlap, got):
        assert bitwise_equal(a, b)
    launched = _kernels_launched(lambda: mhc_pre_delayed(*args, **kw))
    assert 1 <= len(launched) <= 2, launched  # the coefficients kernel (the partials schedule: its two launches)
    assert len(launched) == len(
        _kernels_launched(lambda: mhc_pre_delayed(*args, **kw, norm_weight=inp["norm_weight"]))
    ), launched
    assert not any("elementwise" in name or "copy" in name.lower() for name in launched), launched


def test_boundary_call_under_cuda_graph_replay_with_inputs_changed_in_place() -> None:
    rows = 4
    ar = BoundaryAllReduce(H, max_rows=8, device="cuda")
    ar.warmup(progress=False)
    inp = inputs(rows)
    q = empty_quantized_layer_input(rows, H, "cuda")
    ar(inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20, q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new, out = ar(inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20, q)
    for seed in range(3):
        fresh = inputs(rows, seed=10 + seed)
        for k in inp:
            inp[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(inp["x"], inp, new, out, q)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_toy_decode_step_on_the_kernels_tracks_the_plain_step(rows: int) -> None:
    config = ToyConfig(hidden_size=H, num_layers=4)
    model = ToyModel(config, device="cuda")
    boundaries = Boundaries(BoundaryAllReduce(H, max_rows=64, device="cuda"))
    tokens = random_tokens(model, rows, 0)
    # the default step (inline coefficients) at 64 rows, the side streams at 1 and 16
    out = decode_step(model, boundaries, tokens, DecodeStep(rows=rows, side_stream=rows <= 16))
    plain = decode_step_plain(model, tokens)
    diff = compare(out, plain)
    # Each boundary may differ by a bf16 ulp and each mix by ~1e-3; over 4 layers that stays small.
    assert diff["max_rel"] < 5e-2, diff
    cos = torch.nn.functional.cosine_similarity(out.hidden.float().flatten(), plain.hidden.float().flatten(), dim=0)
    assert cos > 0.999, float(cos)


def test_toy_decode_step_captures_in_a_cuda_graph_with_side_streams() -> None:
    rows = 4
    config = ToyConfig(hidden_size=H, num_layers=3)
    model = ToyModel(config, device="cuda")
    ar = BoundaryAllReduce(H, max_rows=8, device="cuda")
    ar.warmup(progress=False)
    boundaries = Boundaries(ar)
    step = DecodeStep(rows=rows, side_stream=True)
    tokens = random_tokens(model, rows, 0)
    eager = decode_step(model, boundaries, tokens, step)
    torch.cuda.synchronize()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        captured = decode_step(model, boundaries, tokens, step)
    graph.replay()
    torch.cuda.synchronize()
    assert compare(captured, eager)["bitwise"]
    tokens.copy_(random_tokens(model, rows, 1))
    graph.replay()
    torch.cuda.synchronize()
    assert compare(captured, decode_step(model, boundaries, tokens, step))["bitwise"]


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_run_whole_decode_steps_at_once_in_a_cuda_graph(world: int) -> None:
    """W simulated ranks each run the toy step (coefficients on side streams, sublayers as fixed outputs: CONTRACT §7)
    at once on one GPU, captured in one graph and replayed: every rank gets the same bits (each has a coefficients
    workspace of its own; a shared one raced), and they track the plain chain after the rank-order sum of every
    rank's partials."""
    from bench.step import boundaries_only, summed_sublayers

    rows = 4
    config = ToyConfig(hidden_size=H, num_layers=3)
    ranks = BoundaryAllReduce.simulated(H, world, max_rows=8, device="cuda", timeout_us=1_000_000)
    ranks[0].warmup(progress=False, quantize=("mxfp8",))
    models = [ToyModel(config, rank=r, world_size=world, device="cuda") for r in range(world)]
    # The toy's GEMMs beside spinning peers on one GPU can stall a step (CONTRACT §7): each rank's sublayers return
    # outputs computed once here, before any boundary spins.
    models = [boundaries_only(model, rows) for model in models]
    torch.cuda.synchronize()
    boundaries = [Boundaries(ar) for ar in ranks]
    step = DecodeStep(rows=rows, side_stream=True)
    static = random_tokens(models[0], rows, 0).clone()

    def every_rank() -> list:
        calls = [lambda ar: decode_step(models[ar.rank], boundaries[ar.rank], static, step)] * world
        return BoundaryAllReduce.run_simulated(ranks, calls)

    every_rank()  # the first call sizes each rank's coefficients workspace, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = every_rank()
    reference_b = Boundaries(BoundaryAllReduce(H, max_rows=8, device="cuda", backend="reference"))
    for index in range(1, 4):
        static.copy_(random_tokens(models[0], rows, index))
        graph.replay()
        torch.cuda.synchronize()
        for r in range(1, world):
            assert compare(outs[r], outs[0])["bitwise"], (index, r)
        plain = decode_step(summed_sublayers(models), reference_b, static, DecodeStep(rows=rows, side_stream=False))
        assert compare(outs[0], plain)["max_rel"] < 5e-2, index
    for ar in ranks:
        ar.check()


def test_custom_ops_drive_simulated_ranks_with_the_direct_paths_bits() -> None:
    """W 2 simulated ranks step through the custom ops (each rank's coefficients in its own workspace, named by
    workspace_owner), eagerly and as a compiled fullgraph loop captured in a CUDA graph: every rank gets the bits
    of the direct path's step. The first compiled call compiles each rank's graph while the other rank waits: a long
    timeout covers it."""
    from bench.step import boundaries_only

    world, rows = 2, 4
    ranks = BoundaryAllReduce.simulated(H, world, max_rows=8, device="cuda", timeout_us=120_000_000)
    ranks[0].warmup(progress=False, quantize=("mxfp8",))
    config = ToyConfig(hidden_size=H, num_layers=2)
    models = [boundaries_only(ToyModel(config, rank=r, world_size=world, device="cuda"), rows) for r in range(world)]
    torch.cuda.synchronize()
    direct = [Boundaries(ar) for ar in ranks]
    op = [Boundaries(ar, custom_ops=True) for ar in ranks]
    step = DecodeStep(rows=rows, side_stream=False)
    tokens = random_tokens(models[0], rows, 0).clone()
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")

    def every_rank(fn, boundaries) -> list:
        calls = [lambda ar: fn(models[ar.rank], boundaries[ar.rank], tokens, step)] * world
        return BoundaryAllReduce.run_simulated(ranks, calls)

    want = every_rank(decode_step, direct)
    for fn in (decode_step, compiled):  # the ops eagerly, then compiled (the first call compiles every rank's graph)
        got = every_rank(fn, op)
        torch.cuda.synchronize()
        assert all(compare(g, w)["bitwise"] for g, w in zip(got, want)), fn
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = every_rank(compiled, op)
    tokens.copy_(random_tokens(models[0], rows, 1))
    graph.replay()
    want = every_rank(decode_step, direct)
    torch.cuda.synchronize()
    assert all(compare(g, w)["bitwise"] for g, w in zip(captured, want))
    for ar in ranks:
        ar.check()
