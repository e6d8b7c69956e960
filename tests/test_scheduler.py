"""BoundaryAllReduce and Boundaries: the reference path end to end, multi-rank, and bad input."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import boundary
from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    MHCParams,
    MoEOutput,
    empty_quantized_layer_input,
    mhc,
    mhc_post,
    mhc_pre_delayed,
    mhc_pre_delayed_overlap,
)
from boundary import reference as ref
from boundary.demo import file_rendezvous
from boundary.toy import ToyConfig, ToyModel, compare, decode_step, decode_step_plain, random_tokens
from tests.bf16 import bitwise_equal
from tests.inputs import boundary_inputs

BF16 = torch.bfloat16
SMALL = ToyConfig(hidden_size=512, num_layers=3, vocab=64)


# --- the public API ----------------------------------------------------------------------------


def test_public_names_are_exported() -> None:
    for name in (
        "Boundaries",
        "BoundaryState",
        "BoundaryAllReduce",
        "DecodeStep",
        "MHC_OVERLAP_MAX_ROWS",
        "QuantizedActivation",
        "MoEOutput",
        "UnfinalizedMoEOutput",
        "empty_quantized_layer_input",
        "mxfp8_scale_bytes",
        "MHCParams",
        "mhc_pre_delayed",
        "mhc_pre_delayed_overlap",
        "mhc_post",
    ):
        assert hasattr(boundary, name), name
    assert boundary.MHC_OVERLAP_MAX_ROWS == 0 or "MHC_OVERLAP_MAX_ROWS" in os.environ


def test_boundary_all_reduce_one_rank_matches_the_reference() -> None:
    rows, hidden = 5, 1024
    inp = boundary_inputs(rows, hidden)
    before = {k: v.clone() for k, v in inp.items()}
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cpu")
    assert (ar.rank, ar.world_size, ar.path) == (0, 1, "reference")
    q = empty_quantized_layer_input(rows, hidden, "cpu")
    aux = torch.empty(rows, hidden, dtype=BF16)
    new, x = ar(
        inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6, q, aux_out=aux
    )
    want = ref.boundary(
        inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6, mxfp8=True, aux=True
    )
    assert bitwise_equal(new, want.residual) and bitwise_equal(x, want.layer_input) and bitwise_equal(aux, want.aux)
    assert bitwise_equal(q.data, want.mxfp8[0]) and bitwise_equal(q.scale, want.mxfp8[1])
    for k, v in inp.items():  # inputs are never modified
        assert bitwise_equal(v, before[k]), k
    assert new.data_ptr() != inp["residual"].data_ptr()
    ar.check()


def test_residual_only_and_mailbox_and_finalize() -> None:
    rows, hidden = 3, 512
    inp = boundary_inputs(rows, hidden)
    ar = BoundaryAllReduce(hidden, max_rows=4, device="cpu")
    box = ar.mailbox(rows)
    assert box.shape == (rows, hidden) and box.dtype == BF16
    box.copy_(inp["x"])
    new, x = ar(box, inp["residual"], inp["post"], inp["comb"], None, None, 0.0, None)
    assert x is None and bitwise_equal(new, ref.mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"]))
    g = torch.Generator().manual_seed(3)
    permuted = torch.randn(7, hidden, generator=g).to(BF16)
    weights = torch.rand(rows, 2, generator=g)
    idx = torch.tensor([[0, 3], [-1, 5], [6, -1]], dtype=torch.int32)
    shared = torch.randn(rows, hidden, generator=g).to(BF16)
    new, x = ar.finalize(
        permuted,
        weights,
        idx,
        shared,
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
        None,
    )
    y = ref.moe_finalize(permuted, weights, idx, shared)
    want = ref.boundary(y, inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20)
    assert bitwise_equal(new, want.residual) and bitwise_equal(x, want.layer_input)
    # A combined routed output plus the shared output: the partial is bf16(routed + shared).
    new, x = ar(
        inp["x"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
        None,
        shared_output=shared,
    )
    want = ref.boundary(
        ref.add_shared(inp["x"], shared),
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-20,
    )
    assert bitwise_equal(new, want.residual) and bitwise_equal(x, want.layer_input)


def test_public_mhc_ops_match_the_reference() -> None:
    rows, hidden = 4, 256
    inp = boundary_inputs(rows, hidden)
    g = torch.Generator().manual_seed(5)
    fn, scale, base = (
        torch.randn(24, 4 * hidden, generator=g) * 0.01,
        torch.full((3,), 0.5),
        torch.randn(24, generator=g),
    )
    args = (inp["residual"], fn, scale, base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    kwargs = dict(pre_mix=inp["pre"], norm_weight=inp["norm_weight"], norm_eps=1e-20)
    got = mhc_pre_delayed(*args, **kwargs)
    want = ref.mhc_pre_delayed(*args, **kwargs)
    overlap = mhc_pre_delayed_overlap(*args, **kwargs, stream=None)
    params = MHCParams(*args[1:])
    grouped = mhc.pre_delayed(inp["residual"], params, inp["pre"], None, inp["norm_weight"], 1e-20)
    for a, b, c, d in zip(got, want, overlap, grouped):
        assert bitwise_equal(a, b) and bitwise_equal(a, c) and bitwise_equal(a, d)
    for a, b in zip(mhc.mixes(inp["residual"], params), (got[0], got[1], got[3])):
        assert bitwise_equal(a, b)
    assert bitwise_equal(
        mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"]),
        ref.mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"]),
    )


def test_decode_step_for_rows() -> None:
    # measured: inline wins at every row count of the V3 step, so no count gets the side stream by default
    assert DecodeStep.for_rows(1).side_stream is False and DecodeStep.for_rows(128).side_stream is False
    assert DecodeStep.for_rows(4, overlap_max_rows=128).side_stream is torch.cuda.is_available()
    assert DecodeStep.for_rows(129, overlap_max_rows=128).side_stream is False
    assert DecodeStep.for_rows(257, overlap_max_rows=512).side_stream is torch.cuda.is_available()
    assert DecodeStep.for_rows(1, overlap_max_rows=0).side_stream is False


def test_overlap_threshold_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$MHC_OVERLAP_MAX_ROWS is read when boundary is imported (a fresh interpreter shows it), through the one reader
    of integer environment variables, which refuses a value that is not an int (checked here, in this process)."""
    import subprocess
    import sys

    from boundary import scheduler
    from cute_kernels.hardware import env_int

    code = "import boundary; print(boundary.MHC_OVERLAP_MAX_ROWS)"
    env = dict(os.environ, MHC_OVERLAP_MAX_ROWS="48")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "48"
    assert scheduler._OVERLAP_ENV == env_int("MHC_OVERLAP_MAX_ROWS", 0)  # the import's reader
    monkeypatch.setenv("MHC_OVERLAP_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="MHC_OVERLAP_MAX_ROWS must be an int"):
        env_int("MHC_OVERLAP_MAX_ROWS", 0)


# --- the toy model end to end ------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5])
def test_scheduler_matches_the_plain_step_bit_for_bit(rows: int) -> None:
    model = ToyModel(SMALL)
    boundaries = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu"))
    for index in range(2):
        tokens = random_tokens(model, rows, index)
        out = decode_step(model, boundaries, tokens, DecodeStep.for_rows(rows))
        plain = decode_step_plain(model, tokens)
        assert compare(out, plain)["bitwise"]
        assert out.moe_input_mxfp8.scale.numel() == ref.mxfp8_scale_bytes(rows, SMALL.hidden_size)


def test_side_streams_fall_away_on_a_cpu_boundary() -> None:
    model = ToyModel(SMALL)
    boundaries = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu"))
    tokens = random_tokens(model, 3, 0)
    on = decode_step(model, boundaries, tokens, DecodeStep(rows=3, side_stream=True))
    off = decode_step(model, boundaries, tokens, DecodeStep(rows=3, side_stream=False))
    assert compare(on, off)["bitwise"]


def test_scheduler_matches_at_real_hidden_size() -> None:
    config = ToyConfig(hidden_size=5120, num_layers=2, vocab=64)
    model = ToyModel(config)
    boundaries = Boundaries(BoundaryAllReduce(config.hidden_size, max_rows=4, device="cpu"))
    tokens = random_tokens(model, 3, 0)
    assert compare(decode_step(model, boundaries, tokens, DecodeStep.for_rows(3)), decode_step_plain(model, tokens))[
        "bitwise"
    ]


def _rank_worker(rank: int, world: int, rendezvous: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    # Ranks with other thread counts (an engine's processes need not agree on them) must still agree on every bit.
    torch.set_num_threads(1 + rank % 2)
    try:
        model = ToyModel(SMALL, rank=rank, world_size=world)
        ar = BoundaryAllReduce(SMALL.hidden_size, group=dist.group.WORLD, max_rows=8, device="cpu")
        assert (ar.rank, ar.world_size) == (rank, world)
        boundaries = Boundaries(ar)
        tokens = random_tokens(model, 5, 0)
        out = decode_step(model, boundaries, tokens, DecodeStep.for_rows(5))
        plain = decode_step_plain(model, tokens, group=dist.group.WORLD)
        # A partial at an odd bf16 offset of its storage (a slice of a larger buffer) is exchanged as a copy's words.
        inp = boundary_inputs(3, SMALL.hidden_size, seed=rank)
        storage = torch.zeros(3 * SMALL.hidden_size + 1, dtype=torch.bfloat16)
        odd = storage[1:].view(3, SMALL.hidden_size)
        odd.copy_(inp["x"])
        common = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6, None)
        same_at_odd = all(torch.equal(a, b) for a, b in zip(ar(odd, *common), ar(inp["x"], *common)))
        results[rank] = (compare(out, plain)["bitwise"] and same_at_odd, out.hidden.view(torch.int16).clone())
    finally:
        dist.destroy_process_group()


def test_multi_rank_gloo_matches_plain_and_every_rank_agrees() -> None:
    """Four gloo ranks (two: test_final_boundary's gloo test) run the toy step: each gives the plain step's bits."""
    world = 4
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, file_rendezvous() as rendezvous:
        results = manager.dict()
        mp.start_processes(
            _rank_worker, args=(world, rendezvous, results), nprocs=world, join=True, start_method="spawn"
        )
        results = dict(results)
    assert sorted(results) == list(range(world))
    assert all(same for same, _ in results.values())
    first = results[0][1]
    assert all(torch.equal(first, bits) for _, bits in results.values())


# --- bad input ---------------------------------------------------------------------------------


def call(ar: BoundaryAllReduce, **overrides):
    inp = boundary_inputs(2, ar.hidden_size)
    inp.update(overrides)
    return ar(
        inp["x"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        inp.get("norm_eps", 1e-6),
        inp.get("mxfp8_out"),
        aux_out=inp.get("aux_out"),
    )


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(x=torch.zeros(2, 512, dtype=torch.float16)), TypeError, "x must have dtype torch.bfloat16"),
        (dict(x=torch.zeros(2, 256, dtype=BF16)), ValueError, r"x must have shape \[2, 512\]"),
        (dict(x=torch.zeros(512, 2, dtype=BF16).t()), ValueError, "x must be contiguous"),
        (dict(x=[1, 2]), TypeError, "x must be a torch.Tensor"),
        (dict(x=torch.zeros(2, 512, dtype=BF16, device="meta")), ValueError, "x must be on cpu"),
        (dict(residual=torch.zeros(2, 3, 512, dtype=BF16)), ValueError, r"residual must have shape \[\*, 4, 512\]"),
        (dict(residual=torch.zeros(9, 4, 512, dtype=BF16)), ValueError, "exceed this boundary's capacity"),
        (dict(post=torch.zeros(2, 4, dtype=torch.float64)), TypeError, "post must have dtype torch.float32"),
        (dict(comb=torch.zeros(2, 4)), ValueError, r"comb must have shape \[2, 4, 4\]"),
        (dict(pre=torch.zeros(3, 4)), ValueError, r"pre must have shape \[2, 4\]"),
        (dict(norm_weight=None), TypeError, "norm_weight must be a torch.Tensor"),
        (dict(norm_weight=torch.ones(512)), TypeError, "norm_weight must have dtype torch.bfloat16"),
        (dict(norm_eps=float("nan")), ValueError, "norm_eps must be finite"),
        (dict(norm_eps=-1.0), ValueError, "norm_eps must be >= 0"),
        (dict(mxfp8_out=torch.zeros(2)), TypeError, "mxfp8_out must be a QuantizedActivation"),
        (
            dict(mxfp8_out=empty_quantized_layer_input(3, 512, "cpu")),
            ValueError,
            r"mxfp8_out.data must have shape \[2, 512\]",
        ),
        (dict(pre=None), ValueError, "takes no norm_weight"),
        (dict(aux_out=torch.empty(2, 512)), TypeError, "aux_out must have dtype"),
    ],
)
def test_bad_boundary_input_raises_a_clear_error(overrides: dict, error: type, match: str) -> None:
    ar = BoundaryAllReduce(512, max_rows=8, device="cpu")
    with pytest.raises(error, match=match):
        call(ar, **overrides)


def test_bad_construction_raises_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        BoundaryAllReduce(1000)
    with pytest.raises(ValueError, match="hc_mult must be 4"):
        BoundaryAllReduce(512, hc_mult=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        BoundaryAllReduce(512, backend="fast")
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        BoundaryAllReduce(512, max_rows=0)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        BoundaryAllReduce(512, group=object())
    ar = BoundaryAllReduce(512, max_rows=4, device="cpu")
    with pytest.raises(ValueError, match="exceed this boundary's capacity"):
        ar.mailbox(5)
    with pytest.raises(ValueError, match=r"^max_rows \(5\) exceeds this boundary's capacity, its max_rows=4"):
        ar.warmup(max_rows=5)
    with pytest.raises(ValueError, match=r"^max_rows must be a positive int"):
        ar.warmup(max_rows=0)
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        empty_quantized_layer_input(0, 512, "cpu")


def test_bad_finalize_input_raises_a_clear_error() -> None:
    ar = BoundaryAllReduce(512, max_rows=4, device="cpu")
    inp = boundary_inputs(2, 512)
    permuted = torch.zeros(4, 512, dtype=BF16)
    with pytest.raises(TypeError, match="expanded_idx_to_permuted_idx must have dtype torch.int32"):
        ar.finalize(
            permuted,
            torch.ones(2, 2),
            torch.zeros(2, 2, dtype=torch.int64),
            None,
            inp["residual"],
            inp["post"],
            inp["comb"],
            inp["pre"],
            inp["norm_weight"],
            1e-6,
            None,
        )
    with pytest.raises(ValueError, match=r"expert_weights must have shape \[2, \*\]"):
        ar.finalize(
            permuted,
            torch.ones(3, 2),
            torch.zeros(2, 2, dtype=torch.int32),
            None,
            inp["residual"],
            inp["post"],
            inp["comb"],
            inp["pre"],
            inp["norm_weight"],
            1e-6,
            None,
        )


def test_bad_scheduler_input_raises_a_clear_error() -> None:
    model = ToyModel(SMALL)
    boundaries = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu"))
    step = DecodeStep.for_rows(2)
    with pytest.raises(TypeError, match="all_reduce must be a BoundaryAllReduce"):
        Boundaries(object())
    with pytest.raises(TypeError, match="step must be a DecodeStep"):
        boundaries.first(model.layers[0], model.embed[:2], 2)
    with pytest.raises(ValueError, match=r"x must have shape \[3, 512\]"):
        boundaries.first(model.layers[0], model.embed[:2], DecodeStep.for_rows(3))
    with pytest.raises(ValueError, match="hc_attn_fn_broadcast is None"):
        boundaries.first(model.layers[1], model.embed[:2], step)
    state, _ = boundaries.first(model.layers[0], model.embed[:2], step)
    with pytest.raises(ValueError, match="state.pending is None"):
        boundaries.sublayer(model.layers[0], True, state, step)
    with pytest.raises(ValueError, match="step.rows is 3"):
        boundaries.pre(model.layers[1], state.residual, state, DecodeStep.for_rows(3))
    state.pending = "not a tensor"
    with pytest.raises(TypeError, match="state.pending must be a Tensor or a MoEOutput"):
        boundaries.post_only(state)
    state.pending = MoEOutput(routed=[1], shared_output=None)
    with pytest.raises(TypeError, match="routed must be a Tensor or an UnfinalizedMoEOutput"):
        boundaries.post_only(state)
    with pytest.raises(ValueError, match="rows must be a positive int"):
        DecodeStep.for_rows(0)


def test_bad_mhc_op_input_raises_a_clear_error() -> None:
    inp = boundary_inputs(2, 256)
    fn, scale, base = torch.zeros(24, 1024), torch.zeros(3), torch.zeros(24)
    with pytest.raises(ValueError, match=r"fn must have shape \[24, 1024\]"):
        mhc_pre_delayed(inp["residual"], torch.zeros(24, 256), scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    with pytest.raises(ValueError, match=r"fn must have shape \[24, 256\]"):
        mhc_pre_delayed(inp["residual"], fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, x=inp["x"][:, :256])
    with pytest.raises(ValueError, match="sinkhorn_repeat must be a positive int"):
        mhc_pre_delayed(inp["residual"], fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 0)
    with pytest.raises(TypeError, match="hc_scale must have dtype torch.float32"):
        mhc_pre_delayed(inp["residual"], fn, scale.double(), base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None"):
        mhc_pre_delayed_overlap(inp["residual"], fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, stream="side")
    with pytest.raises(ValueError, match=r"x must have shape \[2, 256\]"):
        mhc_post(inp["x"][:, :128], inp["residual"], inp["post"], inp["comb"])


# --- on a GPU: side streams on and off give the same bits ---------------------------------------


@pytest.mark.gpu
def test_side_stream_on_and_off_give_the_same_bits_on_the_gpu() -> None:
    model = ToyModel(SMALL, device="cuda")
    boundaries = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cuda"))
    tokens = random_tokens(model, 4, 0)
    on = decode_step(model, boundaries, tokens, DecodeStep(rows=4, side_stream=True))
    off = decode_step(model, boundaries, tokens, DecodeStep(rows=4, side_stream=False))
    torch.cuda.synchronize()
    assert compare(on, off)["bitwise"]
