"""The multi-rank API on a GPU-less box: construction errors, the MoE index rule on the reference path,
the protocol switch and the slot layout (the peer kernels themselves: tests/test_allreduce_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from boundary import BoundaryAllReduce, MoEOutput, UnfinalizedMoEOutput
from boundary import reference as ref
from cute_kernels.allreduce import protocol
from cute_kernels.allreduce.tuning import ONESHOT_MAX_ROWS, oneshot_max_rows, protocol_for
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config

BF16 = torch.bfloat16


def test_construction_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="timeout_us must be a positive int"):
        BoundaryAllReduce(512, device="cpu", timeout_us=0)
    with pytest.raises(ValueError, match="timeout_us must be at most"):
        BoundaryAllReduce(512, device="cpu", timeout_us=2**31)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            BoundaryAllReduce.simulated(512, 2, device="cpu")
    with pytest.raises(ValueError, match="world_size >= 2"):
        BoundaryAllReduce.simulated(512, 1, device="cpu")
    one = BoundaryAllReduce(512, device="cpu")
    assert one.path == "reference" and one.world_size == 1
    with pytest.raises(ValueError, match="run_simulated takes the ranks of BoundaryAllReduce.simulated"):
        BoundaryAllReduce.run_simulated([one], [lambda ar: None])


def _moe_inputs(rows: int = 5, hidden: int = 256, experts: int = 9, top_k: int = 3):
    g = torch.Generator().manual_seed(0)
    gemm2 = torch.randn(experts, hidden, generator=g).to(BF16)
    weights = torch.rand(rows, top_k, generator=g)
    idx = torch.randint(-1, experts, (rows, top_k), generator=g, dtype=torch.int32)
    residual = torch.randn(rows, 4, hidden, generator=g).to(BF16)
    post = torch.rand(rows, 4, generator=g)
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g), -1)
    pre = torch.rand(rows, 4, generator=g)
    w = torch.ones(hidden, dtype=BF16)
    return gemm2, weights, idx, residual, post, comb, pre, w


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
        assert protocol_for(world, hidden, rows) == "oneshot"
        assert protocol_for(world, hidden, rows + 1) == "twoshot"
        assert protocol_for(world, hidden, 512) == "twoshot" or rows >= 512
    assert oneshot_max_rows(4, 6144) == oneshot_max_rows(4, 7168)  # the nearest measured H
    assert oneshot_max_rows(16, 7168) == 0  # an unmeasured world size takes two-shot
    assert protocol_for(16, 7168, 1) == "twoshot"


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


def test_every_cta_of_every_call_reads_the_call_index() -> None:
    """The per-CTA call counters (protocol.STATE_COUNTERS), played out for launches of changing size and warps
    interleaved in any order: every warp of call k reads k, whatever the grids of the calls before."""
    counters, warps = 64, 4
    words = [0] * counters
    rng = random.Random(0)
    for k in range(200):
        ctas = rng.choice([1, 5, 7, 28, 63, 64])
        steps = [(c, w) for c in range(ctas) for w in range(warps)]
        rng.shuffle(steps)  # warps of different CTAs, and of one CTA, in any order
        for c, w in steps:
            assert words[c] >> protocol.CALL_SHIFT == k, (k, c, w)  # the read
            words[c] += protocol.CALL_UNIT - (warps - 1) if w == 0 else 1  # the share, at once
            if w == 0:  # the rest of the CTA's work: a whole call into the counters no CTA of this launch reads
                for extra in range(c + ctas, counters, ctas):
                    words[extra] += protocol.CALL_UNIT
    assert all(w == 200 * protocol.CALL_UNIT for w in words)


def test_the_peer_state_holds_a_counter_for_every_cta() -> None:
    """The workspace's counters (COUNTERS_PER_SM per SM) cover the largest launch of every shipped shape on an H200
    and a B200; a state too small is refused before any launch."""
    for arch, sms in (("sm_90a", 132), ("sm_100a", 148)):
        for hidden in (2560, 4096, 5120, 7168):
            for world in (2, 4, 8):
                for ranks_per_device in (1, world):
                    state = torch.zeros(protocol.state_words(sms), dtype=torch.int32)
                    peer = api.PeerArgs(None, None, state, world, "oneshot", ranks_per_device)
                    api.check_counters(peer, hidden, arch)
    small = api.PeerArgs(None, None, torch.zeros(protocol.STATE_COUNTERS + 8, dtype=torch.int32), 2, "oneshot", 1)
    with pytest.raises(ValueError, match="call counters"):
        api.check_counters(small, 7168, "sm_90a")


def test_the_peer_trace_experiment_compiles() -> None:
    """bench/experiments/peer_trace.py builds the shipped peer kernel with stamps (run on a GPU, not here)."""
    from bench.experiments.peer_trace import traced_kernel

    for name in ("oneshot", "twoshot"):
        for staged in (False, True):
            fn, config = traced_kernel(4096, 2, name, staged, "sm_90a", base=1 << 40)
            assert callable(fn) and config == default_config(4096, "sm_90a", 2, 2)
