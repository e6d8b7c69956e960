"""A clear error for every mistake a user can make (issue 28 §4): each case names the argument or the layer
attribute the user set, with the exception type the README promises, before any work is done."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    MoEOutput,
    V4Boundaries,
    checks,
    demo,
    empty_quantized_layer_input,
    mhc_pre_delayed,
)
from boundary.toy import ToyConfig, ToyModel
from cute_kernels.allreduce.protocol import ERROR_WORDS

BF16 = torch.bfloat16
SMALL = ToyConfig(hidden_size=512, num_layers=2, vocab=64)
ROWS = 2
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")


@pytest.fixture(scope="module")
def model() -> ToyModel:
    return ToyModel(SMALL)


def boundaries(max_rows: int = 8) -> Boundaries:
    return Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=max_rows, device="cpu"))


def toy_layer(model: ToyModel, entry: str) -> Any:
    """The toy layer that `enter` runs for `entry`: layer 1 (the Engram layer) for "pre", else layer 0."""
    return model.layers[1 if entry == "pre" else 0]


def enter(model: ToyModel, entry: str, layer: Any, **flags: Any) -> Any:
    """Run `entry` ("first", "pre", "attn" or "ffn": a sublayer) on two rows with `layer` in place of the toy's."""
    b, step, x = boundaries(), DecodeStep.for_rows(ROWS), model.embed[:ROWS]
    if entry == "first":
        return b.first(layer, x, step)
    state, x = b.first(model.layers[0], x, step)
    if entry == "pre":
        return b.pre(layer, state.residual, state, step)
    state.pending = model.attention(model.layers[0], x)
    return b.sublayer(layer, entry == "ffn", state, step, **flags)


def with_norm(layer: Any, norm: str, **changes: Any) -> Any:
    """`layer` with its `norm` ("attn_norm" / "ffn_norm") changed."""
    return dataclasses.replace(layer, **{norm: dataclasses.replace(getattr(layer, norm), **changes)})


# --- device and capacity -------------------------------------------------------------------------


@NO_GPU
@pytest.mark.parametrize(
    "make",
    [
        lambda: BoundaryAllReduce(5120, device="cuda"),
        lambda: BoundaryAllReduce(5120, device="cuda", backend="reference"),
        lambda: BoundaryAllReduce(5120, device=torch.device("cuda", 0)),
        lambda: empty_quantized_layer_input(4, 5120, "cuda"),
    ],
    ids=["auto", "reference", "cuda:0", "empty_quantized_layer_input"],
)
def test_a_cuda_device_without_a_gpu_is_a_value_error_naming_device(make: Any) -> None:
    with pytest.raises(ValueError, match=r"^device is cuda(:0)?, but no CUDA GPU is available here .*device='cpu'"):
        make()


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: BoundaryAllReduce(512, device="meta"), ValueError, r"^device must be a CPU or CUDA device, got meta"),
        (lambda: empty_quantized_layer_input(4, 512, "meta"), ValueError, r"^device must be a CPU or CUDA device"),
        (lambda: BoundaryAllReduce(512, device="gpu"), ValueError, r"^device 'gpu' is not a device"),
        (lambda: BoundaryAllReduce(512, device=1.5), TypeError, r"^device must be a torch.device, a str or an int"),
    ],
    ids=["meta", "meta-empty_quantized", "unknown-type", "float"],
)
def test_a_device_that_is_no_cpu_or_cuda_device_is_refused(make: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


@NO_GPU
@pytest.mark.parametrize("kwargs", [{}, {"device": "cpu"}, {"world_size": np.int64(2)}], ids=["none", "cpu", "np"])
def test_simulated_ranks_say_they_need_a_cuda_gpu(kwargs: dict) -> None:
    kwargs = {"world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=r"^simulated ranks need a CUDA GPU"):
        BoundaryAllReduce.simulated(512, **kwargs)


def test_a_workspace_larger_than_the_free_memory_is_a_value_error_naming_max_rows() -> None:
    rows, hidden = 10**9, 5120  # 10 TB: more than any host's free memory
    needed = rows * hidden * 2 + ERROR_WORDS * 4
    with pytest.raises(
        ValueError,
        match=rf"^max_rows is {rows}: its workspace needs {needed} bytes .* on cpu, but "
        r"cpu has \d+ bytes \([\d.]+ GiB\) free",
    ):
        BoundaryAllReduce(hidden, max_rows=rows, device="cpu")


@pytest.mark.gpu
def test_a_workspace_larger_than_the_free_gpu_memory_is_a_value_error_naming_max_rows() -> None:
    # Twice what is free as the boundary counts it (the driver's free memory plus what torch's allocator holds unused,
    # which earlier tests in the process leave behind): the driver's figure alone let it fit after other GPU tests.
    rows = 2 * (checks.free_bytes(torch.device("cuda")) // (5120 * 2)) + 1
    with pytest.raises(ValueError, match=rf"^max_rows is {rows}: its workspace needs \d+ bytes .* free"):
        BoundaryAllReduce(5120, max_rows=rows, device="cuda")


@pytest.mark.parametrize("max_rows,level", [(10**5, logging.WARNING), (512, logging.INFO)])
def test_the_workspace_size_is_logged(caplog: pytest.LogCaptureFixture, max_rows: int, level: int) -> None:
    """A warning from 512 MiB up (0.95 GiB at max_rows=10**5, H 5120), else at INFO."""
    needed = max_rows * 5120 * 2 + ERROR_WORDS * 4
    with caplog.at_level(logging.INFO, logger="boundary"):
        BoundaryAllReduce(5120, max_rows=max_rows, device="cpu")
    (record,) = [r for r in caplog.records if "workspace" in r.getMessage()]
    assert record.levelno == level
    assert f"{needed} bytes" in record.getMessage() and f"max_rows={max_rows}" in record.getMessage()


# --- the scheduler -------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["first", "pre"])
def test_first_and_pre_check_max_rows(model: ToyModel, entry: str) -> None:
    step = DecodeStep.for_rows(4)
    state, _ = boundaries(max_rows=8).first(model.layers[0], model.embed[:4], step)
    small = boundaries(max_rows=2)
    with pytest.raises(ValueError, match=r"^step.rows \(4\) exceed the boundary's capacity max_rows=2"):
        if entry == "first":
            small.first(model.layers[0], model.embed[:4], step)
        else:
            small.pre(model.layers[1], state.residual, state, step)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rows=0, side_stream=False), ValueError, r"^DecodeStep.rows must be a positive int, got 0"),
        (dict(rows=2.0, side_stream=False), TypeError, r"^DecodeStep.rows must be an int, got float 2.0"),
        (dict(rows=2, side_stream="no"), TypeError, r"^DecodeStep.side_stream must be a bool"),
    ],
    ids=["rows=0", "rows=2.0", "side_stream='no'"],
)
def test_a_decode_step_built_directly_is_checked(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DecodeStep(**kwargs)


@pytest.mark.parametrize(
    "pending,match",
    [
        (lambda x: x.float(), r"^state.pending must have dtype torch.bfloat16, got torch.float32"),
        (lambda x: MoEOutput(x.float(), None), r"^state.pending.routed must have dtype torch.bfloat16"),
        (lambda x: MoEOutput(x, x.float()), r"^state.pending.shared_output must have dtype torch.bfloat16"),
    ],
    ids=["tensor", "routed", "shared_output"],
)
@pytest.mark.parametrize("call", ["sublayer", "post_only"])
def test_a_float32_pending_names_state_pending(model: ToyModel, pending: Any, match: str, call: str) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = pending(model.attention(model.layers[0], x))
    with pytest.raises(TypeError, match=match):
        b.sublayer(model.layers[0], True, state, step) if call == "sublayer" else b.post_only(state)


@pytest.mark.parametrize("call", ["sublayer", "post_only"])
def test_a_state_a_boundary_consumed_is_refused(model: ToyModel, call: str) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = model.attention(model.layers[0], x)
    reduce = (
        (lambda: b.sublayer(model.layers[0], True, state, step)) if call == "sublayer" else (lambda: b.post_only(state))
    )
    reduce()
    assert state.pending is None
    with pytest.raises(ValueError, match=r"^state.pending is None: .*a boundary consumes it"):
        reduce()


def test_pre_refuses_a_state_whose_pending_was_not_reduced(model: ToyModel) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = model.attention(model.layers[0], x)
    with pytest.raises(ValueError, match=r"^state.pending is set: reduce it with post_only\(state\) before pre\(\)"):
        b.pre(model.layers[1], state.residual, state, step)


# --- argument types ------------------------------------------------------------------------------


def test_numpy_integers_are_taken_as_ints(model: ToyModel) -> None:
    ar = BoundaryAllReduce(
        np.int64(512), max_rows=np.int64(16), hc_mult=np.int64(4), timeout_us=np.int32(1000), device="cpu"
    )
    for name, value in (("hidden_size", 512), ("max_rows", 16), ("hc_mult", 4), ("timeout_us", 1000)):
        assert type(getattr(ar, name)) is int and getattr(ar, name) == value, name
    assert ar.mailbox(np.int64(4)).shape == (4, 512)
    step = DecodeStep.for_rows(np.int64(4), overlap_max_rows=np.int64(8))
    assert type(step.rows) is int and step.rows == 4
    assert type(DecodeStep(rows=np.int16(3), side_stream=False).rows) is int
    q = empty_quantized_layer_input(np.int64(2), np.int64(512), "cpu")
    assert q.data.shape == (2, 512)
    for entry in ("first", "pre", "attn", "ffn"):  # layer.hc_mult too
        state = enter(model, entry, dataclasses.replace(toy_layer(model, entry), hc_mult=np.int64(4)))[0]
        assert state.residual.shape == (ROWS, 4, SMALL.hidden_size)


def test_numpy_reals_are_taken_as_floats() -> None:
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(2, 4, 256, generator=g).to(BF16)
    fn, scale, base = torch.randn(24, 1024, generator=g) * 0.01, torch.full((3,), 0.5), torch.zeros(24)
    weight = torch.ones(256, dtype=BF16)
    eps = np.float32(1e-6)
    got = mhc_pre_delayed(
        residual, fn, scale, base, eps, eps, eps, np.float32(2.0), np.int64(20), None, None, weight, eps
    )
    e = float(eps)
    want = mhc_pre_delayed(residual, fn, scale, base, e, e, e, 2.0, 20, None, None, weight, e)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(max_rows=True), TypeError, r"^max_rows must be an int, got bool True"),
        (dict(timeout_us=True), TypeError, r"^timeout_us must be an int, got bool True"),
        (dict(max_rows=16.0), TypeError, r"^max_rows must be an int, got float 16.0"),
        (dict(hc_mult=4.0), TypeError, r"^hc_mult must be an int, got float 4.0"),
        (dict(hc_mult=4.5), TypeError, r"^hc_mult must be an int, got float 4.5"),
    ],
    ids=["max_rows=True", "timeout_us=True", "max_rows=16.0", "hc_mult=4.0", "hc_mult=4.5"],
)
def test_bools_and_floats_are_no_ints(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BoundaryAllReduce(512, device="cpu", **kwargs)


@pytest.mark.parametrize("overlap", [True, 8.0])
def test_overlap_max_rows_is_an_int(overlap: Any) -> None:
    with pytest.raises(TypeError, match=rf"^overlap_max_rows must be an int, got {type(overlap).__name__}"):
        DecodeStep.for_rows(4, overlap_max_rows=overlap)


@pytest.mark.parametrize(
    "hc,error,match",
    [
        (4.0, TypeError, r"^layer.hc_mult must be an int, got float 4.0"),
        (2, ValueError, r"^layer.hc_mult is 2, but the boundary serves hc_mult=4"),
    ],
)
@pytest.mark.parametrize("entry", ["first", "pre", "attn", "ffn"])
def test_layer_hc_mult_is_checked(model: ToyModel, entry: str, hc: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        enter(model, entry, dataclasses.replace(toy_layer(model, entry), hc_mult=hc))


@pytest.mark.parametrize(
    "flag,value",
    [("ffn", "yes"), ("ffn", "no"), ("ffn", "False"), ("ffn", 1.5), ("ffn", 1), ("capture_aux", 1)],
)
def test_sublayer_flags_must_be_bools(model: ToyModel, flag: str, value: Any) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = model.attention(model.layers[0], x)
    kwargs = {"ffn": True, flag: value}
    ffn = kwargs.pop("ffn")
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool \(True or False\), got {type(value).__name__}"):
        b.sublayer(model.layers[0], ffn, state, step, **kwargs)
    assert state.pending is not None, "nothing was consumed"


@pytest.mark.parametrize(
    "value,error,match",
    [
        (1, TypeError, "got int 1"),
        (0, TypeError, "got int 0"),
        (1.5, TypeError, "got float 1.5"),
        ("no", ValueError, "got 'no'"),
        ("MXFP8", ValueError, "got 'MXFP8'"),
        ("", ValueError, "got ''"),
    ],
)
def test_quantize_takes_the_modules_flag_or_a_named_form(model: ToyModel, value: Any, error: type, match: str) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = model.attention(model.layers[0], x)
    with pytest.raises(
        error,
        match=rf"^quantize must be True \(MXFP8\), False or None \(bf16 only\) or one of 'mxfp8', 'fp8_1x128', "
        rf"'fp8_1x128_ue8m0', {match}",
    ):
        b.sublayer(model.layers[0], True, state, step, quantize=value)
    assert state.pending is not None, "nothing was consumed"


def test_warmup_unnormed_layer_input_is_a_bool() -> None:
    with pytest.raises(TypeError, match="^unnormed_layer_input must be a bool"):
        BoundaryAllReduce(512, max_rows=4, device="cpu").warmup(unnormed_layer_input=1)


@pytest.mark.parametrize(
    "repeat,error,match",
    [(0, ValueError, "must be a positive int, got 0"), (2.0, TypeError, "must be an int, got float 2.0")],
)
def test_warmup_sinkhorn_repeat_is_a_positive_int(repeat: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=f"^sinkhorn_repeat {match}"):
        BoundaryAllReduce(512, max_rows=4, device="cpu").warmup(sinkhorn_repeat=repeat)


@pytest.mark.parametrize("quantize", ["fp8_1x128", ("fp8",), (None,), ("mxfp8", "MXFP8"), 5, {"mxfp8"}])
def test_warmup_quantize_takes_a_sequence_of_named_forms(quantize: Any) -> None:
    ar = BoundaryAllReduce(512, max_rows=4, device="cpu")
    with pytest.raises(
        ValueError, match=r"^quantize must be a sequence of \('mxfp8', 'fp8_1x128', 'fp8_1x128_ue8m0'\)"
    ):
        ar.warmup(quantize=quantize)


# --- layer attributes ----------------------------------------------------------------------------

H = SMALL.hidden_size


@pytest.mark.parametrize(
    "entry,change,error,match",
    [
        (
            "attn",
            dict(hc_attn_fn=torch.zeros(24, 100)),
            ValueError,
            rf"^layer.hc_attn_fn must have shape \[24, {4 * H}\], got \[24, 100\]",
        ),
        (
            "ffn",
            dict(hc_ffn_fn=torch.zeros(24, 4 * H, dtype=torch.float16)),
            TypeError,
            r"^layer.hc_ffn_fn must have dtype torch.float32, got torch.float16: convert it to torch.float32 once",
        ),
        (
            "first",
            dict(hc_attn_fn_broadcast=torch.zeros(24, 4 * H)),
            ValueError,
            rf"^layer.hc_attn_fn_broadcast must have shape \[24, {H}\]",
        ),
        (
            "pre",
            dict(hc_attn_scale=torch.zeros(3, dtype=torch.float64)),
            TypeError,
            r"^layer.hc_attn_scale must have dtype torch.float32",
        ),
        ("ffn", dict(hc_ffn_base=torch.zeros(23)), ValueError, r"^layer.hc_ffn_base must have shape \[24\]"),
        ("ffn", dict(hc_eps=-1.0), ValueError, r"^layer.hc_eps must be >= 0.0, got -1.0"),
        ("attn", dict(hc_sinkhorn_iters=0), ValueError, r"^layer.hc_sinkhorn_iters must be a positive int, got 0"),
        ("first", dict(hc_post_alpha=float("nan")), ValueError, r"^layer.hc_post_alpha must be finite"),
        ("pre", dict(rms_norm_eps="1e-6"), TypeError, r"^layer.rms_norm_eps must be a real number, got str"),
    ],
    ids=[
        "hc_attn_fn",
        "hc_ffn_fn",
        "hc_attn_fn_broadcast",
        "hc_attn_scale",
        "hc_ffn_base",
        "hc_eps",
        "hc_sinkhorn_iters",
        "hc_post_alpha",
        "rms_norm_eps",
    ],
)
def test_messages_name_the_layer_attribute(model: ToyModel, entry: str, change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        enter(model, entry, dataclasses.replace(toy_layer(model, entry), **change))


@pytest.mark.parametrize(
    "entry,norm", [("first", "attn_norm"), ("pre", "attn_norm"), ("attn", "attn_norm"), ("ffn", "ffn_norm")]
)
def test_an_fp32_norm_weight_names_the_attribute_and_says_to_convert_it(model: ToyModel, entry: str, norm: str) -> None:
    layer = toy_layer(model, entry)
    layer = with_norm(layer, norm, weight=getattr(layer, norm).weight.float())
    with pytest.raises(
        TypeError,
        match=rf"^layer.{norm}.weight must have dtype torch.bfloat16, got torch.float32: "
        r"convert it to torch.bfloat16 once, when the model loads",
    ):
        enter(model, entry, layer)


@pytest.mark.parametrize("entry,norm", [("first", "attn_norm"), ("ffn", "ffn_norm")])
def test_a_negative_variance_epsilon_names_the_attribute(model: ToyModel, entry: str, norm: str) -> None:
    with pytest.raises(ValueError, match=rf"^layer.{norm}.variance_epsilon must be >= 0.0, got -1.0"):
        enter(model, entry, with_norm(toy_layer(model, entry), norm, variance_epsilon=-1.0))


def without(layer: Any, path: str) -> SimpleNamespace:
    """A copy of `layer` as a plain object, lacking the attribute `path` (dotted for a norm's)."""
    copy = SimpleNamespace(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)})
    owner, _, name = path.rpartition(".")
    if owner:
        norm = getattr(layer, owner)
        setattr(copy, owner, SimpleNamespace(**{k: v for k, v in vars(norm).items() if k != name}))
    else:
        delattr(copy, name)
    return copy


@pytest.mark.parametrize(
    "entry,path",
    [
        ("first", "hc_attn_fn_broadcast"),
        ("first", "attn_norm.weight"),
        ("pre", "hc_attn_fn"),
        ("pre", "hc_mult"),
        ("attn", "hc_sinkhorn_iters"),
        ("ffn", "ffn_norm.variance_epsilon"),
        ("ffn", "hc_ffn_scale"),
        ("ffn", "ffn_norm.weight"),
    ],
)
def test_a_missing_layer_attribute_is_named_with_the_contract(model: ToyModel, entry: str, path: str) -> None:
    with pytest.raises(TypeError, match=rf"^layer.{path} is missing .*CONTRACT §5"):
        enter(model, entry, without(toy_layer(model, entry), path))


# --- the demo and the bench entry point ----------------------------------------------------------


def run_main(main: Any, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """A command's main run in this process on `args`, as `python -m` runs it: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("tp", ["3", "64"])
def test_demo_checks_tp_before_spawning(tp: str, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_main(demo.main, capsys, "--tp", tp)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "python -m boundary.demo: error: --tp must be one of 1, 2, 4, 8, 16, 32 (a divisor of the toy's "
    ) and err.rstrip().endswith(f"got {tp}")


@NO_GPU
def test_demo_backend_kernel_on_the_cpu_is_one_line(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_main(demo.main, capsys, "--backend", "kernel")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m boundary.demo: error: --backend kernel needs a")


def test_demo_with_one_layer_has_no_engram_layer(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_main(demo.main, capsys, "--device", "cpu", "--layers", "1", "--hidden", "512", "--steps", "1")
    assert code == 0, err
    assert "1 layer (no Engram layer)" in out and "Engram at" not in out


def test_demo_reports_a_rank_that_raised_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    trace = "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n  ...\n"
    raised = mp.ProcessRaisedException(trace + "ValueError: boom\n", 1, 4242)

    def spawn(*args: Any, **kwargs: Any) -> None:
        raise raised

    monkeypatch.setattr(mp, "spawn", spawn)
    assert demo.main(["--tp", "2", "--device", "cpu", "--hidden", "512"]) == 1
    assert capsys.readouterr().err == "rank 1 failed: ValueError: boom\n"


def test_bench_help_prints_help(capsys: pytest.CaptureFixture) -> None:
    from bench.__main__ import main

    code, out, err = run_main(main, capsys, "--help")
    assert code == 0, err
    assert out.startswith("usage: python -m bench") and "toy DeepSeek" not in out


# --- the custom ops' path: the dispatcher's own errors name no argument ---------------------------


@pytest.mark.parametrize("scheme", ["v4.1", "v4"])
@pytest.mark.parametrize(
    "attr,value,error,match",
    [
        ("ffn_norm.variance_epsilon", "1e-6", TypeError, r"^layer.ffn_norm.variance_epsilon must be a real number"),
        ("ffn_norm.variance_epsilon", None, TypeError, r"^layer.ffn_norm.variance_epsilon must be a real number"),
        ("rms_norm_eps", "1e-6", TypeError, r"^layer.rms_norm_eps must be a real number"),
        ("hc_sinkhorn_iters", 20.0, TypeError, r"^layer.hc_sinkhorn_iters must be an int"),
        ("hc_post_alpha", np.float32(2.0), None, None),  # a numpy real is taken as a float, as the direct path takes it
    ],
)
def test_layer_scalars_through_the_custom_ops_are_checked_as_directly(
    model: ToyModel, scheme: str, attr: str, value: Any, error: type | None, match: str | None
) -> None:
    """With custom_ops=True a layer scalar of the wrong type raises the direct path's TypeError naming the layer
    attribute (not the dispatcher's RuntimeError naming the op's argument), before state.pending is consumed."""
    layer = model.layers[0]
    if "." in attr:
        norm, field = attr.split(".")
        bad = with_norm(layer, norm, **{field: value})
    else:
        bad = dataclasses.replace(layer, **{attr: value})
    outs = []
    for changed in (layer, bad):
        ar = BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu")
        b = (V4Boundaries if scheme == "v4" else Boundaries)(ar, custom_ops=True)
        step = DecodeStep.for_rows(ROWS)
        state, x = b.first(layer, model.embed[:ROWS], step)[:2]
        state.pending = model.attention(layer, x)
        if changed is bad and error is not None:
            with pytest.raises(error, match=match):
                b.sublayer(bad, True, state, step)
            assert state.pending is not None
            return
        outs.append(b.sublayer(changed, True, state, step)[1])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("custom_ops", [False, True])
def test_final_names_a_missing_or_wrong_eps_on_both_paths(model: ToyModel, custom_ops: bool) -> None:
    b = Boundaries(BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu"), custom_ops=custom_ops)
    step = DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = model.attention(model.layers[0], x)
    with pytest.raises(TypeError, match=r"eps is missing after the norm weight"):
        b.final(state, model.final_norm.weight)
    with pytest.raises(TypeError, match=r"^eps must be a real number, got str"):
        b.final(state, model.final_norm.weight, "1e-6")
    with pytest.raises(TypeError, match=r"^norm.variance_epsilon must be a real number, got NoneType"):
        b.final(state, dataclasses.replace(model.final_norm, variance_epsilon=None))
    assert state.pending is not None
    assert b.final(state, model.final_norm).shape == (ROWS, SMALL.hidden_size)


def test_the_first_layers_coefficients_take_no_carried_pre() -> None:
    """With x (the first layer's embedding) the collapse is stream 0 exactly: a pre_mix beside it is refused, as the
    kernels would ignore it and the reference would collapse with it (the two paths disagreed)."""
    e = torch.randn(3, 256).to(torch.bfloat16)
    streams = e.unsqueeze(1).expand(-1, 4, -1).contiguous()
    args = (streams, torch.randn(24, 256) * 0.01, torch.ones(3), torch.zeros(24), 1e-20, 1e-6, 1e-6, 2.0, 20)
    with pytest.raises(ValueError, match=r"^pre_mix must be None with x"):
        mhc_pre_delayed(*args, pre_mix=torch.full((3, 4), 0.3), x=e)
    assert mhc_pre_delayed(*args, x=e)[2] is not None  # the same call without it runs


@pytest.mark.parametrize("call", ["sublayer", "pre", "post_only"])
def test_a_state_without_streams_is_a_type_error_naming_state_residual(model: ToyModel, call: str) -> None:
    b, step = boundaries(), DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)
    state.pending = None if call == "pre" else model.attention(model.layers[0], x)
    broken = dataclasses.replace(state, residual=None)
    calls = {
        "sublayer": lambda: b.sublayer(model.layers[0], True, broken, step),
        "pre": lambda: b.pre(model.layers[1], state.residual, broken, step),
        "post_only": lambda: b.post_only(broken),
    }
    with pytest.raises(TypeError, match=r"^state.residual must be a Tensor, got NoneType"):
        calls[call]()


@pytest.mark.parametrize("scheme", ["v4.1", "v4"])
@pytest.mark.parametrize(
    "attr,value,error,match",
    [
        ("hc_ffn_fn", torch.zeros(24, 1023), ValueError, r"^layer.hc_ffn_fn must have shape \[24, 2048\]"),
        ("hc_ffn_fn", torch.zeros(24, 2048, dtype=torch.float64), TypeError, r"^layer.hc_ffn_fn must have dtype"),
        ("hc_ffn_fn", torch.zeros(2048, 24).t(), ValueError, r"^layer.hc_ffn_fn must be contiguous"),
        ("hc_ffn_scale", torch.zeros(2), ValueError, r"^layer.hc_ffn_scale must have shape \[3\]"),
        ("hc_ffn_base", torch.zeros(23), ValueError, r"^layer.hc_ffn_base must have shape \[24\]"),
        ("hc_sinkhorn_iters", 0, ValueError, r"^layer.hc_sinkhorn_iters must be a positive int"),
        ("rms_norm_eps", float("nan"), ValueError, r"^layer.rms_norm_eps must be finite"),
        ("hc_eps", -1.0, ValueError, r"^layer.hc_eps must be >= 0.0"),
    ],
)
def test_a_bad_mhc_argument_is_refused_before_the_reduction(
    model: ToyModel, scheme: str, attr: str, value: Any, error: type, match: str
) -> None:
    """SPEC §6: nothing half-written. A sublayer whose layer's mHC arguments are wrong raises before its boundary
    consumes state.pending (on a TP group: before the exchange), so the call can be made again once mended."""
    ar = BoundaryAllReduce(SMALL.hidden_size, max_rows=8, device="cpu")
    b = (V4Boundaries if scheme == "v4" else Boundaries)(ar)
    step = DecodeStep.for_rows(ROWS)
    state, x = b.first(model.layers[0], model.embed[:ROWS], step)[:2]
    state.pending = model.attention(model.layers[0], x)
    with pytest.raises(error, match=match):
        b.sublayer(dataclasses.replace(model.layers[0], **{attr: value}), True, state, step)
    assert state.pending is not None
    b.sublayer(model.layers[0], True, state, step)  # the same call, mended
    assert state.pending is None
