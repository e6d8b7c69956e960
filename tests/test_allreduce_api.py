"""The multi-rank API on a GPU-less box: construction errors, the MoE index rule on the reference path,
the protocol switch and the slot layout (the peer kernels themselves: tests/test_allreduce_gpu.py)."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from boundary import BoundaryAllReduce, MoEOutput, UnfinalizedMoEOutput, checks
from boundary import reference as ref
from boundary.all_reduce import multi_rank_path
from boundary.workspace import MULTICAST_ENV, unicast_only
from cute_kernels.allreduce import protocol
from cute_kernels.allreduce.tuning import (
    EVERY_CALL,
    ONESHOT_MAX_ROWS,
    oneshot_max_rows,
    protocol_for,
    protocols_up_to,
)
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config, row_split
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from tests.bf16 import exported
from tests.inputs import boundary_inputs
from tests.test_boundary_kernel_compile import job_args

BF16 = torch.bfloat16


def test_construction_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="timeout_us must be a positive int"):
        BoundaryAllReduce(512, device="cpu", timeout_us=0)
    with pytest.raises(ValueError, match="timeout_us must be at most"):
        BoundaryAllReduce(512, device="cpu", timeout_us=2**31)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="simulated ranks need a CUDA GPU"):
            BoundaryAllReduce.simulated(512, 2, device="cpu")
    for world in (1, 3, 16):
        with pytest.raises(ValueError, match=r"world_size must be one of \(2, 4, 8\), got"):
            BoundaryAllReduce.simulated(512, world, device="cpu")
    one = BoundaryAllReduce(512, device="cpu")
    assert one.path == "reference" and one.world_size == 1
    with pytest.raises(ValueError, match="run_simulated takes the ranks of BoundaryAllReduce.simulated"):
        BoundaryAllReduce.run_simulated([one], [lambda ar: None])


def test_the_peer_path_serves_the_measured_world_sizes_and_says_why_not() -> None:
    """A TP group of 2, 4 or 8 ranks whose peers map each other's memory takes the peer path; one that cannot, or
    of another size, takes NCCL + the kernel, with the reason (the fused path's fallback is a warning)."""
    assert multi_rank_path(4, lambda: (True, "")) == ("peer", "")
    path, why = multi_rank_path(2, lambda: (False, "the TP group spans 2 hosts"))
    assert path == "nccl+kernel" and why == "peers cannot map each other: the TP group spans 2 hosts"
    asked = []
    for world in (3, 6, 16):
        path, why = multi_rank_path(world, lambda w=world: asked.append(w) or (True, ""))
        assert path == "nccl+kernel" and why == f"the peer protocol is built for (2, 4, 8) ranks, not {world}"
    assert asked == [], "the collective peer check does not run where the world size rules the peer path out"


def test_the_nccl_fallback_is_logged_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    ar = BoundaryAllReduce(512, device="cpu")
    with caplog.at_level(logging.INFO, logger="boundary"):
        ar._log_path("")
        ar.path, ar.arch = "nccl+kernel", "sm_90a"
        ar._log_path("peers cannot map each other: no CUDA peer access to ['0000:1a:00.0']")
    (reference, fallback) = caplog.records
    assert reference.levelno == logging.INFO and "reference path" in reference.getMessage()
    assert fallback.levelno == logging.WARNING
    assert (
        "nccl+kernel path: an NCCL all-reduce, then the fused kernel (sm_90a): peers cannot map"
        in fallback.getMessage()
    )


def test_the_peer_workspace_keeps_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's symmetric memory must make no multicast object for the slots: the variable is set where unset, and a
    setting that would allow multicast is refused, naming it."""
    monkeypatch.delenv(MULTICAST_ENV, raising=False)
    unicast_only()
    assert os.environ[MULTICAST_ENV] == "1"
    unicast_only()  # already 1
    monkeypatch.setenv(MULTICAST_ENV, "0")
    with pytest.raises(ValueError, match=r"unicast only, but \$TORCH_SYMM_MEM_DISABLE_MULTICAST='0'"):
        unicast_only()


def _moe_inputs(rows: int = 5, hidden: int = 256, experts: int = 9, top_k: int = 3):
    """An unfinalised MoE partial (gemm2_permuted, expert weights, indices with some -1) and a boundary's inputs."""
    g = torch.Generator().manual_seed(0)
    gemm2 = torch.randn(experts, hidden, generator=g).to(BF16)
    weights = torch.rand(rows, top_k, generator=g)
    idx = torch.randint(-1, experts, (rows, top_k), generator=g, dtype=torch.int32)
    inp = boundary_inputs(rows, hidden)
    return gemm2, weights, idx, inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"]


def test_a_moe_index_outside_the_rows_is_no_expert_and_check_names_the_row() -> None:
    """CONTRACT §2: an index outside [-1, P) adds nothing and sets the error word; no IndexError mid-way."""
    gemm2, weights, idx, residual, post, comb, pre, w = _moe_inputs()
    ar = BoundaryAllReduce(256, device="cpu", max_rows=8)
    bad = idx.clone()
    bad[3, 1] = 9  # == P: one past the last row
    bad[1, 0] = -2
    new_bad, out_bad = ar.finalize(gemm2, weights, bad, None, residual, post, comb, pre, w, 1e-6, None)
    with pytest.raises(
        ValueError, match=r"rank 0: expanded_idx_to_permuted_idx held -?\d+ in row 3, outside \[-1, P\)"
    ):
        ar.check()
    ar.check()  # reported once, then cleared
    clean = bad.clone()
    clean[3, 1] = -1
    clean[1, 0] = -1
    new, out = ar.finalize(gemm2, weights, clean, None, residual, post, comb, pre, w, 1e-6, None)
    assert torch.equal(new.view(torch.int16), new_bad.view(torch.int16))
    assert torch.equal(out.view(torch.int16), out_bad.view(torch.int16))
    ar.check()
    # The reference function itself, without an error word, only masks.
    ref.moe_finalize(gemm2, weights, bad, None)
    # An empty gemm2_permuted: every index is out of range.
    empty = ref.moe_finalize(gemm2[:0], weights, bad, None, torch.zeros(4, dtype=torch.int32))
    assert not bool(empty.float().abs().sum())


def test_a_moe_output_without_experts_per_row_is_refused_naming_expert_weights() -> None:
    """top_k = 0 (expert_weights [T, 0]) passed the host checks and failed in the reference's argmax."""
    gemm2, weights, idx, residual, post, comb, pre, w = _moe_inputs()
    ar = BoundaryAllReduce(256, device="cpu", max_rows=8)
    with pytest.raises(ValueError, match=r"^expert_weights must have at least one column \(top_k >= 1\)"):
        ar.finalize(gemm2, weights[:, :0], idx[:, :0], None, residual, post, comb, pre, w, 1e-6, None)


def test_a_boundary_built_in_inference_mode_serves_calls_outside_it() -> None:
    """An engine may build its modules under torch.inference_mode() and run steps under no_grad, or the reverse: the
    kept buffers (the error word that check() clears) are plain tensors either way."""
    gemm2, weights, idx, residual, post, comb, pre, w = _moe_inputs()
    idx[2, 0] = 100
    with torch.inference_mode():
        ar = BoundaryAllReduce(256, device="cpu", max_rows=8)
        ar.finalize(gemm2, weights, idx, None, residual, post, comb, pre, w, 1e-6, None)
    with pytest.raises(ValueError, match="in row 2"):
        ar.check()
    with torch.no_grad():
        ar.finalize(gemm2, weights, idx, None, residual, post, comb, pre, w, 1e-6, None)
    with pytest.raises(ValueError, match="in row 2"):
        ar.check()
    ar.check()


def test_the_scheduler_path_reports_a_bad_index_too() -> None:
    from boundary import Boundaries, BoundaryState, DecodeStep

    gemm2, weights, idx, residual, post, comb, pre, w = _moe_inputs()
    idx[0, 0] = 100
    ar = BoundaryAllReduce(256, device="cpu", max_rows=8)
    state = BoundaryState(residual, post, comb, pre, MoEOutput(UnfinalizedMoEOutput(gemm2, weights, idx), None))
    Boundaries(ar).post_only(state)
    with pytest.raises(ValueError, match="in row 0"):
        ar.check()
    assert DecodeStep.for_rows(5).rows == 5


def test_the_protocol_switch_is_measured_data() -> None:
    for (world, hidden), rows in ONESHOT_MAX_ROWS.items():
        assert protocol_for(world, hidden, 1) == "oneshot"
        if rows == EVERY_CALL:
            assert world == 2, "only W 2, where both protocols move the same bytes, takes one-shot at every call"
            assert protocol_for(world, hidden, 1 << 20) == "oneshot"
        else:
            assert protocol_for(world, hidden, rows) == "oneshot"
            assert protocol_for(world, hidden, rows + 1) == "twoshot"
            assert protocol_for(world, hidden, 512) == "twoshot" or rows >= 512
    assert oneshot_max_rows(4, 6144) == oneshot_max_rows(4, 7168)  # the nearest measured H
    assert {w for w, _ in ONESHOT_MAX_ROWS} == set(protocol.PEER_WORLD_SIZES)  # every world size the peer path serves
    with pytest.raises(ValueError, match=r"world size 16 \(measured: \[2, 4, 8\]\)"):
        protocol_for(16, 7168, 1)  # the peer path never runs there (multi_rank_path): no guessed answer


def test_a_warmup_compiles_the_protocols_its_rows_can_take() -> None:
    assert protocols_up_to(2, 7168, 512) == ("oneshot",)
    limit = oneshot_max_rows(4, 7168)
    assert protocols_up_to(4, 7168, limit) == ("oneshot",)
    assert protocols_up_to(4, 7168, limit + 1) == ("oneshot", "twoshot")
    jobs = api.warmup_jobs(7168, arch="sm_90a", world_size=2, protocols=protocols_up_to(2, 7168, 512))
    assert jobs and {job_args(j)["protocol"] for j in jobs} == {"oneshot"}


def test_the_slot_layout() -> None:
    assert protocol.SENTINEL_WORD == 0x80000000 and protocol.SENTINEL_INT32 == -(2**31)
    bits = torch.tensor([protocol.SENTINEL_INT32], dtype=torch.int32).view(BF16)
    assert bits[0].item() == 0.0 and not torch.signbit(bits[0]) and torch.signbit(bits[1])  # +0.0 low, -0.0 high
    assert protocol.slot_elements(4, 512, 7168) == protocol.GENERATIONS * 5 * 512 * 7168


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("ctas_per_row", [4, 5, 7])
def test_two_shot_owners_cycle_through_the_ranks(world: int, ctas_per_row: int) -> None:
    """Every CTA's successive rows, and a row's successive chunks, have successive owners, whatever the launch's
    cluster count (an owner sums W partials: a CTA that owned every one of its rows would do all its rank's work)."""
    for clusters in (1, 2, 3, 4, 8, 9, 16, 33):
        rows = 4 * clusters
        for first in range(clusters):
            for cta in range(ctas_per_row):
                owners = [
                    protocol.segment_owner(r, cta, ctas_per_row, clusters, world) for r in range(first, rows, clusters)
                ]
                assert owners == [(owners[0] + i) % world for i in range(len(owners))]
        for row in range(rows):
            chunks = [protocol.segment_owner(row, c, ctas_per_row, clusters, world) for c in range(ctas_per_row)]
            assert chunks == [(chunks[0] + c) % world for c in range(ctas_per_row)]
        owned = [
            protocol.segment_owner(r, c, ctas_per_row, clusters, world)
            for r in range(rows)
            for c in range(ctas_per_row)
        ]
        counts = [owned.count(rank) for rank in range(world)]
        assert max(counts) - min(counts) <= rows // clusters  # balanced: within one per row of a cluster


def test_a_segments_columns_depend_on_h_alone() -> None:
    """A segment's columns (and so, with the call's clusters, its owner) are the same in every kernel that may
    run on one workspace: simulated or not."""
    for arch in ("sm_90a", "sm_100a"):
        for hidden in (2560, 4096, 4352, 5120, 7168):
            shapes = {(c.cluster_n, c.threads) for rpd in (1, 2) for c in [default_config(hidden, arch, rpd, 2)]}
            assert shapes == {row_split(hidden)}, (arch, hidden, shapes)


def test_the_premix_runs_where_its_shared_memory_costs_no_residency() -> None:
    """The peer kernels of a ready partial mix the streams before y is in, in shared memory (CONTRACT §2), at every
    world size and every H a model uses; not where one CTA per row holds so many vectors that its premix would not
    fit beside the CTAs the registers allow (H 14464: one CTA of 480 threads x 4 vectors, 240 KB), nor for a MoE
    partial or one rank."""
    hardware_bytes = 228 * 1024
    for arch in ("sm_90a", "sm_100a"):
        for hidden in (2560, 4096, 4352, 5120, 7168, 8192, 16384):
            for world in (2, 4, 8):
                config = default_config(hidden, arch, world, world)
                assert FusedBoundaryKernel(hidden, config, world_size=world).premix, (arch, hidden, world)
                assert not FusedBoundaryKernel(hidden, config, y_source="moe", world_size=world).premix
                premix = config.threads * config.vecs_per_thread(hidden) * 4 * 8 * 4
                assert config.min_ctas_per_sm * (premix + 2048) <= hardware_bytes
            assert not FusedBoundaryKernel(hidden, default_config(hidden, arch), world_size=1).premix
    config = default_config(14464, "sm_90a", 2, 2)
    assert (config.cluster_n, config.threads, config.vecs_per_thread(14464)) == (1, 480, 4)
    assert not config.premix_fits(14464) and not FusedBoundaryKernel(14464, config, world_size=2).premix


def test_the_call_counter_bounds_the_warps_per_launch() -> None:
    config = default_config(7168, "sm_90a", 1, 2)
    warps = config.max_clusters * config.cluster_n * config.threads // 32
    assert warps < protocol.CALL_UNIT  # the shipped launch fits the counter's shares
    wide = dataclasses.replace(config, max_clusters=protocol.CALL_UNIT)
    with pytest.raises(ValueError, match="peer call counter"):
        FusedBoundaryKernel(7168, wide, world_size=2)
    FusedBoundaryKernel(7168, wide, world_size=1)  # no peers, no counter


def test_the_peer_trace_experiment_compiles() -> None:
    """bench/experiments/peer_trace.py builds the shipped one-rank and peer kernels with stamps (run on a GPU, not
    here)."""
    from bench.experiments.peer_trace import traced_kernel

    fn, config = traced_kernel(4096, 1, "oneshot", False, "sm_90a", base=1 << 40, calls=1 << 41)
    assert exported(fn) and config == default_config(4096, "sm_90a", 1, 1)
    for name, staged in (("oneshot", False), ("twoshot", True)):  # each protocol, each exchange form
        fn, config = traced_kernel(4096, 2, name, staged, "sm_90a", base=1 << 40, calls=1 << 41)
        assert exported(fn) and config == default_config(4096, "sm_90a", 2, 2)
    import cutlass.cute as cute

    shipped_trigger = cute.arch.griddepcontrol_launch_dependents
    fn, _ = traced_kernel(4096, 4, "oneshot", False, "sm_90a", base=1 << 40, calls=1 << 41, trigger="end")
    assert exported(fn) and cute.arch.griddepcontrol_launch_dependents is shipped_trigger  # the patch is undone
    with pytest.raises(ValueError, match="trigger"):
        traced_kernel(4096, 2, "oneshot", False, "sm_90a", base=1 << 40, calls=1 << 41, trigger="start")
    for staged in (False, True):  # --warp-stamps
        fn, _ = traced_kernel(7168, 4, "oneshot", staged, "sm_90a", base=1 << 40, calls=1 << 41, warp_base=1 << 42)
        assert exported(fn)


def test_the_warp_steps_analysis_finds_planted_stalls() -> None:
    """bench/experiments/warp_steps.py on a synthetic --warp-stamps dump: the streams -> shuffles stalls planted in
    2 % of the warps are counted, and the other steps keep their planted lengths."""
    from bench.experiments.peer_trace import RING, WARP_EVENTS, WARPS
    from bench.experiments.warp_steps import STALL_US, stalled_warps, steps

    g = torch.Generator().manual_seed(0)
    world, ctas, events = 4, 7, len(WARP_EVENTS)
    base = torch.randint(1000, 2000, (world, RING, ctas, WARPS, 1), generator=g)
    cycles = base + torch.tensor([0, 600, 900, 1000, 1800]).view(1, 1, 1, 1, events)
    stall = torch.rand(world, RING, ctas, WARPS, generator=g) < 0.02
    stall[..., 4:] = False  # warps past the shipped CTA's four stamp nothing
    cycles[..., 2:] += (stall.long() * 2400).unsqueeze(-1)  # shuffles 1.2 us late (0.5 ns per cycle)
    stamps = torch.zeros(world, RING, ctas, WARPS, events, 2, dtype=torch.int64)
    stamps[..., 1], stamps[..., 0] = cycles, cycles // 2
    stamps[:, :, :, 4:] = 0
    per_step = steps(stamps, list(WARP_EVENTS))
    assert int((per_step["computed->shuffled"] > STALL_US).sum()) == int(stall.sum()) > 0
    assert torch.allclose(per_step["shuffled->sent"], torch.tensor(0.05, dtype=torch.float64))
    who = stalled_warps(stamps, list(WARP_EVENTS))
    assert who["stalled"] == [int(stall.sum())] and sum(who["order"]) == int(stall.sum())


def test_the_peer_trace_summary_reads_the_epilogue_tail() -> None:
    """peer_trace's summary: the row's end after its last CTA's last input (thread 0's, and every warp's: median and
    90th percentile per call) and the call period, from globaltimer stamps; synthetic stamps with one slow epilogue in
    five calls."""
    from bench.experiments.peer_trace import EVENTS, RING, summarize

    world, ctas = 2, 2
    stamps = torch.zeros(world, RING, ctas, len(EVENTS), 2, dtype=torch.int64)
    at = {name: i for i, name in enumerate(EVENTS)}
    for r in range(world):
        for k in range(RING):
            start = 3000 * k + 100 * r  # a call every 3 us; rank 1 released 0.1 us after rank 0
            tail = 1500 if k % 5 == 3 else 800  # one call in five has a slow epilogue
            for c in range(ctas):
                arrived = start + 1000 + 200 * c  # the cluster's last CTA is in 0.2 us after its first
                times = {
                    "released": start,
                    "gen": start + 100,
                    "loaded": start + 200,
                    "pushed": start + 300,
                    "arrived": arrived,
                    "rearmed": arrived + 50,
                    "computed": arrived + 300,
                    "summed": start + 1200 + tail - 100,
                    "row done": start + 1200 + tail,
                    "all arrived": arrived + 250,  # another warp of the CTA is in 0.25 us later
                    "all computed": arrived + 350,
                    "all sent": arrived + 400,
                }
                for name, ns in times.items():
                    stamps[r, k, c, at[name], 0] = ns
                    stamps[r, k, c, at[name], 1] = ns  # one cycle per ns
    steps = summarize(stamps, ctas, "oneshot")
    assert steps["call period"] == pytest.approx(3.0)
    assert steps["rank spread"] == pytest.approx(0.1)
    assert steps["last in->done"] == pytest.approx(0.8)  # after the last CTA's arrival, not the first's
    assert steps["p90 last in->done"] == pytest.approx(1.5)
    assert steps["max period"] == pytest.approx(3.0)  # a slow epilogue here delays no release
    assert steps["summed->row done"] == pytest.approx(0.1)
    assert steps["warp skew at arrival"] == pytest.approx(0.25)
    assert steps["all in->done"] == pytest.approx(0.8 - 0.25)  # after the last warp of the last CTA
    assert steps["p90 all in->done"] == pytest.approx(1.5 - 0.25)
    # The cluster's sum after the last CTA's thread 0 stored, and after its last warp stored and sent its sum.
    assert steps["computed->summed (cluster)"] == pytest.approx(0.8 - 0.4)
    assert steps["p90 computed->summed (cluster)"] == pytest.approx(1.5 - 0.4)
    assert steps["all sent->summed (cluster)"] == pytest.approx(0.8 - 0.5)
    # A shared ring cell whose clock half kept an earlier call's value (its SM's clock64 was ahead) disagrees with
    # its globaltimer half: it is left out of the skew, not read as a skew of a whole call.
    stamps[:, :8, :, at["all arrived"], 1] = 10**9
    steps = summarize(stamps, ctas, "oneshot")
    assert steps["warp skew at arrival"] == pytest.approx(0.25)
    assert steps["p90 warp skew at arrival"] == pytest.approx(0.25)


@pytest.mark.parametrize("simulated", [True, False])
def test_the_multi_rank_plot_draws_every_series(tmp_path, monkeypatch: pytest.MonkeyPatch, simulated: bool) -> None:
    """bench.allreduce's PNG: one panel per (W, H), one line per series (simulated: the fused protocols, the one-rank
    kernels, the gather path; NVLink: the fused protocols against NCCL and symmetric-memory all-reduce + kernel)."""
    import matplotlib.pyplot as plt

    from bench import allreduce

    series = allreduce.SIMULATED_SERIES if simulated else [(key, label) for key, _, label in allreduce.MULTI_GPU_SERIES]
    rows = [
        {"W": world, "H": 4096, "rows": n, **{key: float(i + n) for i, (key, _) in enumerate(series)}}
        for world in (2, 4)
        for n in (1, 16, 512)
    ]
    drawn = []
    real_savefig = plt.Figure.savefig

    def savefig(fig, path, **kwargs):
        drawn.extend((ax.get_title(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes)
        return real_savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    allreduce.plot_allreduce(rows, tmp_path / "plot.png", simulated=simulated)
    kind = "simulated" if simulated else "NVLink"
    assert [title for title, _ in drawn] == [f"{kind} W=2, H=4096", f"{kind} W=4, H=4096"]
    assert all(labels == [label for _, label in series] for _, labels in drawn)
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_the_hardware_queue_count_is_read_as_cuda_reads_it(monkeypatch) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS: the driver's 8 where unset, the value where set, an error naming it otherwise
    (simulated() warns below 32: CONTRACT §7)."""
    from cute_kernels.hardware import DEFAULT_DEVICE_CONNECTIONS, device_connections

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert device_connections() == DEFAULT_DEVICE_CONNECTIONS == 8
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert device_connections() == 32
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "many")
    with pytest.raises(ValueError, match="^CUDA_DEVICE_MAX_CONNECTIONS must be an int >= 1, got 'many'"):
        device_connections()


def test_the_kernel_path_decides_each_calls_variant_once_and_passes_it_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """BoundaryAllReduce._kernel (the one-rank kernel path, driven here on the CPU with the compile and the launch
    stubbed) turns each call form into its BoundaryVariant once, compiles its kernel once, and hands fused_boundary
    that variant and kernel on every call."""
    from boundary.types import empty_fp8_group, empty_quantized

    H, rows = 256, 2
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    compiled, launched = [], []
    monkeypatch.setattr(api, "compiled_boundary", lambda h, v, **k: compiled.append(v) or ("kernel", v))
    monkeypatch.setattr(api, "fused_boundary", lambda v, **k: launched.append((v, k["compiled"])))
    inp = boundary_inputs(rows, H)
    epilogue = (inp["residual"], inp["post"], inp["comb"])
    mx, fp8 = empty_quantized(rows, H, torch.device("cpu")), empty_fp8_group(rows, H, torch.device("cpu"), True)
    forms = [
        (dict(pre=None, norm_weight=None), dict(x=inp["x"]), api.BoundaryVariant("x", pre=False)),
        (dict(mxfp8_out=mx), dict(x=inp["x"], shared=inp["x"]), api.BoundaryVariant("x", True, mxfp8=True)),
        (dict(fp8_out=fp8), dict(moe=(None, None, None)), api.BoundaryVariant("moe", fp8="fp8_1x128_ue8m0")),
    ]
    for _ in range(3):
        for given, source, _ in forms:
            args = dict(pre=inp["pre"], norm_weight=inp["norm_weight"], mxfp8_out=None, fp8_out=None) | given
            ar._kernel(
                *epilogue,
                args["pre"],
                args["norm_weight"],
                1e-6,
                args["mxfp8_out"],
                None,
                args["fp8_out"],
                **source,
            )
    want = [variant for _, _, variant in forms]
    assert compiled == want  # once per form
    assert launched == [(v, ("kernel", v)) for v in want] * 3


def test_the_hosts_fast_path_declines_every_fault_the_kernels_entry_cannot_see() -> None:
    """BoundaryAllReduce's fast-path test (`_fits`) is True for a well-formed call. Every fault the full checks refuse
    is either declined by it (then the full checks run and name it) or one of a tensor's type, dtype, shape, strides,
    address or device, which the compiled kernel's TVM-FFI entry refuses before it launches (the GPU test
    `test_a_malformed_call_on_the_kernel_path_names_its_argument` holds that, and that the full checks then name the
    argument)."""
    from boundary.types import empty_quantized

    H, rows = 256, 3
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    ar.arch = "sm_90a"  # the kernel path's alignment rules (the fast path's own test runs on any device)
    inp = boundary_inputs(rows, H)
    good = dict(
        x=inp["x"],
        residual=inp["residual"],
        post=inp["post"],
        comb=inp["comb"],
        pre=inp["pre"],
        norm_weight=inp["norm_weight"],
        norm_eps=1e-6,
        mxfp8_out=empty_quantized(rows, H, torch.device("cpu")),
    )

    def fits(**changes: object) -> bool:
        args = good | changes
        return ar._fits(*(args[n] for n in ("residual", "post", "pre", "norm_weight", "norm_eps", "mxfp8_out")))

    def full_checks_pass(**changes: object) -> bool:
        args = good | changes
        try:
            r = ar._check_residual(args["residual"]).shape[0]
            checks.tensor("x", args["x"], dtype=torch.bfloat16, shape=(r, H), device=ar.device, align=16)
            epilogue = (args[n] for n in ("post", "comb", "pre", "norm_weight", "norm_eps", "mxfp8_out"))
            ar._check_epilogue(r, *epilogue, None, None)
        except (TypeError, ValueError):
            return False
        return True

    assert fits() and full_checks_pass()
    assert fits(mxfp8_out=None) and fits(pre=None, norm_weight=None, mxfp8_out=None)
    mx = good["mxfp8_out"]
    declined = [
        dict(residual=[1, 2]),
        dict(residual=inp["residual"][0]),
        dict(residual=torch.zeros(5, 4, H, dtype=torch.bfloat16)),  # over max_rows
        dict(residual=torch.zeros(0, 4, H, dtype=torch.bfloat16), x=torch.zeros(0, H, dtype=torch.bfloat16)),
        dict(pre=None),  # a residual-only call that still passes a norm weight and MXFP8
        dict(pre=None, mxfp8_out=None),
        dict(norm_weight=None),
        dict(post=inp["post"].t().contiguous().unsqueeze(-1)),  # [4, T, 1]: a view of [T, 4] would take it
        dict(post=inp["post"].reshape(-1)),
        dict(post=[1, 2]),
        dict(norm_eps=float("nan")),
        dict(norm_eps=-1.0),
        dict(norm_eps=float("inf")),
        dict(mxfp8_out=dataclasses.replace(mx, scale=mx.scale[:-4])),
        dict(mxfp8_out=(mx.data, mx.scale)),
    ]
    misaligned = torch.zeros(rows * H + 1, dtype=torch.bfloat16)[1:].view(rows, H)
    at_the_entry = [  # a tensor's type, dtype, shape, strides, address or device
        dict(x=inp["x"].float()),
        dict(x=inp["x"][:, :128]),
        dict(x=inp["x"].to("meta")),
        dict(x=torch.zeros(H, rows, dtype=torch.bfloat16).t()),
        dict(x=misaligned),
        dict(x=[1, 2]),
        dict(residual=inp["residual"][:, :3]),
        dict(post=inp["post"].double()),
        dict(comb=inp["comb"][:, :, :3]),
        dict(pre=inp["pre"][:2]),
        dict(norm_weight=inp["norm_weight"].float()),
    ]
    for fault in declined + at_the_entry:
        assert not full_checks_pass(**fault), fault
    for fault in declined:
        assert not fits(**fault), fault
    for fault in at_the_entry:
        assert fits(**fault), fault
        # The error the caller then sees is the full checks', which names the argument first.
        (name,) = fault
        with pytest.raises((TypeError, ValueError), match=rf"^{name} "):
            args = good | fault
            r = ar._check_residual(args["residual"]).shape[0]
            checks.tensor("x", args["x"], dtype=torch.bfloat16, shape=(r, H), device=ar.device, align=16)
            ar._check_epilogue(
                r, *(args[n] for n in ("post", "comb", "pre", "norm_weight", "norm_eps")), None, None, None
            )
    # Where the fast path declines a call the full checks accept (another eps type, a 3-D post), the call still runs.
    assert full_checks_pass(norm_eps=0) and not fits(norm_eps=0)
    assert full_checks_pass(post=inp["post"].unsqueeze(-1)) and not fits(post=inp["post"].unsqueeze(-1))
    # The streams on another device than the boundary's: declined (here the boundary stands on cuda:0).
    ar._device_index = 0
    assert not fits()


def test_a_call_the_kernels_entry_refuses_goes_through_the_full_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fast path a refusal at the kernel's entry is never the error the caller sees: the full checks run and
    raise the one that names the argument, and where they pass (the launch failed for another reason) the checked
    call runs it again, whose error is the caller's. (The kernel path stood in on the CPU by a launch that refuses its
    first call.)"""
    from boundary.all_reduce import BoundaryPath

    H, rows = 256, 3
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    monkeypatch.setattr(ar, "path", BoundaryPath.KERNEL)
    inp = boundary_inputs(rows, H)
    launches: list[tuple] = []

    def launch(residual, post, comb, *rest, **kwargs):
        launches.append(tuple(x.shape for x in (residual, post, comb)))
        if len(launches) == 1:
            raise RuntimeError("the entry refused an argument")
        return residual, None

    monkeypatch.setattr(ar, "_kernel", launch)
    args = [inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6]
    shapes = ((rows, 4, H), (rows, 4), (rows, 4, 4))
    ar(*args, None)
    assert launches == [shapes, shapes]  # the fast path's refused launch, then the checked call's
    launches.clear()
    args[0] = inp["x"].float()
    with pytest.raises(TypeError, match="^x must have dtype torch.bfloat16"):
        ar(*args, None)
    assert launches == [shapes]  # refused at the entry; the full checks named x, nothing launched again


def test_a_plain_call_form_launches_through_its_kept_launch_after_its_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host's ready path: a plain call form's first call at a row count goes through _kernel and fused_boundary,
    which keep its launch; its later calls launch the same kernel with the same argument tuple straight from there,
    each row count and form (residual-only, bf16, MXFP8) its own; the forms with more (an FP8 1x128 output) keep none;
    a kept launch the kernel's entry refuses still ends in the full checks' error; setting the protocol drops them.
    (The kernel path stood in on the CPU by a launch that records its arguments.)"""
    from boundary.all_reduce import BoundaryPath
    from boundary.types import empty_fp8_group, empty_quantized

    H = 256
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    monkeypatch.setattr(ar, "path", BoundaryPath.KERNEL)
    ar.arch = "sm_90a"
    calls: list[tuple] = []
    refuse = []

    def kernel(*args: object) -> None:
        calls.append(args)
        if refuse:
            refuse.pop()
            raise RuntimeError("the entry refused an argument")

    monkeypatch.setattr(api, "compiled_boundary", lambda h, v, **k: kernel)
    cpu = torch.device("cpu")

    def call(rows: int, form: str, x: torch.Tensor | None = None, eps: float = 1e-6, mx_rows: int = 0) -> tuple:
        inp = boundary_inputs(rows, H)
        pre, w = (None, None) if form == "residual-only" else (inp["pre"], inp["norm_weight"])
        mx = empty_quantized(mx_rows or rows, H, cpu) if form == "mxfp8" else None
        if mx_rows:  # the data of `rows` rows, the scales of `mx_rows`
            mx = dataclasses.replace(mx, data=torch.empty(rows, H, dtype=torch.float8_e4m3fn))
        fp8 = empty_fp8_group(rows, H, cpu, False) if form == "fp8" else None
        args = (inp["x"] if x is None else x, inp["residual"], inp["post"], inp["comb"], pre, w, eps, mx)
        return ar(*args, fp8_out=fp8), args, mx, fp8

    def kept() -> set:
        return set(ar._ready)

    for rows, form in [(2, "bf16"), (3, "bf16"), (2, "mxfp8"), (2, "residual-only")]:
        (first, args, mx, _), (second, again, mx2, _) = call(rows, form), call(rows, form)
        assert len(calls) == 2
        one, two = calls

        # Argument for argument the second call's own where the first passed its own: the ready launch builds the
        # tuple fused_boundary builds.
        def own(given: tuple, out: tuple, mx: object) -> list:
            return [*given[:6], *out, *((mx.data, mx.scale) if mx is not None else ())]

        same = {id(a): b for a, b in zip(own(args, first, mx), own(again, second, mx2)) if a is not None}
        assert len(one) == len(two) == len(api.BoundaryArgs._fields)
        for field, a, b in zip(api.BoundaryArgs._fields, one, two):
            assert b is same.get(id(a)) if a is not None and field != "eps" else b == a, field
        assert second[0].shape == again[1].shape and (second[1] is None) == (form == "residual-only")
        calls.clear()
    assert kept() == {(2, False, True), (3, False, True), (2, False, False), (2, True, True)}
    call(2, "fp8"), call(2, "fp8")
    assert kept() == {(2, False, True), (3, False, True), (2, False, False), (2, True, True)}  # FP8 1x128: none
    calls.clear()
    # A kept launch refused at the entry: the full checks name x, and nothing launches again.
    refuse.append(True)
    with pytest.raises(TypeError, match="^x must have dtype torch.bfloat16"):
        call(2, "bf16", x=torch.zeros(2, H))
    assert len(calls) == 1
    calls.clear()
    # What the entry cannot see is tested before a kept launch too: the eps, the MXFP8 scales' size.
    with pytest.raises(ValueError, match="^norm_eps must be"):
        call(2, "bf16", eps=float("nan"))
    with pytest.raises(ValueError, match="^mxfp8_out.scale "):
        call(2, "mxfp8", mx_rows=200)
    assert calls == []
    ar.protocol = None
    assert kept() == set()


def test_every_call_form_the_kernel_path_builds_is_a_warmup_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variants BoundaryAllReduce's kernel path builds from its call forms (a ready or MoE partial, an addend or
    not, residual-only or with a layer input in bf16 / MXFP8 / FP8 1x128 / its UE8M0 form, aux or not) are exactly
    the engine variants warmup() compiles: the call path and the warmup list cannot drift apart."""
    from boundary.types import empty_fp8_group, empty_quantized

    H, rows, cpu = 256, 2, torch.device("cpu")
    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    built = []
    monkeypatch.setattr(api, "compiled_boundary", lambda h, v, **k: built.append(v) or (lambda *a: None))
    monkeypatch.setattr(api, "fused_boundary", lambda v, **k: None)
    inp = boundary_inputs(rows, H)
    layer_inputs = [
        (None, None, None),  # residual-only
        (inp["pre"], None, None),
        (inp["pre"], empty_quantized(rows, H, cpu), None),
        (inp["pre"], None, empty_fp8_group(rows, H, cpu, False)),
        (inp["pre"], None, empty_fp8_group(rows, H, cpu, True)),
    ]
    for source in (dict(x=inp["x"]), dict(moe=(None, None, None))):
        for shared in (None, inp["x"]):
            for pre, mx, fp8 in layer_inputs:
                for aux in (None, torch.empty(rows, H, dtype=torch.bfloat16)):
                    w = None if pre is None else inp["norm_weight"]
                    ar._kernel(
                        inp["residual"], inp["post"], inp["comb"], pre, w, 1e-6, mx, aux, fp8, shared=shared, **source
                    )
    assert len(built) == len(set(built)) == len(api.ENGINE_VARIANTS)
    assert set(built) == set(api.ENGINE_VARIANTS)


@pytest.mark.parametrize("scheme", ["v4.1", "v4"])
@pytest.mark.parametrize("custom_ops", [False, True])
def test_a_boundary_object_goes_with_its_last_reference_and_takes_its_all_reduce_along(
    scheme: str, custom_ops: bool
) -> None:
    """No reference cycle keeps a scheduler or its BoundaryAllReduce (and so its process group) alive until a garbage
    collection: an engine's destroy_process_group after dropping them must find them gone (a V4Boundaries whose
    closures held itself kept gloo's group to interpreter exit, which then aborted about 1 run in 20)."""
    import gc
    import weakref

    from boundary import Boundaries, V4Boundaries

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ar = BoundaryAllReduce(512, max_rows=4, device="cpu")
        boundaries = (V4Boundaries if scheme == "v4" else Boundaries)(ar, custom_ops=custom_ops)
        refs = weakref.ref(boundaries), weakref.ref(ar)
        del boundaries, ar
        assert all(ref() is None for ref in refs), [ref() for ref in refs]
    finally:
        if was_enabled:
            gc.enable()


def test_a_simulated_rank_keeps_its_peers_slots_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each simulated rank's peer table holds the others' slot addresses: a rank kept alone (the others dropped) must
    keep their buffers, or its pushes would land in memory the allocator hands out again. (The CPU stands in for the
    GPU's allocation here; the device sync is a no-op.)"""
    import gc

    from boundary.workspace import Workspace

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    spaces = Workspace.simulated(256, 2, 4, torch.device("cpu"), 1000)
    del spaces[1]
    gc.collect()
    kept = {t.data_ptr() for t in getattr(spaces[0], "_handle", ())}
    assert all(int(p) in kept for p in spaces[0].peers), "a peer's slots are not held by this rank's workspace"


def test_check_waits_for_every_stream_of_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step run on an engine's own stream is not waited for by the stream check() is called on: check() syncs
    the device before it reads the error word (a stand-in records the sync; the word itself is on the CPU here)."""
    ar = BoundaryAllReduce(256, device="cpu", max_rows=8)
    events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    monkeypatch.setattr(ar, "device", torch.device("cuda", 0))
    error = ar.workspace.error
    monkeypatch.setattr(
        ar.workspace, "error", type("Word", (), {"tolist": lambda _: events.append("read") or error.tolist()})()
    )
    ar.check()
    assert events == [("sync", torch.device("cuda", 0)), "read"]


def test_a_grown_coefficients_workspace_keeps_the_one_it_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph captured before a call with more rows grows the shared workspace still holds the smaller one's
    addresses: it must stay allocated (it was freed, and the replays wrote into memory other tensors held)."""
    import gc
    import weakref

    from boundary import mhc

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    small = mhc.prepare_workspace(1024, 64, torch.device("cpu"), owner=-7)
    old = weakref.ref(small)
    del small
    grown = mhc.prepare_workspace(1024, 600, torch.device("cpu"), owner=-7)
    gc.collect()
    assert grown.max_rows >= 600 and old() is not None and old() is not grown
