"""Where a peer boundary's time goes: %globaltimer stamps per CTA on simulated ranks (an experiment; the
shipped kernels carry no trace).

`python -m bench.experiments.peer_trace --world 2 --hidden 7168 --rows 1 16` builds the shipped peer kernel
with a traced peer role: thread 0 of every CTA stamps the call's start (after griddepcontrol.wait), the end
of its pushes (a wait's entry), the arrival of the last word it waits for (the wait's exit), the end of the
re-arm, and the end of each row. Every rank runs `--calls` boundaries back to back on its own stream, as
the simulated bench does; the stamps of the last call are kept (a staged call keeps its last row's). The
table gives, per (W, H, rows, protocol), the median over CTAs of each step, and the spread of the ranks'
starts. Simulated ranks share one GPU: these are not NVLink numbers.
"""

from __future__ import annotations

import argparse
import statistics

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from bench.allreduce import forced_protocol, rank_sets
from boundary import BoundaryAllReduce
from cute_kernels import ptx
from cute_kernels.allreduce.peer import PeerReduce
from cute_kernels.allreduce.protocol import STATE_RANK
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel

EVENTS = ("start", "pushed", "arrived", "rearmed", "row done")
MAX_CTAS = 4096


class Stamps:
    """Writes one %globaltimer stamp per (rank, CTA, event) into a device buffer whose address is compiled in."""

    def __init__(self, base: int) -> None:
        self.base = base

    @cute.jit
    def stamp(self, rank: Int32, event: int):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            bx, by, _ = cute.arch.block_idx()
            gx, _, _ = cute.arch.grid_dim()
            cta = Int64(by) * Int64(gx) + Int64(bx)
            addr = Int64(self.base) + ((Int64(rank) * MAX_CTAS + cta) * len(EVENTS) + event) * 8
            t = ptx.globaltimer()
            ptx.st_global_v2_b32(addr, Uint32(t & 0xFFFFFFFF), Uint32(t >> 32))


def traced_kernel(hidden: int, world: int, protocol: str, staged: bool, arch: str, base: int):
    """The shipped peer kernel (bf16 partial in, bf16 out; inline or staged) with the stamps of `Stamps` at `base`."""
    stamps = Stamps(base)

    class TracedPeer(PeerReduce):
        @cute.jit
        def call_generation(self, mState: cute.Tensor, calls: Int32) -> Int32:
            gen = PeerReduce.call_generation(self, mState, calls)
            stamps.stamp(mState[STATE_RANK], 0)
            return gen

        @cute.jit
        def wait(self, ctx, rIn: cute.Tensor, row: Int32, sources: list, deadline: Int64):
            stamps.stamp(ctx.rank, 1)
            PeerReduce.wait(self, ctx, rIn, row, sources, deadline)
            stamps.stamp(ctx.rank, 2)

        @cute.jit
        def rearm(self, ctx, row: Int32, sources: list):
            PeerReduce.rearm(self, ctx, row, sources)
            stamps.stamp(ctx.rank, 3)

    class TracedKernel(FusedBoundaryKernel):
        @cute.jit
        def process_row(self, ctx, regs, row: Int32, stage: int, phase: Int32, clusters: Int32):
            FusedBoundaryKernel.process_row(self, ctx, regs, row, stage, phase, clusters)
            stamps.stamp(ctx.rank, 4)

    config = default_config(hidden, arch, world, world)
    kernel = TracedKernel(hidden, config, world_size=world, protocol=protocol, staged=staged)
    kernel.attach_allreduce(TracedPeer(hidden, world, protocol, kernel.vpt, kernel.cluster_n, staged=staged))
    variant = api.BoundaryVariant("x", False, True, False, False)
    return api.compile_boundary_kernel(kernel, hidden, variant, world, arch=arch), config


def trace_point(ranks: list[BoundaryAllReduce], fn, trace: torch.Tensor, rows: int, calls: int) -> torch.Tensor:
    """The stamps (ns, [W, CTAs, events]) of the last of `calls` back-to-back boundaries on every rank."""
    world, hidden = len(ranks), ranks[0].hidden_size
    sets = rank_sets(world, rows, hidden, calls, ranks[0].device)

    def many(ar: BoundaryAllReduce) -> None:
        ws = ar.workspace
        for s in sets:
            x = s[ar.rank]
            new = torch.empty_like(x["residual"])
            out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=ar.device)
            fn(x["residual"], x["post"], x["comb"], x["pre"], x["w"], x["x"], None, None, None, None, new, out, None,
               None, None, ws.slots, ws.peers, ws.state, ws.error, 1e-6)  # fmt: skip

    BoundaryAllReduce.run_simulated(ranks, [many] * world)  # loads the kernel on every rank
    torch.cuda.synchronize()
    trace.zero_()
    BoundaryAllReduce.run_simulated(ranks, [many] * world)
    torch.cuda.synchronize()
    for ar in ranks:
        ar.check()
    return trace.clone()


def summarize(stamps: torch.Tensor, ctas: int) -> dict[str, float]:
    """Median over every rank's CTAs of each step (us), and the spread of the ranks' first starts."""
    t = stamps[:, :ctas, :].double()
    steps = {}
    for i in range(1, len(EVENTS)):
        d = (t[:, :, i] - t[:, :, i - 1]).flatten().tolist()
        steps[f"{EVENTS[i - 1]}->{EVENTS[i]}"] = statistics.median(d) / 1e3
    starts = t[:, :, 0].min(dim=1).values
    steps["rank start spread"] = float(starts.max() - starts.min()) / 1e3
    steps["start->row done"] = statistics.median((t[:, :, 4] - t[:, :, 0]).flatten().tolist()) / 1e3
    return steps


def main(argv: list[str] | None = None) -> int:
    from cute_kernels.compile import arch_for_device

    p = argparse.ArgumentParser(prog="python -m bench.experiments.peer_trace", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--protocol", nargs="+", default=["oneshot", "twoshot"])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    print("SIMULATED ranks on one GPU (not NVLink): median over CTAs, us")
    for world in args.world:
        trace = torch.zeros(world, MAX_CTAS, len(EVENTS), dtype=torch.int64, device=device)
        for hidden in args.hidden:
            ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max(args.rows), device=device)
            for protocol in args.protocol:
                with forced_protocol(protocol):
                    for rows in args.rows:
                        config = default_config(hidden, arch, world, world)
                        staged = config.clusters(rows) < rows
                        fn, _ = traced_kernel(hidden, world, protocol, staged, arch, trace.data_ptr())
                        ctas = config.cluster_n * config.clusters(rows)
                        steps = summarize(trace_point(ranks, fn, trace, rows, args.calls), ctas)
                        cells = "  ".join(f"{k} {v:6.2f}" for k, v in steps.items())
                        print(f"W={world} H={hidden} rows={rows:4d} {protocol:7s}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
