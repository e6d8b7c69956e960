"""The weight-read stand-ins of the decode step (bench.weight_reads): DeepSeek-V3's activated weight bytes per layer."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import step, weight_reads
from bench.run import parse_args
from boundary.toy import ToyConfig, ToyModel
from tests.test_bench_parts import OnceTimer

CPU = torch.device("cpu")


def test_a_layer_reads_the_attention_weights_and_the_experts_its_rows_pick() -> None:
    assert weight_reads.ATTENTION_PARAMS == 187_105_280  # MLA's five projections at DeepSeek-V3's sizes
    assert weight_reads.EXPERT_PARAMS == 3 * 7168 * 2048
    assert weight_reads.routed_experts_read(1) == pytest.approx(8)  # one token: its top 8
    assert weight_reads.routed_experts_read(16) == pytest.approx(256 * (1 - (31 / 32) ** 16))
    assert 255 < weight_reads.routed_experts_read(512) < 256  # nearly every expert
    attention, moe = weight_reads.layer_bytes(1)
    assert attention == weight_reads.ATTENTION_PARAMS and moe == 9 * weight_reads.EXPERT_PARAMS  # + the shared one


def test_the_stand_ins_read_then_return_the_boundaries_only_outputs(monkeypatch) -> None:
    monkeypatch.setattr(weight_reads, "ATTENTION_PARAMS", 4096)
    monkeypatch.setattr(weight_reads, "EXPERT_PARAMS", 1024)
    free = step.boundaries_only(ToyModel(ToyConfig(hidden_size=512, num_layers=2), device=CPU), 3)
    reads = weight_reads.WeightReads(CPU, max_rows=3)
    assert reads.words.numel() * 4 == max(weight_reads.layer_bytes(3))
    amax_sizes = []
    real_amax = torch.amax
    monkeypatch.setattr(torch, "amax", lambda t: (amax_sizes.append(t.numel()), real_amax(t))[1])
    joins: list[tuple[int, int]] = []
    model = reads.model(free, 3, before_last=lambda layer: joins.append((layer.index, len(amax_sizes))))
    x = torch.zeros(3, 512, dtype=torch.bfloat16)
    assert model.attention(free.layers[0], x) is free.attention(free.layers[0], x)
    assert model.moe(free.layers[1], x) is free.moe(free.layers[1], x)
    # each sublayer reads its bytes in two kernels, the last one o_proj's share (attention) or the down projections'
    # third (MoE), with before_last between them
    attention, moe = (n // 4 for n in weight_reads.layer_bytes(3))
    assert amax_sizes == [
        attention - round(attention * weight_reads.O_PROJ_SHARE),
        round(attention * weight_reads.O_PROJ_SHARE),
        moe - moe // 3,
        moe // 3,
    ]
    assert joins == [(0, 1), (1, 3)]
    assert 0.6 < weight_reads.O_PROJ_SHARE < 0.65  # o_proj is most of MLA's weights


def test_the_step_part_adds_the_weight_read_step_at_v3s_hidden_size(monkeypatch, capsys) -> None:
    monkeypatch.setattr(weight_reads, "HIDDEN", 512)
    monkeypatch.setattr(weight_reads, "ATTENTION_PARAMS", 4096)
    monkeypatch.setattr(weight_reads, "EXPERT_PARAMS", 1024)
    argv = ["--step-hidden", "512", "--step-rows", "2", "--step-layers", "2", "--step-tp", "1"]
    args: argparse.Namespace = parse_args(argv)
    args.no_compile = True
    timer = OnceTimer()
    (row,) = step.bench_step(args, timer)  # type: ignore[arg-type]
    # side streams, inline, eager chain, the model code alone (GLUE_CALLS in its graph), the toy sublayers, then the V3
    # reads with ours (side streams joined on the boundary and early, inline) and with output copies
    # (bench.critical_path), and the V4 step on them with V4Boundaries and with its output copies
    assert timer.calls == 10 + step.GLUE_CALLS
    boundaries_us = row["ours_us"] - row["glue_us"]  # the shares count the boundaries, not the step's model code
    assert row["v3_share"] == boundaries_us / row["v3_step_us"]
    assert row["boundary_share"] == boundaries_us / row["toy_step_us"]
    step.print_step([row])
    assert "V3 step" in capsys.readouterr().out


def test_h5120_reads_v3s_bytes_scaled_and_other_sizes_none(monkeypatch) -> None:
    """At V4.1-Flash's H the step reads V3's layer bytes times 5120/7168 (a stand-in of V3's shape); at V3's own H all
    of them; at other sizes there is no weight-read step."""
    assert weight_reads.read_scale(7168) == 1.0 and weight_reads.read_scale(5120) == 5120 / 7168
    assert weight_reads.read_scale(4096) is None
    monkeypatch.setattr(weight_reads, "layer_bytes", lambda rows: (4000, 8000))
    free = step.boundaries_only(ToyModel(ToyConfig(hidden_size=512, num_layers=2), device=CPU), 2)
    reads = weight_reads.WeightReads(CPU, max_rows=2)
    sizes: list[int] = []
    real_amax = torch.amax
    monkeypatch.setattr(torch, "amax", lambda t: (sizes.append(t.numel()), real_amax(t))[1])
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    reads.model(free, 2, scale=0.5).moe(free.layers[1], x)
    assert sum(sizes) == 4000 // 4  # half of the MoE's 8000 bytes, in words
    with pytest.raises(ValueError, match="scale"):
        reads.model(free, 2, scale=1.5)
