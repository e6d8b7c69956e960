"""Where a peer boundary's time goes: %globaltimer and %clock64 stamps per CTA on simulated ranks (an
experiment; the shipped kernels carry no trace).

`python -m bench.experiments.peer_trace --world 2 --hidden 7168 --rows 1 16` builds the shipped peer kernel
with a traced peer role: thread 0 of every CTA stamps its release (right after griddepcontrol.wait), the
call's generation known (the counter read back), the end of its pushes (a wait's entry), the arrival of the
last word it waits for (the wait's exit), the end of the re-arm, and the end of each row (a staged call keeps
its last row's). Every rank runs `--calls` boundaries back to back on its own stream inside one CUDA graph, as
the simulated bench does; the stamps of the last RING calls are kept. The table gives, per (W, H, rows,
protocol), the median step times (clock64, scaled to ns by the run's own globaltimer), the call period, the
spread of the ranks' releases of a call, and, one-shot, how long after the last peer's push the wait ends.
Simulated ranks share one GPU: these are not NVLink numbers.
"""

from __future__ import annotations

import argparse

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from bench.allreduce import forced_protocol, rank_sets
from boundary import BoundaryAllReduce
from cute_kernels import ptx
from cute_kernels.allreduce.peer import PeerReduce
from cute_kernels.allreduce.protocol import CALL_SHIFT, STATE_RANK
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel

EVENTS = ("released", "gen", "pushed", "arrived", "rearmed", "row done")
MAX_CTAS = 4096
RING = 32  # the stamps of the last RING calls are kept (slot: call index % RING)


class Stamps:
    """Writes (%globaltimer, %clock64) per (rank, call % RING, CTA, event) into a device buffer whose address is
    compiled in; thread 0 of each CTA stamps."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.call = None  # this call's ring slot, from thread 0's counter read (every later stamp uses it)
        self.released = None  # the times taken right after griddepcontrol.wait, written once the slot is known

    @cute.jit
    def stamp(self, rank: Int32, event: int, taken: tuple | None = None):
        """Stamp `event` now, or with the (globaltimer, clock64) pair `taken` earlier."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            bx, by, _ = cute.arch.block_idx()
            gx, _, _ = cute.arch.grid_dim()
            cta = Int64(by) * Int64(gx) + Int64(bx)
            cell = ((Int64(rank) * RING + Int64(self.call)) * MAX_CTAS + cta) * len(EVENTS) + event
            t, c = (ptx.globaltimer(), ptx.clock64()) if taken is None else taken
            addr = Int64(self.base) + cell * 16
            ptx.st_global_v2_b32(addr, Uint32(t & 0xFFFFFFFF), Uint32(t >> 32))
            ptx.st_global_v2_b32(addr + 8, Uint32(c & 0xFFFFFFFF), Uint32(c >> 32))


def traced_kernel(hidden: int, world: int, protocol: str, staged: bool, arch: str, base: int):
    """The shipped peer kernel (bf16 partial in, bf16 out; inline or staged) with the stamps of `Stamps` at `base`."""
    stamps = Stamps(base)

    class TracedPeer(PeerReduce):
        @cute.jit
        def read_counter(self, mState: cute.Tensor) -> Int32:
            stamps.released = (ptx.globaltimer(), ptx.clock64())
            return PeerReduce.read_counter(self, mState)

        @cute.jit
        def call_generation(self, mState: cute.Tensor, calls: Int32) -> Int32:
            gen = PeerReduce.call_generation(self, mState, calls)
            stamps.call = (calls >> CALL_SHIFT) & (RING - 1)  # lane 0's read: thread 0 is the one that stamps
            stamps.stamp(mState[STATE_RANK], 0, stamps.released)
            stamps.stamp(mState[STATE_RANK], 1)
            return gen

        @cute.jit
        def wait(self, ctx, rIn: cute.Tensor, row: Int32, sources: list, deadline: Int64):
            stamps.stamp(ctx.rank, 2)
            PeerReduce.wait(self, ctx, rIn, row, sources, deadline)
            stamps.stamp(ctx.rank, 3)

        @cute.jit
        def rearm(self, ctx, row: Int32, sources: list):
            PeerReduce.rearm(self, ctx, row, sources)
            stamps.stamp(ctx.rank, 4)

    class TracedKernel(FusedBoundaryKernel):
        @cute.jit
        def process_row(self, ctx, regs, row: Int32, stage: int, phase: Int32, clusters: Int32):
            FusedBoundaryKernel.process_row(self, ctx, regs, row, stage, phase, clusters)
            stamps.stamp(ctx.rank, 5)

    config = default_config(hidden, arch, world, world)
    kernel = TracedKernel(hidden, config, world_size=world, protocol=protocol, staged=staged)
    kernel.attach_allreduce(TracedPeer(hidden, world, protocol, kernel.vpt, kernel.cluster_n, staged=staged))
    variant = api.BoundaryVariant("x", False, True, False, False)
    return api.compile_boundary_kernel(kernel, hidden, variant, world, arch=arch), config


def trace_point(ranks: list[BoundaryAllReduce], fn, trace: torch.Tensor, rows: int, calls: int) -> torch.Tensor:
    """The stamps ([W, RING, CTAs, events, (ns, cycles)]) of the last RING of `calls` back-to-back boundaries on every
    rank, from a CUDA graph replay, launched as the simulated bench launches them (a stream per rank)."""
    world, hidden = len(ranks), ranks[0].hidden_size
    sets = rank_sets(world, rows, hidden, calls, ranks[0].device)
    outs = [[(torch.empty_like(s[r]["residual"]), torch.empty_like(s[r]["x"])) for s in sets] for r in range(world)]

    def many(ar: BoundaryAllReduce) -> None:
        ws = ar.workspace
        for s, (new, out) in zip(sets, outs[ar.rank]):
            x = s[ar.rank]
            fn(x["residual"], x["post"], x["comb"], x["pre"], x["w"], x["x"], None, None, None, None, new, out, None,
               None, None, ws.slots, ws.peers, ws.state, ws.error, 1e-6)  # fmt: skip

    stream = torch.cuda.Stream(ranks[0].device)
    with torch.cuda.stream(stream):
        BoundaryAllReduce.run_simulated(ranks, [many] * world)  # loads the kernel on every rank
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        BoundaryAllReduce.run_simulated(ranks, [many] * world)
    graph.replay()
    torch.cuda.synchronize()
    trace.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for ar in ranks:
        ar.check()
    return trace.clone()


def summarize(stamps: torch.Tensor, ctas: int, protocol: str) -> dict[str, float]:
    """Per step, the median over (rank, call, CTA) in ns (clock64 deltas scaled by the run's ns per cycle); the
    call period and the spread of the ranks' releases (globaltimer); one-shot, the wait's exit after the last
    peer's push of the same CTA."""
    t = stamps[:, :, :ctas, :, 0].double()  # [W, RING, CTAs, events] ns
    c = stamps[:, :, :ctas, :, 1].double()  # cycles
    last = len(EVENTS) - 1
    ns_per_cycle = float((t[..., last] - t[..., 0]).sum() / (c[..., last] - c[..., 0]).sum())
    steps = {}
    for i in range(1, len(EVENTS)):
        steps[f"{EVENTS[i - 1]}->{EVENTS[i]}"] = float((c[..., i] - c[..., i - 1]).median()) * ns_per_cycle
    steps["released->row done"] = float((c[..., last] - c[..., 0]).median()) * ns_per_cycle
    release = t[..., 0].min(dim=2).values  # [W, RING]: each rank's first CTA of each call
    ordered = release.sort(dim=1).values
    periods = ordered[:, 1:] - ordered[:, :-1]
    steps["call period"] = float(periods.median())
    steps["mean period"] = float(periods.mean())
    steps["rank spread"] = float((ordered.max(dim=0).values - ordered.min(dim=0).values).median())
    steps["CTA spread"] = float((t[..., 0].max(dim=2).values - release).median())
    if protocol == "oneshot":
        world = t.shape[0]
        later = torch.stack([t[[p for p in range(world) if p != r], :, :, 2].max(dim=0).values for r in range(world)])
        steps["last push->arrived"] = float((t[..., 3] - later).median())
    return {k: v / 1e3 for k, v in steps.items()}


def main(argv: list[str] | None = None) -> int:
    from cute_kernels.compile import arch_for_device

    p = argparse.ArgumentParser(prog="python -m bench.experiments.peer_trace", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--protocol", nargs="+", default=["oneshot", "twoshot"])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dump", type=str, default=None, help="save every point's raw stamps (torch.save) here")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    raw = {}
    print(f"SIMULATED ranks on one GPU (not NVLink): medians over ranks, the last {RING} calls and CTAs, us")
    for world in args.world:
        trace = torch.zeros(world, RING, MAX_CTAS, len(EVENTS), 2, dtype=torch.int64, device=device)
        for hidden in args.hidden:
            ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max(args.rows), device=device)
            for protocol in args.protocol:
                with forced_protocol(protocol):
                    for rows in args.rows:
                        config = default_config(hidden, arch, world, world)
                        staged = config.clusters(rows) < rows
                        fn, _ = traced_kernel(hidden, world, protocol, staged, arch, trace.data_ptr())
                        ctas = config.cluster_n * config.clusters(rows)
                        stamps = trace_point(ranks, fn, trace, rows, args.calls)
                        raw[(world, hidden, rows, protocol)] = stamps[:, :, :ctas].cpu()
                        steps = summarize(stamps, ctas, protocol)
                        cells = "  ".join(f"{k} {v:5.2f}" for k, v in steps.items())
                        print(f"W={world} H={hidden} rows={rows:4d} {protocol:7s}  {cells}", flush=True)
    if args.dump:
        torch.save({"events": EVENTS, "stamps": raw}, args.dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
