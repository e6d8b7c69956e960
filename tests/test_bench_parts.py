"""The benchmark's host-cost and decode-step parts run every call they time (on the CPU's reference path here, with
a timer that calls each closure once), and their tables print: a part that breaks shows up before a GPU run."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from bench import host, step
from bench.kernels import CALLS_PER_GRAPH, boundary_inputs
from bench.run import parse_args

CPU = torch.device("cpu")


def once(call: Callable[[], object]) -> float:
    call()
    return 1.0


class OnceTimer:
    """GraphTimer's interface on the CPU: each closure runs once, every time is 1 us."""

    device = CPU

    def __init__(self) -> None:
        self.calls = 0

    def per_call_us(self, calls: Sequence[Callable[[], object]], calls_each: int = 1) -> float:
        for call in calls:
            call()
            self.calls += 1
        return 1.0


def once_each(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    return {name: once(call) for name, call in calls.items()}


def test_the_host_part_times_every_calling_form(capsys) -> None:
    torch._dynamo.reset()
    row = host.host_row(512, 2, boundary_inputs(2, 512, CPU, seed=0), once_each)
    assert row["op_compiled_loop_us"] == 1.0 / host.LOOP
    assert row["direct_step_ms"] == 2 * host.LAYERS / 1000
    assert row["sublayer_us"] == row["v4_sublayer_us"] == 1.0 and row["v4_sublayer_step_ms"] == 2 * host.LAYERS / 1000
    host.print_host([row])
    assert "V4 sub" in capsys.readouterr().out


def test_the_host_parts_scheduler_calls_are_whole_boundaries_on_a_pending_partial_set_each_call() -> None:
    """`sublayer` and `v4_sublayer` run the scheduler's boundary as an engine does: each call consumes the state's
    pending partial and gives the V4.1 / V4 outputs (here on the CPU's reference path)."""
    from boundary import BoundaryAllReduce

    inp = boundary_inputs(2, 512, CPU, seed=0)
    calls = host.scheduler_calls(BoundaryAllReduce(512, max_rows=2, device=CPU), inp)
    for name in ("sublayer", "v4_sublayer"):
        first, again = calls[name](), calls[name]()  # the second call finds its pending partial set again
        assert first[0].residual.shape == (2, 4, 512) and first[1].shape == (2, 512)
        assert torch.equal(first[1], again[1])


def test_the_default_bench_is_a_few_shapes_of_every_part_and_full_is_the_sweep() -> None:
    from bench.run import DEFAULTS, FULL

    quick, full = parse_args([]), parse_args(["--full"])
    assert quick.parts == full.parts == ["boundary", "host", "allreduce", "coefficients", "step", "v4"]
    for name in DEFAULTS:
        if FULL[name] is not None:
            assert getattr(full, name) == FULL[name] and set(getattr(quick, name)) <= set(FULL[name]), name
    assert full.step_compile_rows == full.step_rows and full.step_compile_tp == full.step_tp
    # The compile baseline (37-73 s of torch.compile per shape on the H200): TP 1 at 1 and 16 rows by default.
    compiled = [(tp, r) for tp in quick.step_tp for r in quick.step_rows if step.step_compiles(quick, tp, r)]
    assert compiled == [(1, 1), (1, 16)]
    assert len([1 for tp in full.step_tp for r in full.step_rows if step.step_compiles(full, tp, r)]) == 24
    assert not step.step_compiles(parse_args(["--no-compile"]), 1, 1)
    assert parse_args(["--full", "--hidden", "4096"]).hidden == [4096]  # a shape given wins over either set


def test_the_step_part_times_ours_and_the_baselines(capsys) -> None:
    argv = ["--step-hidden", "512", "--step-rows", "1", "3", "--step-layers", "2", "--step-tp", "1"]
    args: argparse.Namespace = parse_args(argv)
    args.no_compile = True
    timer = OnceTimer()
    laps: list[str] = []
    rows = step.bench_step(args, timer, lap=laps.append)  # type: ignore[arg-type]
    assert [(r["H"], r["rows"]) for r in rows] == [(512, 1), (512, 3)]
    assert laps == ["compile-ahead", "TP 1"]  # make bench's clock hears each stage (a simulated W: its own)
    # side streams, inline, eager chain, the model code alone (GLUE_CALLS in its graph), the toy sublayers
    assert timer.calls == 2 * (4 + step.GLUE_CALLS)
    assert all(r["boundaries"] == 2 * 2 for r in rows)  # two per layer
    step.print_step(rows)
    printed = capsys.readouterr().out
    assert "TP > 1: SIMULATED ranks on one GPU" in printed
    assert [line.split()[:4] for line in printed.splitlines() if line.startswith("  512")] == [
        ["512", "1", "2", "1"],
        ["512", "1", "2", "3"],
    ]


def test_the_critical_path_rows_time_the_weight_read_step_with_ours_and_with_output_copies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """At the weight-read step's H (here made 512, its reads a few KB) the step part also times that step with our
    boundaries (side streams, inline) and with boundaries that only write their outputs; the difference over the
    step's boundaries is the critical-path cost per boundary, printed in its own table."""
    from bench import critical_path, weight_reads

    monkeypatch.setattr(weight_reads, "HIDDEN", 512)
    monkeypatch.setattr(weight_reads, "layer_bytes", lambda rows: (4096, 8192 * rows))
    times = iter(range(1, 1000))

    class CountingTimer(OnceTimer):
        def per_call_us(self, calls: Sequence[Callable[[], object]], calls_each: int = 1) -> float:
            super().per_call_us(calls, calls_each)
            return float(next(times))

    args = parse_args(["--step-hidden", "512", "--step-rows", "2", "--step-layers", "2", "--step-tp", "1"])
    args.no_compile = True
    (row,) = step.bench_step(args, CountingTimer())  # type: ignore[arg-type]
    # side, inline, eager, glue, toy step, then the V3 step: side, early join, inline, copies (the 6th to 9th timings),
    # then the V4 step on the same sublayers and its copies (10th, 11th)
    assert (row["v3_side_us"], row["v3_early_us"], row["v3_inline_us"], row["v3_copies_us"]) == (6.0, 7.0, 8.0, 9.0)
    assert row["critical_side_us"] == (6.0 - 9.0) / 4 and row["critical_early_us"] == (7.0 - 9.0) / 4
    assert row["critical_inline_us"] == (8.0 - 9.0) / 4
    assert (row["v3_v4_us"], row["v3_v4_copies_us"]) == (10.0, 11.0) and row["critical_v4_us"] == (10.0 - 11.0) / 4
    assert row["v3_step_us"] == row["v3_inline_us"]  # the default step: inline (MHC_OVERLAP_MAX_ROWS is 0)
    critical_path.print_critical_path([row])
    out = capsys.readouterr().out
    assert "  512    2   4 |" in out and "    10.0     11.0    -0.25" in out


def test_output_copies_stand_in_for_the_boundaries_of_a_toy_step() -> None:
    """The stand-in drives the toy step as Boundaries does; every output it gives is a fresh copy (a write)."""
    from bench.critical_path import OutputCopies
    from boundary import DecodeStep
    from boundary.toy import ToyConfig, ToyModel, decode_step, random_tokens

    model = ToyModel(ToyConfig(hidden_size=256, num_layers=3, vocab=16))
    copies = OutputCopies(3, 256, CPU)
    out = decode_step(model, copies, random_tokens(model, 3, 0), DecodeStep(rows=3, side_stream=False))  # type: ignore[arg-type]
    assert out.hidden.shape == (3, 256) and torch.equal(out.hidden, copies.layer_input)
    assert out.hidden.data_ptr() != copies.layer_input.data_ptr()
    assert out.moe_input_mxfp8 is not None and out.aux is not None


def test_v4_output_copies_stand_in_for_the_v4_boundaries_of_a_toy_v4_step() -> None:
    """OutputCopiesV4 drives the toy V4 step as V4Boundaries does (its sublayer's 3 outputs, final with hc_head);
    v4_step_call runs that step, and with V4Boundaries the toy's own V4 step."""
    from bench.critical_path import OutputCopiesV4, v4_step_call
    from boundary import BoundaryAllReduce, V4Boundaries
    from boundary.toy import ToyConfig, ToyModel

    model = ToyModel(ToyConfig(hidden_size=256, num_layers=3, vocab=16))
    copies = OutputCopiesV4(3, 256, CPU)
    out = v4_step_call(model, copies, 3)()
    assert out.hidden.shape == (3, 256) and torch.equal(out.hidden, copies.layer_input)  # type: ignore[attr-defined]
    assert out.hidden.data_ptr() != copies.layer_input.data_ptr()  # type: ignore[attr-defined]
    assert out.moe_input_mxfp8 is not None  # type: ignore[attr-defined]
    ours = V4Boundaries(BoundaryAllReduce(256, max_rows=3, device=CPU))
    assert v4_step_call(model, ours, 3)().hidden.shape == (3, 256)  # type: ignore[attr-defined]


def test_an_interrupted_step_part_keeps_the_rows_it_measured() -> None:
    """A time limit's SIGINT in the middle of the step part: the rows already measured stay in the caller's list
    (bench.run.main writes and prints them)."""

    class StopsInTheSecondRow(OnceTimer):
        def per_call_us(self, calls: Sequence[Callable[[], object]], calls_each: int = 1) -> float:
            if self.calls >= 4 + step.GLUE_CALLS:  # a row's calls
                raise KeyboardInterrupt
            return super().per_call_us(calls, calls_each)

    args = parse_args(["--step-hidden", "512", "--step-rows", "1", "3", "--step-layers", "2", "--step-tp", "1"])
    args.no_compile = True
    rows: list[dict] = []
    try:
        step.bench_step(args, StopsInTheSecondRow(), rows)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt was swallowed")
    assert [(r["H"], r["rows"]) for r in rows] == [(512, 1)]


@pytest.fixture
def traced_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's torch.compile calls with the aot_eager backend: Dynamo traces the baseline's code (static shapes,
    no graph break, no recompile) exactly as under Inductor, without Inductor's CPU code generation (C++ through the
    host compiler, a minute per graph here), which is not the code the GPU bench runs anyway (Triton there)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: real(*args, **kwargs, backend="aot_eager"))


def test_the_compiled_step_baseline_traces_the_reference_chain(traced_only: None) -> None:
    from boundary import Boundaries, BoundaryAllReduce
    from boundary.toy import ToyConfig, ToyModel, compare

    model = ToyModel(ToyConfig(hidden_size=512, num_layers=2, vocab=64))
    ref = Boundaries(BoundaryAllReduce(512, max_rows=4, device="cpu", backend="reference"))
    free = step.boundaries_only(model, 2)
    compiled = step._compiled_call(free, ref, 2)
    eager = step._step_call(free, ref, 2, False)
    # Under Inductor (the GPU bench) the chain's fp32 math is fused and rounded its own way: a baseline, held to the
    # eager chain's result within a few bf16 ulps of the largest output (measured 0.5 %), not bit for bit.
    assert compare(compiled(), eager())["max_rel"] < 0.02


def test_the_multi_rank_compile_baseline_is_the_exchange_then_one_compiled_chain_for_every_rank_and_w(
    traced_only: None,
) -> None:
    """Each rank's exchange in eager, then the reference chain compiled once per row count: its output is the eager
    baseline's (summed_sublayers, then the chain) within the compile tolerance above, and other ranks and another W
    run the same compiled graph (a recompile raises here)."""
    from boundary import Boundaries, BoundaryAllReduce
    from boundary.toy import ToyConfig, ToyModel, compare

    config = ToyConfig(hidden_size=512, num_layers=2, vocab=64)
    ref = Boundaries(BoundaryAllReduce(512, max_rows=4, device="cpu", backend="reference"))
    two = [step.boundaries_only(ToyModel(config, rank=r, world_size=2), 3) for r in range(2)]
    four = [step.boundaries_only(ToyModel(config, rank=r, world_size=4), 3) for r in range(4)]
    compiled = step.CompiledChains(ref)
    got = compiled.rank_call(two, 1, 3)()
    want = step._step_call(step.summed_sublayers(two, 1), ref, 3, False)()
    assert compare(got, want)["max_rel"] < 0.02
    with torch._dynamo.config.patch(error_on_recompile=True):
        for r in range(4):
            got = compiled.rank_call(four, r, 3)()
            want = step._step_call(step.summed_sublayers(four, r), ref, 3, False)()
            assert compare(got, want)["max_rel"] < 0.02
    assert list(compiled.chains) == [3]


def test_the_simulated_baseline_sums_every_ranks_partial_in_rank_order() -> None:
    """The multi-rank baseline's sublayers: every rank's fixed partial summed in fp32 in rank order, one bf16 rounding
    (the MoE partials finalized first), the exchange of CONTRACT §2 step 1."""
    from boundary import reference
    from boundary.toy import ToyConfig, ToyModel

    config = ToyConfig(hidden_size=512, num_layers=2, vocab=64)
    free = [step.boundaries_only(ToyModel(config, rank=r, world_size=4), 3) for r in range(4)]
    summed = step.summed_sublayers(free)
    layer, x = free[0].layers[1], torch.zeros(3, 512, dtype=torch.bfloat16)
    parts = [m.attention(m.layers[1], x) for m in free]
    want = ((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()
    assert torch.equal(summed.attention(layer, x).view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    moe = [m.moe(m.layers[1], x) for m in free]
    finalized = [
        reference.moe_finalize(
            o.routed.gemm2_permuted, o.routed.expert_weights, o.routed.expanded_idx_to_permuted_idx, o.shared_output
        ).float()
        for o in moe
    ]
    want = ((finalized[0] + finalized[1]) + finalized[2]) + finalized[3]
    assert torch.equal(summed.moe(layer, x).view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    assert not torch.equal(parts[0], parts[1]), "the ranks' partials differ (each rank holds its own shard)"


def test_the_final_boundarys_baseline_computes_what_final_computes() -> None:
    """bench's post_only + collapse + norm (what Boundaries.final replaces) gives final's h: the same work."""
    from bench.kernels import post_only_then_norm_call
    from boundary import BoundaryAllReduce

    inp = boundary_inputs(3, 512, CPU, seed=1)
    ar = BoundaryAllReduce(512, max_rows=4, device="cpu")
    _, h = ar(inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20, None)
    assert torch.equal(post_only_then_norm_call(ar, inp)().view(torch.int16), h.view(torch.int16))


def test_the_tilelang_step_rows_join_the_step_rows_by_shape_and_tp() -> None:
    rows = [{"H": 5120, "rows": 1, "tp": 1, "ours_us": 10.0}, {"H": 5120, "rows": 1, "tp": 2, "ours_us": 20.0}]
    rows += [{"H": 5120, "rows": 1, "tp": 4, "ours_us": 30.0}, {"H": 5120, "rows": 4, "tp": 4, "stalled": "rank 0"}]
    tilelang = [{"H": 5120, "rows": 1, "tilelang_step_us": 35.0}, {"H": 7168, "rows": 1}]  # no "tp": v24's, TP 1
    tilelang += [{"H": 5120, "tp": 4, "rows": r, "tilelang_step_us": 60.0} for r in (1, 4)]
    tilelang += [{"H": 5120, "tp": 2, "rows": 1, "error": "RuntimeError: capture failed"}]  # a shape that failed
    step.add_tilelang(rows, tilelang)
    assert rows[0]["x_tilelang"] == 3.5 and "tilelang_us" not in rows[1] and rows[2]["x_tilelang"] == 2.0
    assert "tilelang_us" not in rows[3]  # a stalled row has no time of ours to divide


def test_the_tilelang_exchange_is_the_rank_order_sum_with_the_ranks_own_partial_in_its_place() -> None:
    """A simulated TileLang rank's all-reduce: its own partial (the MoE's finalized first) at its rank's place among
    the received ones, summed in fp32 in rank order, one bf16 rounding (CONTRACT §2 step 1)."""
    from bench import tilelang_step

    cpu = torch.device("cpu")
    for top_k in (0, 4):
        inp = tilelang_step.boundary_inputs(3, 256, cpu, seed=2, top_k=top_k)
        received = [torch.randn(3, 256).to(torch.bfloat16) for _ in range(3)]
        own = inp["own"] = torch.randn(3, 256).to(torch.bfloat16)  # after attention: the rank's own partial
        if top_k:
            own = torch.add(inp["routed"].sum(1), inp["shared"])
        tilelang_step.exchange(inp, received, rank=2)
        parts = [received[0], received[1], own, received[2]]
        want = ((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()
        assert torch.equal(inp["x"][0].view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def test_the_tilelang_step_says_when_tile_kernels_is_missing(tmp_path, capsys) -> None:
    from bench import tilelang_step

    assert tilelang_step.main(["--out", str(tmp_path / "t.json")]) == 1
    assert "nothing was measured" in capsys.readouterr().out
    assert not (tmp_path / "t.json").exists()


def fake_tile_kernels(root) -> None:
    """An importable tile_kernels package with an (empty) mhc module: what --tilelang-path looks for."""
    (root / "tile_kernels").mkdir()
    (root / "tile_kernels" / "__init__.py").write_text("")
    (root / "tile_kernels" / "mhc.py").write_text("")


def test_the_tilelang_path_is_checked_before_anything_runs(tmp_path, capsys) -> None:
    for argv, says in (
        (["--tilelang-path", str(tmp_path)], "holds no tile_kernels package"),
        (["--tilelang-path", str(tmp_path), "--tilelang-json", "t.json"], "measured before"),
        (["--tilelang-v4", str(tmp_path)], "holds no tilelang-v4.json"),
    ):
        if "measured before" in says:
            fake_tile_kernels(tmp_path)
        try:
            parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert says in capsys.readouterr().err


def test_the_v4_part_reads_a_tilelang_run_from_before(tmp_path) -> None:
    """--tilelang-v4: the rows (failed shapes left out) and parity cases that bench.tilelang_step --boundary wrote."""
    from bench import v4

    rows = [{"H": 512, "rows": 1, "tilelang_us": 9.5}, {"H": 512, "rows": 4, "error": "RuntimeError: x"}]
    (tmp_path / "tilelang-v4.json").write_text(json.dumps({"gpu": "test", "rows": rows}))
    torch.save([{"H": 512, "rows": 1}], tmp_path / "parity.pt")
    args = parse_args(["--tilelang-v4", str(tmp_path)])
    assert v4.tilelang_rows(args) == ({(512, 1): 9.5}, [{"H": 512, "rows": 1}])


def test_the_tilelang_process_gets_the_step_parts_shapes(tmp_path) -> None:
    fake_tile_kernels(tmp_path)
    args = parse_args(["--tilelang-path", str(tmp_path), "--step-hidden", "512", "--step-rows", "1", "4"])
    cmd = step.tilelang_command(args, tmp_path / "t.json")
    assert cmd[1:3] == ["-m", "bench.tilelang_step"]
    text = " ".join(cmd)
    assert (
        "--step-hidden 512 --step-rows 1 4 --step-tp 1 2 --step-layers 4 --top-k 4" in text
        and f"--out {tmp_path / 't.json'}" in text
    )


def test_the_tilelang_step_finalizes_the_moe_partials_as_the_toy_step_has_them() -> None:
    """Every second TileLang boundary follows the MoE, as the toy step's do: it gets the toy's top-k weighted expert
    rows and a shared output, and its partial is their sum (vLLM's moe_sum, then the shared add)."""
    from bench import tilelang_step
    from boundary.toy import ToyConfig

    assert tilelang_step.TOP_K == ToyConfig().top_k and tilelang_step.VOCAB == ToyConfig().vocab
    assert [tilelang_step.after_moe(i) for i in range(4)] == [False, True, False, True]
    cpu = torch.device("cpu")
    moe = tilelang_step.boundary_inputs(3, 256, cpu, seed=1, top_k=4)
    assert moe["routed"].shape == (3, 4, 256) and moe["shared"].shape == (3, 256)
    assert "routed" not in tilelang_step.boundary_inputs(3, 256, cpu, seed=1)
    x = moe["x"][0]
    torch.add(moe["routed"].sum(1), moe["shared"], out=x)  # what tilelang_boundary does before mhc_post_fwd
    want = (moe["routed"].float().sum(1) + moe["shared"].float()).to(torch.bfloat16)
    bound = 2 * 2**-8 * (moe["routed"].float().abs().sum(1) + moe["shared"].float().abs())  # two bf16 roundings
    assert ((x.float() - want.float()).abs() <= bound).all()


def test_the_tilelang_step_runs_the_toy_steps_model_code_too() -> None:
    """The embedding broadcast to the streams and the Engram injection: on the toy's own tables, the toy's bits."""
    from bench import tilelang_step
    from boundary.toy import ToyConfig, ToyModel

    model = ToyModel(ToyConfig(hidden_size=256), device="cpu")
    layer = next(layer for layer in model.layers if layer.engram_table is not None)
    tokens = torch.tensor([0, 5, 511])
    want = model.engram_inject(layer, model.embed[tokens].unsqueeze(1).expand(-1, 4, -1), tokens)
    got = tilelang_step.engram_streams(model.embed, layer.engram_table, layer.engram_gate, tokens)
    assert torch.equal(got, want)
    assert tilelang_step.model_code(3, 256, torch.device("cpu"))().shape == (3, 4, 256)


def test_a_tilelang_run_that_measures_nothing_fails_the_step_part_loudly(tmp_path) -> None:
    """Here (no GPU) the TileLang process finds tile_kernels on --tilelang-path but no GPU: bench must raise with its
    output, not print a step table without the column."""
    fake_tile_kernels(tmp_path)
    args = parse_args(["--tilelang-path", str(tmp_path), "--step-hidden", "512", "--step-rows", "1"])
    try:
        step.run_tilelang(args)
    except RuntimeError as exc:
        assert "bench.tilelang_step failed (exit 1)" in str(exc) and "no CUDA GPU" in str(exc), exc
    else:
        raise AssertionError("a TileLang run with no GPU passed")


def test_the_step_plot_draws_the_tp1_rows_only(tmp_path) -> None:
    """Simulated rows (no compile or TileLang column) beside TP 1 rows must not break the plot."""
    tp1 = {"H": 512, "tp": 1, "layers": 2, "rows": 1, "ours_us": 1.0, "eager_us": 2.0, "compile_us": 3.0}
    tp4 = {"H": 512, "tp": 4, "layers": 2, "rows": 1, "ours_us": 1.5, "eager_us": 2.5, "toy_step_us": 3.5}
    step.plot_step([tp1, {**tp1, "rows": 4}, tp4], tmp_path / "step.png")
    assert (tmp_path / "step.png").stat().st_size > 0
    step.plot_step([tp4], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_a_simulated_ranks_baseline_finalizes_only_its_own_moe_partial() -> None:
    """With a rank, the others' MoE partials are finalized once (what the rank receives), its own per call; the sum
    is the same as with every partial finalized per call."""
    from boundary.toy import ToyConfig, ToyModel

    config = ToyConfig(hidden_size=512, num_layers=2, vocab=64)
    free = [step.boundaries_only(ToyModel(config, rank=r, world_size=2), 3) for r in range(2)]
    calls = []
    counted = [step.boundaries_only(ToyModel(config, rank=r, world_size=2), 3) for r in range(2)]
    for r, m in enumerate(counted):
        inner = m.moe
        m.moe = lambda layer, x, r=r, inner=inner: calls.append(r) or inner(layer, x)  # type: ignore[method-assign]
    per_rank = step.summed_sublayers(counted, rank=1)
    calls.clear()
    layer, x = free[0].layers[0], torch.zeros(3, 512, dtype=torch.bfloat16)
    got = per_rank.moe(layer, x)
    assert calls == [1], calls
    assert torch.equal(got.view(torch.int16), step.summed_sublayers(free).moe(layer, x).view(torch.int16))


def test_a_simulated_step_that_stalls_is_reported_and_ends_its_world_size(monkeypatch, capsys) -> None:
    """A simulated step whose boundary gave up waiting: a STALLED row (no timings), every rank re-armed, and no more
    rows at that W (the exchange was out of step); other errors propagate."""

    class Stalls:
        resets = 0

        def __init__(self, *args: object) -> None:
            pass

        def row(self, timer: object, rows: int, compiled: object = None) -> dict:
            if rows > 1:
                raise RuntimeError("rank 0: the boundary gave up waiting for rank(s) [3] after timeout_us=10")
            return {"H": 512, "tp": 4, "layers": 2, "boundaries": 4, "rows": rows, "overlap_us": 2.0}

        def reset(self) -> None:
            Stalls.resets += 1

    monkeypatch.setattr(step, "SimulatedStep", Stalls)
    args = parse_args(["--step-rows", "1", "4", "16"])
    out: list[dict] = []
    step.bench_step_simulated(args, OnceTimer(), 512, 4, out)  # type: ignore[arg-type]
    assert [r["rows"] for r in out] == [1, 4] and "stalled" in out[1] and Stalls.resets == 1
    step.print_step(out[1:])
    assert "STALLED: rank 0: the boundary gave up waiting" in capsys.readouterr().out

    def fails(self: object, timer: object, rows: int, compiled: object = None) -> dict:
        raise RuntimeError("something else")

    monkeypatch.setattr(Stalls, "row", fails)
    try:
        step.bench_step_simulated(args, OnceTimer(), 512, 4, [])  # type: ignore[arg-type]
    except RuntimeError as exc:
        assert str(exc) == "something else"
    else:
        raise AssertionError("an error other than a stall was swallowed")


def test_a_simulated_tilelang_step_runs_each_ranks_exchange_then_boundary_on_its_own_stream(monkeypatch) -> None:
    """Every rank, on its own stream: the model code, then per boundary its exchange (W - 1 partials received) and
    TileLang's boundary on the ready partial."""
    from bench import tilelang_step

    events: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: f"stream on {device}")
    monkeypatch.setattr(
        tilelang_step,
        "on_streams",
        lambda streams, work: [events.append(("stream", s)) or w() for s, w in zip(streams, work)],
    )
    monkeypatch.setattr(
        tilelang_step, "exchange", lambda inp, got, rank: events.append(("exchange", rank, len(got), "routed" in inp))
    )
    monkeypatch.setattr(tilelang_step, "tilelang_boundary", lambda inp, ready: events.append(("boundary", ready)))
    call = tilelang_step.simulated_step_call(256, 3, 4, torch.device("cpu"), world=2)
    call()
    per_rank = [("exchange", None, 1, False), ("boundary", True), ("exchange", None, 1, True), ("boundary", True)] * 2
    for rank in range(2):
        got = events[rank * 9 : rank * 9 + 9]
        assert got[0] == ("stream", "stream on cpu")
        assert [e if e[0] != "exchange" else (e[0], None, *e[2:]) for e in got[1:]] == per_rank
        assert {e[1] for e in got[1:] if e[0] == "exchange"} == {rank}


def test_early_join_is_our_boundaries_with_the_join_before_each_sublayers_last_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EarlyJoin drives the step with our Boundaries' bits; the step's own join calls do nothing, and the sublayers'
    `before_last` hook makes the one join per sublayer, with the layer the boundary after it reads."""
    from bench import critical_path, weight_reads
    from boundary import Boundaries, BoundaryAllReduce, DecodeStep
    from boundary.toy import ToyConfig, ToyModel, decode_step, random_tokens

    monkeypatch.setattr(weight_reads, "layer_bytes", lambda rows: (4096, 8192))
    model = step.boundaries_only(ToyModel(ToyConfig(hidden_size=256, num_layers=3, vocab=16)), 2)
    ours = Boundaries(BoundaryAllReduce(256, max_rows=4, device=CPU, backend="reference"))
    joined: list[int] = []
    monkeypatch.setattr(Boundaries, "join", lambda self, layer, step: joined.append(layer.index))
    early = critical_path.EarlyJoin(ours, DecodeStep(rows=2, side_stream=False))
    reading = weight_reads.WeightReads(CPU, 2).model(model, 2, before_last=early.before_last)
    tokens = random_tokens(model, 2, 0)
    out = decode_step(reading, early, tokens, DecodeStep(rows=2, side_stream=False))  # type: ignore[arg-type]
    assert joined == [0, 0, 1, 1, 2, 2]  # each sublayer's, from before_last alone
    joined.clear()
    plain = decode_step(model, ours, tokens, DecodeStep(rows=2, side_stream=False))
    assert joined == [0, 0, 1, 1, 2, 2] and torch.equal(out.hidden, plain.hidden)


def test_the_simulated_rows_carry_the_critical_path_over_output_copies(monkeypatch, capsys) -> None:
    """A simulated row also times every rank's step with boundaries that only write their outputs, each rank's on
    its own stream (here: in turn), and gives (ours - copies) / boundaries with side streams and inline."""
    from bench import critical_path
    from boundary import BoundaryAllReduce
    from boundary.toy import ToyConfig, ToyModel

    sim = object.__new__(step.SimulatedStep)
    sim.config = ToyConfig(hidden_size=256, num_layers=2, vocab=16)
    sim.ranks = [BoundaryAllReduce(256, max_rows=4, device=CPU) for _ in range(2)]
    sim.full = [ToyModel(sim.config, rank=r, world_size=2) for r in range(2)]
    sim.streams = [None, None]
    ran: list[object] = []
    monkeypatch.setattr(step, "on_streams", lambda streams, work: ran.extend(fn() for fn in work))
    free = [step.boundaries_only(m, 2) for m in sim.full]
    sim.copies_step(free, 2)()
    assert len(ran) == 2 and all(out.hidden.shape == (2, 256) for out in ran)  # each rank's step, output copies

    monkeypatch.setattr(sim, "ours_step", lambda models, rows, side: lambda: None)
    monkeypatch.setattr(sim, "baseline_step", lambda models, rows: lambda: None)
    monkeypatch.setattr(sim, "check", lambda: None)
    times = iter([10.0, 8.0, 4.0, 50.0])  # side, inline, copies, eager

    class Timer(OnceTimer):
        def per_call_us(self, calls: Sequence[Callable[[], object]], calls_each: int = 1) -> float:
            super().per_call_us(calls, calls_each)
            return next(times)

    row = sim.row(Timer(), 2)
    assert row["copies_us"] == 4.0 and row["boundaries"] == 4
    assert row["critical_side_us"] == (10.0 - 4.0) / 4 and row["critical_inline_us"] == (8.0 - 4.0) / 4
    critical_path.print_critical_path([row])
    out = capsys.readouterr().out
    assert "SIMULATED TP ranks" in out and "  256  2    2   4 |      4.0 |      1.50        1.00" in out


def test_the_v4_part_times_ours_its_quantized_forms_final_and_the_chains_per_shape(capsys) -> None:
    """The V4 part (bench.v4) runs V4Boundaries.sublayer (bf16, MXFP8, FP8 1x128), V4Boundaries.final and the torch
    chain on every input set of each shape (the CPU's reference path here), and prints one row per (H, rows)."""
    from bench import chains, v4
    from boundary import reference

    args = parse_args(["--hidden", "512", "--rows", "1", "3", "--parts", "v4"])
    args.no_compile = True
    timer = OnceTimer()
    rows = v4.bench_v4(args, timer, copy_bw=1e12)  # type: ignore[arg-type]
    assert [(r["H"], r["rows"]) for r in rows] == [(512, 1), (512, 3)]
    assert timer.calls == 2 * 6 * CALLS_PER_GRAPH  # ours, + MXFP8, + FP8 1x128, final, warm, eager, per shape
    assert all(r["ours_mxfp8_us"] > 0 and r["final_us"] > 0 and r["ours_warm_us"] > 0 for r in rows)
    assert rows[1]["floor_us"] == v4.v4_bytes(3, 512) / 1e12 * 1e6
    v4.print_v4(rows)
    assert "DeepSeek-V4 boundary" in capsys.readouterr().out
    # the chain is the reference's V4 boundary
    inp = v4._inputs(2, 512, CPU, 0)
    from boundary.toy import ToyConfig, ToyModel

    layer = ToyModel(ToyConfig(hidden_size=512, num_layers=1, vocab=16)).layers[0]
    got = v4._chain(chains.v4_chain, layer, inp)()
    params = reference.MHCParams(layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    want = reference.v4_boundary(
        inp["y"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        params,
        layer.attn_norm.weight,
        layer.attn_norm.variance_epsilon,
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_each_v4_call_of_a_graph_reads_weights_of_its_own() -> None:
    """The V4 part's calls read their own layer's weights and hc_head (cold after the L2 flush, as TileLang's chain is
    timed), drawn as the toy draws them: the shapes and dtypes of the model's, no two the same tensor."""
    from bench import v4
    from boundary.toy import ToyConfig, ToyModel

    model = ToyModel(ToyConfig(hidden_size=256, num_layers=1, vocab=16))
    layer = model.layers[0]
    pairs = v4.own_weights(layer, model, 3)
    assert len(pairs) == 3
    for own, head in pairs:
        for name in ("hc_attn_fn", "hc_attn_scale", "hc_attn_base"):
            got, want = getattr(own, name), getattr(layer, name)
            assert got.shape == want.shape and got.dtype == want.dtype and not torch.equal(got, want)
        assert own.attn_norm.weight.dtype == torch.bfloat16 and own.hc_ffn_fn is layer.hc_ffn_fn
        assert head.hc_head_fn.shape == model.hc_head_fn.shape and head.hc_head_scale.shape == (1,)
        assert head.final_norm.weight.shape == model.final_norm.weight.shape
    fns = [own.hc_attn_fn for own, _ in pairs] + [head.hc_head_fn for _, head in pairs]
    assert len({t.data_ptr() for t in fns}) == len(fns)
    assert not torch.equal(pairs[0][0].hc_attn_fn, pairs[1][0].hc_attn_fn)


def test_the_step_baselines_are_compiled_ahead_as_the_step_part_compiles_them(monkeypatch) -> None:
    """One job per compile the step part makes (TP 1 per shape; one chain per row count for every simulated W), run in
    a pool; a failure is reported and left to the step part; fewer than three compiles run nothing ahead."""
    from concurrent.futures import ThreadPoolExecutor

    from bench import precompile

    default = parse_args([])
    assert precompile.jobs(default) == [precompile.Job("tp1", 7168, 1, 1), precompile.Job("tp1", 7168, 16, 1)]
    full = parse_args(["--full"])
    assert len(precompile.jobs(full)) == 2 * 6 * 2  # H 5120 / 7168 x 6 rows, TP 1 and the shared chain
    assert precompile.Job("chain", 5120, 64, 2) in precompile.jobs(full)
    full.no_compile = True
    assert precompile.jobs(full) == []
    ran: list[tuple] = []

    def fake(job, layers, max_rows, device_index):
        ran.append((job, layers, max_rows, device_index))
        if job.rows == 16:
            raise RuntimeError("out of memory")
        return 1.0

    monkeypatch.setattr(precompile, "compile_one", fake)
    three = parse_args(["--step-compile-rows", "1", "16", "128"])
    failed = precompile.precompile(three, CPU, pool=ThreadPoolExecutor)
    assert sorted(r[0] for r in ran) == precompile.jobs(three) and {r[1:] for r in ran} == {(4, 128, 0)}
    assert failed == [precompile.Job("tp1", 7168, 16, 1)]
    ran.clear()
    assert precompile.precompile(default, CPU, pool=ThreadPoolExecutor) == [] and ran == []  # two: none ahead


@pytest.mark.parametrize("kind", ["tp1", "chain"])
def test_a_compile_ahead_builds_and_runs_the_step_parts_graph(monkeypatch, kind: str) -> None:
    """The worker builds the graphs the step part compiles (here with torch.compile as the identity, on the CPU): the
    TP 1 step's, or a simulated rank's shared chain and its own MoE finalize."""
    from bench import precompile
    from boundary import reference

    compiled: list[tuple[object, dict]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append((fn, kwargs)) or fn)
    assert precompile.compile_one(precompile.Job(kind, 256, 2, 2), 2, 4, 0) > 0
    assert all(kwargs == {"dynamic": False} for _, kwargs in compiled)
    assert len(compiled) == (1 if kind == "tp1" else 2)
    assert (reference.moe_finalize in [fn for fn, _ in compiled]) == (kind == "chain")


def test_the_v4_part_takes_tilelangs_chain_from_a_process_of_its_own(monkeypatch, tmp_path, capsys) -> None:
    """With --tilelang-path the v4 part runs bench.tilelang_step --boundary (its shapes, its replays, tile_kernels
    first on the path) and adds its column and ratio; a run that measures nothing fails loudly."""
    import json
    import subprocess

    from bench import v4

    (tmp_path / "tile_kernels").mkdir()
    args = parse_args(["--hidden", "512", "--rows", "1", "3", "--parts", "v4", "--tilelang-path", str(tmp_path)])
    args.no_compile = True
    seen: dict = {}

    def run(command, env, cwd, stdout, text):
        seen["command"], seen["path"] = command, env["PYTHONPATH"]
        out = Path(command[command.index("--out") + 1])
        out.write_text(
            json.dumps({"rows": [{"H": 512, "rows": 1, "tilelang_us": 5.0}, {"H": 512, "rows": 3, "error": "x"}]})
        )
        return subprocess.CompletedProcess(command, 0, "")

    monkeypatch.setattr(subprocess, "run", run)
    rows = v4.bench_v4(args, OnceTimer(), copy_bw=1e12)  # type: ignore[arg-type]
    assert seen["command"][2:4] == ["bench.tilelang_step", "--boundary"] and seen["path"].startswith(str(tmp_path))
    assert seen["command"][seen["command"].index("--step-rows") + 1 :][:2] == ["1", "3"]
    assert rows[0]["tilelang_us"] == 5.0 and rows[0]["x_tilelang"] == 5.0 / rows[0]["ours_us"]
    assert "tilelang_us" not in rows[1]  # that shape failed there: no column, no ratio
    v4.print_v4(rows)
    assert "TileLang" in capsys.readouterr().out
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 1, "boom"))
    with pytest.raises(RuntimeError, match="tilelang_step --boundary failed"):
        v4.bench_v4(args, OnceTimer(), copy_bw=1e12)  # type: ignore[arg-type]


def test_a_parity_case_without_its_inputs_draws_them_again_and_checks_their_bytes() -> None:
    """bench.tilelang_step.strip_inputs keeps a case's seed and digests; parity_inputs draws the same bytes again, and
    refuses inputs that differ."""
    from bench import tilelang_step

    inp = tilelang_step.boundary_inputs(2, 256, CPU, seed=tilelang_step.PARITY_SEED)
    case = {"H": 256, "rows": 2, "inputs": {k: inp[k] for k in tilelang_step.PARITY_KEYS}, "outputs": {}}
    light = tilelang_step.strip_inputs(case)
    assert "inputs" not in light and light["seed"] == tilelang_step.PARITY_SEED
    again = tilelang_step.parity_inputs(light, CPU)
    assert all(torch.equal(again[k], inp[k]) for k in tilelang_step.PARITY_KEYS)
    light["digests"]["fn"] = "0" * 40
    with pytest.raises(RuntimeError, match="differ from TileLang's"):
        tilelang_step.parity_inputs(light, CPU)


def test_the_v4_parity_counts_the_words_that_differ_and_both_errors_against_float64() -> None:
    """A parity case (TileLang's layout and outputs; here its outputs are ours, then one word changed): the words that
    differ, and each side's largest error against the float64 chain, small where both round as the contract does."""
    from bench import v4
    from boundary import reference
    from boundary.params import MHCParams

    rows, hidden = 3, 512
    g = torch.Generator().manual_seed(3)
    inp = dict(
        x=torch.randn(1, rows, hidden, generator=g).to(torch.bfloat16),
        residual=torch.randn(1, rows, 4, hidden, generator=g).to(torch.bfloat16),
        post=torch.rand(1, rows, 4, 1, generator=g) * 2,
        comb=torch.softmax(torch.randn(1, rows, 4, 4, generator=g), -1),
        fn=torch.randn(24, 4 * hidden, generator=g) * 1e-2,
        scale=torch.full((3,), 0.5),
        base=torch.randn(24, generator=g) * 0.5,
        norm_weight=(1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16),
    )
    eps = dict(rms_eps=1e-20, mhc_pre_eps=1e-6, mhc_sinkhorn_eps=1e-6, mhc_post_mult_value=2.0, sinkhorn_repeat=20)
    params = MHCParams(inp["fn"], inp["scale"], inp["base"], 1e-20, 1e-6, 1e-6, 2.0, 20)
    want = reference.v4_boundary(
        inp["x"][0], inp["residual"][0], inp["post"][0, :, :, 0], inp["comb"][0], params, inp["norm_weight"], 1e-20
    )
    theirs = dict(new_residual=want.residual[None].clone(), layer_input=want.layer_input.clone())
    theirs["layer_input"].view(-1)[7] += 1  # one word off
    got = v4.parity({"H": hidden, "rows": rows, "inputs": inp, "outputs": theirs, "eps": eps}, CPU)
    assert got["residual_words_differ"] == 0 and got["layer_input_words_differ"] == 1
    assert got["ours_residual_err"] == got["tilelang_residual_err"] < 2**-8  # one bf16 rounding of R'
    assert got["ours_layer_input_err"] < 2**-6 and got["parity_words"] == rows * hidden


def test_the_run_prints_and_records_each_stages_wall_time(capsys) -> None:
    """bench.run.PartClock: each stage's seconds and the running total land in results["elapsed_s"] and are printed
    when the stage ends (how long FULL's parts take is read from there)."""
    import time

    from bench.run import PartClock

    results: dict = {}
    clock = PartClock(results)
    time.sleep(0.05)
    clock.done("kernel warm-up")
    clock.done("boundary")
    elapsed = results["elapsed_s"]
    assert list(elapsed) == ["kernel warm-up", "total", "boundary"]
    assert elapsed["kernel warm-up"] >= 0.0 and elapsed["total"] >= elapsed["kernel warm-up"]
    out = capsys.readouterr().out
    assert "make bench: kernel warm-up took" in out and "make bench: boundary took" in out


def test_host_timing_interleaves_the_forms_round_by_round(monkeypatch) -> None:
    from bench.timing import host_us_interleaved

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    order: list[str] = []
    times = host_us_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, n=3, rounds=2)
    assert set(times) == {"a", "b"} and all(us > 0 for us in times.values())
    timed = order[40:]  # after 20 warm-up calls of each
    assert timed == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
