"""Does the per-call footprint (pages, TLB) make the W > 1 tail? `python -m bench.experiments.footprint_ab` times
the shipped kernel (one rank, simulated W 2 / 4; one row) called directly, with a set of tensors per call (as
the bench) against one set of inputs and outputs for every call; no L2 flush (a diagnostic of perf-log v19)."""

from __future__ import annotations

import torch

from bench.allreduce import rank_sets
from bench.experiments.peer_trace import every_rank_launch
from boundary import BoundaryAllReduce
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device


def graph_us(world: int, hidden: int, rows: int, alias: bool, calls: int, device: torch.device, arch: str) -> float:
    """Median GPU us of one replay of a graph in which every rank makes `calls` boundaries on its own stream."""
    config = default_config(hidden, arch, world, world)
    kernel = FusedBoundaryKernel(hidden, config, world_size=world, protocol="oneshot", staged=False)
    variant = api.BoundaryVariant("x", False, True, False, False)
    fn = api.compile_boundary_kernel(kernel, hidden, variant, world, arch=arch)
    ranks = [] if world == 1 else BoundaryAllReduce.simulated(hidden, world, max_rows=512, device=device)
    sets = rank_sets(world, rows, hidden, 1 if alias else calls, device)
    sets = sets * calls if alias else sets
    first = [(torch.empty_like(sets[0][r]["residual"]), torch.empty_like(sets[0][r]["x"])) for r in range(world)]
    outs = [
        [first[r] if alias else (torch.empty_like(s[r]["residual"]), torch.empty_like(s[r]["x"])) for s in sets]
        for r in range(world)
    ]

    every_rank = every_rank_launch(ranks, fn, sets, outs)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        every_rank()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        every_rank()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(8):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    for ar in ranks:
        ar.check()
    return sorted(times[1:])[3]


def main() -> int:
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    print("W > 1: SIMULATED ranks on one GPU (not NVLink); us per call, marginal from 10 to 40 calls per rank")
    for hidden in (4096, 7168):
        for world in (1, 2, 4):
            for alias in (False, True):
                t10 = graph_us(world, hidden, 1, alias, 10, device, arch)
                t40 = graph_us(world, hidden, 1, alias, 40, device, arch)
                label = "one set  " if alias else "per call "
                print(f"W={world} H={hidden} rows=1 tensors {label}: {(t40 - t10) / 30:.2f} us/call "
                      f"(graphs of 10 / 40: {t10:.1f} / {t40:.1f} us)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
