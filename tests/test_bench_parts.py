"""The benchmark's host-cost and decode-step parts run every call they time (on the CPU's reference path here, with
a timer that calls each closure once), and their tables print: a part that breaks shows up before a GPU run."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from bench import host, step
from bench.kernels import boundary_inputs, parse_args

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


def test_the_host_part_times_every_calling_form() -> None:
    torch._dynamo.reset()
    row = host.host_row(512, 2, boundary_inputs(2, 512, CPU, seed=0), once)
    assert row["op_compiled_loop_us"] == 1.0 / host.LOOP
    assert row["direct_step_ms"] == 2 * host.LAYERS / 1000
    host.print_host([row])


def test_the_step_part_times_ours_and_the_baselines(capsys) -> None:
    args: argparse.Namespace = parse_args(["--step-hidden", "512", "--step-rows", "1", "3", "--step-layers", "2"])
    args.no_compile = True
    timer = OnceTimer()
    rows = step.bench_step(args, timer)  # type: ignore[arg-type]
    assert [(r["H"], r["rows"]) for r in rows] == [(512, 1), (512, 3)]
    assert timer.calls == 2 * 4  # side streams, inline, eager chain, the toy sublayers
    assert all(r["boundaries"] == 2 * 2 + 1 + 1 for r in rows)  # 2 layers, the Engram seam on layer 1, the final
    step.print_step(rows)
    assert "decode step, TP 1" in capsys.readouterr().out


def test_the_compiled_step_baseline_traces_the_reference_chain() -> None:
    from boundary import Boundaries, BoundaryAllReduce
    from boundary.toy import ToyConfig, ToyModel, compare

    model = ToyModel(ToyConfig(hidden_size=512, num_layers=2, vocab=64))
    ref = Boundaries(BoundaryAllReduce(512, max_rows=4, device="cpu", backend="reference"))
    free = step.boundaries_only(model, 2)
    compiled = step._compiled_call(free, ref, 2)
    eager = step._step_call(free, ref, 2, False)
    # Inductor fuses the chain's fp32 math and rounds its own way: a baseline, held to the eager chain's result
    # within a few bf16 ulps of the largest output (measured 0.5 %), not bit for bit.
    assert compare(compiled(), eager())["max_rel"] < 0.02
