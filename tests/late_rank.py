"""What makes a simulated rank late (CONTRACT §7), shared by the lateness matrix and its fresh-process cells.

A trial issues every other rank's boundary first, each on its own stream (so they wait on the GPU), then makes
the late rank late and issues its boundary last. Its result: whether every rank's check() was clean and every
rank's bits held to the reference (the rank-order sum).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.allreduce import forced_protocol
from boundary import BoundaryAllReduce
from tests import test_allreduce_gpu as sim

HIDDEN = 4096
TIMEOUT_US = 2_000_000
LATENESS_MS = (0.1, 5.0, 50.0, 500.0)
# The kinds of lateness made on the late rank before its boundary: a host pause, a kernel ahead of it on its stream
# (a sleep kernel, real GEMMs), both together (half each).
KINDS = ("host", "sleep", "gemm", "both")
# A boundary of each protocol and schedule: (protocol forced, rows: None = the staged count, call mode, shared
# output on which ranks: "all", "none", "odd"). 3 rows: unstaged at every W (under the shared-GPU grid budget a W 8
# rank launches 3 clusters at H 4096, so 4 rows would take the staged kernel there).
MODES: dict[str, tuple[str | None, int | None, str, str]] = {
    "oneshot": ("oneshot", 3, "partial", "none"),
    "twoshot": ("twoshot", 3, "partial", "none"),
    "staged": (None, None, "partial", "none"),
    "moe": (None, 3, "moe", "none"),
    "moe+shared": (None, 3, "moe", "all"),
    "moe mixed shared": (None, 3, "moe", "odd"),
    "residual-only": (None, 3, "residual-only", "none"),
}


def variants() -> list:
    """The fused-boundary variants the MODES call (what their ranks warm up)."""
    from cute_kernels.boundary import api

    return [
        api.BoundaryVariant(),
        api.BoundaryVariant(pre=False),
        api.BoundaryVariant("moe"),
        api.BoundaryVariant("moe", shared=True),
    ]


@dataclass
class Delays:
    """The device-side delay makers, calibrated on this GPU once their kernels have loaded."""

    sleep_cycles_per_ms: float
    gemm_ms: float
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def calibrate(cls) -> Delays:
        """Time the sleep kernel and one 4096^3 bf16 GEMM (which also loads both kernels)."""
        a = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
        b = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        torch.matmul(a, b)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        sleep = 20_000_000 / start.elapsed_time(end)
        start.record()
        for _ in range(20):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        return cls(sleep, start.elapsed_time(end) / 20, a, b)

    def sleep(self, ms: float) -> None:
        """A sleep kernel of about `ms` on the current stream."""
        torch.cuda._sleep(max(1, int(ms * self.sleep_cycles_per_ms)))

    def gemms(self, ms: float) -> None:
        """About `ms` of back-to-back GEMMs on the current stream (at `gemm_ms` each: calibrate it where the GEMMs
        run, e.g. beside spinning peers, which take SMs from them)."""
        for _ in range(max(1, math.ceil(ms / self.gemm_ms))):
            torch.matmul(self.a, self.b)

    def make(self, kind: str, ms: float) -> None:
        """Make the current rank `ms` late in the way `kind` names."""
        if kind == "host":
            time.sleep(ms / 1000)
        elif kind == "sleep":
            self.sleep(ms)
        elif kind == "gemm":
            self.gemms(ms)
        elif kind == "both":
            self.sleep(ms / 2)
            time.sleep(ms / 2000)
        else:
            raise ValueError(f"unknown lateness kind {kind!r}")


def mode_inputs(world: int, mode: str, seed: int) -> tuple[list[sim.RankInputs], str, str | None]:
    """The inputs of one trial of `mode` (MODES), the call mode and the protocol it forces."""
    protocol, rows, call_mode, shared = MODES[mode]
    rows = sim.staged_rows(world, HIDDEN) if rows is None else sim.unstaged_rows(world, HIDDEN, rows, exact=True)
    inputs = sim.make_inputs(world, rows, HIDDEN, call_mode, seed=seed)
    if call_mode == "moe":
        for r, inp in enumerate(inputs):
            if shared == "none" or (shared == "odd" and r % 2 == 0):
                inp.shared = None
    return inputs, call_mode, protocol


@dataclass
class Outcome:
    """One trial: what went wrong ("" when every rank was clean and exact) and how late the late rank really was
    (ms from its peers' issue to its boundary's start on its stream: the host pause and the kernels ahead)."""

    error: str
    late_ms: float


def trial(ranks: list[BoundaryAllReduce], mode: str, late: int, make_late: Callable[[], None], seed: int) -> Outcome:
    """One boundary of `mode` with rank `late` made late by `make_late` (run on its stream, host and device)."""
    world = len(ranks)
    inputs, call_mode, protocol = mode_inputs(world, mode, seed)
    main = torch.cuda.current_stream()
    outputs: list[sim.RankOutputs | None] = [None] * world
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with forced_protocol(ranks, protocol):
        for ar in ranks:
            ar.stream.wait_stream(main)
        torch.cuda.synchronize()
        for r in [r for r in range(world) if r != late] + [late]:
            with torch.cuda.stream(ranks[r].stream):
                if r == late:
                    start.record()
                    make_late()
                    end.record()
                outputs[r] = sim.call(ranks[r], inputs[r], call_mode)
        for ar in ranks:
            main.wait_stream(ar.stream)
        torch.cuda.synchronize()
    return Outcome(_verdict(ranks, outputs, inputs, call_mode), start.elapsed_time(end))


def _verdict(ranks: list[BoundaryAllReduce], outputs: list, inputs: list[sim.RankInputs], call_mode: str) -> str:
    errors = []
    for ar in ranks:
        try:
            ar.check()
        except RuntimeError as exc:
            errors.append(str(exc).split(";")[0])
    if errors:
        for ar in ranks:
            ar.reset()
        return " | ".join(errors)
    try:
        sim.check(outputs, inputs, call_mode)
    except AssertionError as exc:
        return f"wrong bits: {exc}"
    return ""
