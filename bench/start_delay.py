"""A boundary's start delay after its predecessor in a CUDA graph (#46), with the side-stream join on the boundary, on
the kernel before it, or absent: %globaltimer stamps of one-warp kernels standing in for a sublayer's last two kernels
and the boundary.

Each repeat of the graph: the side stream forks from the main stream and runs a short kernel (the coefficients);
the main stream runs the sublayer (SPIN_NS["sublayer"]), its last kernel (SPIN_NS["last"]) and the boundary, launched
as the boundary kernel is (PDL, waiting first) or plainly. The join (the main stream waits for the side stream) sits
right before the boundary, right before the last kernel, or nowhere. Every kernel stamps when it starts (after its PDL
wait) and when it ends; a delay is a kernel's start less its predecessor's end: mean and 90th percentile over REPEATS
repeats of REPLAYS replays (the timer ticks in 0.256 us steps on an H200; the mean over repeats whose phases against
the tick differ resolves below a tick, a median would not).
"""

from __future__ import annotations

import statistics
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int64, const_expr

from cute_kernels import ptx
from cute_kernels.compile import compile_kernel, fake_stream, fake_tensor

SPIN_NS = {"sublayer": 20_000, "last": 5_000, "side": 3_000, "boundary": 0}
KERNELS = ("sublayer", "last", "boundary", "side")  # the stamps' order
JOINS = ("none", "boundary", "early")
REPEATS, REPLAYS = 32, 5


class StampKernel:
    """One warp: stamps %globaltimer, spins `spin_ns`, stamps again, into out[0:2]; with `pdl`, launched as a
    programmatic dependent that waits for its predecessor first (as the boundary kernel does)."""

    def __init__(self, pdl: bool) -> None:
        self.pdl = pdl

    @cute.jit
    def __call__(self, mOut: cute.Tensor, spin_ns: Int64, stream: Any) -> None:
        self.kernel(mOut, spin_ns).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, spin_ns: Int64) -> None:
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            start = ptx.globaltimer()
            until = start + spin_ns
            while ptx.globaltimer() < until:
                pass
            mOut[0] = start
            mOut[1] = ptx.globaltimer()


def compile_stamps(arch: str) -> dict[bool, Any]:
    """The stamp kernel, plain and PDL-launched, compiled for `arch`."""
    out = fake_tensor(cutlass.Int64, (2,), divisibility=2)
    return {pdl: compile_kernel(StampKernel(pdl), out, Int64(0), fake_stream(), arch=arch) for pdl in (False, True)}


def _graph(stamps: dict[bool, Any], out: torch.Tensor, join: str, pdl: bool, side: torch.cuda.Stream) -> Any:
    """The graph of REPEATS repeats with the join at `join`; out[repeat, kernel] holds each kernel's stamps."""
    main = torch.cuda.current_stream()

    def launch(repeat: int, kernel: str, is_pdl: bool = False) -> None:
        stamps[is_pdl](out[repeat, KERNELS.index(kernel)], SPIN_NS[kernel])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        for repeat in range(REPEATS):
            if join != "none":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    launch(repeat, "side")
            launch(repeat, "sublayer")
            if join == "early":
                torch.cuda.current_stream().wait_stream(side)
            launch(repeat, "last")
            if join == "boundary":
                torch.cuda.current_stream().wait_stream(side)
            launch(repeat, "boundary", pdl)
    return graph


def summary(values: list[float]) -> tuple[float, float]:
    """(mean, 90th percentile)."""
    return statistics.fmean(values), statistics.quantiles(values, n=10)[-1]


def measure(device: torch.device, arch: str) -> list[dict[str, Any]]:
    """One row per join placement and boundary launch: the last kernel's and the boundary's start delays in ns."""
    stamps = compile_stamps(arch)
    side = torch.cuda.Stream(device)
    rows = []
    with torch.cuda.device(device):
        capture = torch.cuda.Stream(device)
        for pdl in (True, False):
            for join in JOINS:
                out = torch.zeros(REPEATS, len(KERNELS), 2, dtype=torch.int64, device=device)
                capture.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(capture):
                    graph = _graph(stamps, out, join, pdl, side)
                last, boundary = [], []
                for _ in range(REPLAYS + 1):
                    graph.replay()
                    torch.cuda.synchronize(device)
                    t = out.cpu().double()
                    last += (t[:, 1, 0] - t[:, 0, 1]).tolist()  # the last kernel's start after the sublayer's end
                    boundary += (t[:, 2, 0] - t[:, 1, 1]).tolist()  # the boundary's after the last kernel's
                del graph
                skip = REPEATS  # the first replay settles
                rows.append(
                    {
                        "join": join,
                        "pdl": pdl,
                        "last_ns": summary(last[skip:]),
                        "boundary_ns": summary(boundary[skip:]),
                    }
                )
    return rows


def print_start_delays(rows: list[dict[str, Any]]) -> None:
    """The start-delay table."""
    print(
        f"\nstart delay after the predecessor in a CUDA graph (%globaltimer stamps, ns: mean / p90 of "
        f"{REPEATS} x {REPLAYS})"
    )
    head = f"{'join':>8} {'boundary launch':>15} | {'last kernel':>13} | {'boundary':>13}"
    print(head)
    print("-" * len(head))
    for r in rows:
        launch = "PDL" if r["pdl"] else "plain"
        last, boundary = r["last_ns"], r["boundary_ns"]
        print(f"{r['join']:>8} {launch:>15} | {last[0]:6.0f} /{last[1]:6.0f} | {boundary[0]:6.0f} /{boundary[1]:6.0f}")
    print(
        "join: where the main stream waits for the side stream's kernel (none: no side stream; boundary: right before "
        "the boundary; early: right before the sublayer's last kernel); last kernel: its start after the sublayer's "
        "end; boundary: its start (after its PDL wait) after the last kernel's end"
    )
