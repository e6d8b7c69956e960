"""Where a boundary's time goes: %globaltimer and %clock64 stamps per CTA, one rank alone or simulated ranks
(an experiment; the shipped kernels carry no trace).

`python -m bench.experiments.peer_trace --world 1 2 --hidden 7168 --rows 1 16` builds the shipped kernel
(W = 1: the one-rank kernel; W > 1: the peer kernel) with traced roles: thread 0 of every CTA stamps its
release (right after griddepcontrol.wait), W > 1: the call's generation known (the counter read back), the
row's partial loaded (timed after a store that needs the loaded value), W > 1: the end of its pushes (a
wait's entry), the arrival of the last word it waits for (the wait's exit; and, by every warp, the latest
exit), the end of the re-arm; then the row's new streams computed (their stores issued), the cluster's sum
of squares in, and the end of each row (a staged call keeps its last row's); W > 1, by every warp, the latest
new streams stored and sum of squares pushed into the cluster, and thread 0's SM id. Every rank runs
`--calls` boundaries back to back on its own stream inside one CUDA graph, as the bench does; the stamps of
the last RING calls are kept. The table
gives, per (W, H, rows, protocol), the median step times (clock64, scaled to ns by the run's own
globaltimer), the call period, the spread of the ranks' releases of a call, and, one-shot, how long after the
last peer's push the wait ends. Simulated ranks share one GPU: these are not NVLink numbers.

`--warp-stamps` (W > 1): every warp's lane 0 also stamps, into its own cell with plain stores (the atomic
"all ..." stamps are then left out), its wait's exit, its new streams stored, its sum of squares reduced
(shuffles), pushed into the cluster, and the cluster's sum in: the steps of one warp in its SM's clock64
(`--dump` saves them under "warp_stamps").
"""

from __future__ import annotations

import argparse

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cutlass_dsl import T

from bench.allreduce import forced_protocol, rank_sets
from boundary import BoundaryAllReduce
from cute_kernels import ptx, reduce
from cute_kernels.allreduce.peer import PeerReduce
from cute_kernels.allreduce.protocol import CALL_SHIFT
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.epilogue import Epilogue
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.boundary.loads import RowLoads

EVENTS = (
    "released",
    "gen",
    "loaded",
    "pushed",
    "arrived",
    "rearmed",
    "computed",
    "summed",
    "row done",
    "all arrived",
    "at wait",
    "all computed",
    "all sent",
    "sm",
)
# Thread 0's events, in order; "all arrived": the last warp's wait exit (W > 1); "at wait": thread 0 reaching
# griddepcontrol.wait (a CTA that reaches it after the previous grid's end runs its prologue on the chain);
# W > 1: "all computed" / "all sent": the last warp's new streams stored / its sum of squares pushed to the
# cluster; "sm": the CTA's SM id (in the globaltimer half; not a time).
CHAIN = EVENTS[:9]
ONE_RANK_EVENTS = ("released", "loaded", "computed", "summed", "row done")  # what a W = 1 kernel stamps
MAX_CTAS = 4096
RING = 32  # the stamps of the last RING calls are kept (slot: call index % RING)
# W > 1, `--warp-stamps`: every warp's lane 0 stamps these into its own cell with plain stores (no atomics), so
# that the steps between a warp's peer wait and its cluster sum are timed per warp, in its SM's clock64.
WARP_EVENTS = ("arrived", "computed", "shuffled", "sent", "waited")
WARP_CTAS = 1024  # the CTAs whose warps stamp (the first ones of each call)
WARPS = 8  # warps per CTA with a cell


class Stamps:
    """Writes (%globaltimer, %clock64) per (rank, call % RING, CTA, event) into a device buffer whose address is
    compiled in; thread 0 of each CTA stamps. W = 1 counts its calls itself, in one word per CTA at `calls`."""

    def __init__(self, base: int, calls: int) -> None:
        self.base = base
        self.calls = calls  # W = 1: int32 [MAX_CTAS] call counts (W > 1 takes the slot from the peer counter)
        self.call = None  # this call's ring slot, known to thread 0 (every later stamp uses it)
        self.released = None  # the times taken right after griddepcontrol.wait, written once the slot is known
        self.at_wait = None  # the times taken right before it
        self.gen = None  # W > 1: the times the call's generation was known
        self.begun = False  # trace time: whether the kernel's first row load has been traced
        self.rank = None  # trace time: the rank of the row being finished (the row's sum takes no ctx)

    @cute.jit
    def cta(self) -> Int64:
        bx, by, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        return Int64(by) * Int64(gx) + Int64(bx)

    @cute.jit
    def count_call(self):
        """W = 1: this call's ring slot from the CTA's own call count (thread 0; its value is first used much later)."""
        tidx, _, _ = cute.arch.thread_idx()
        slot = Int32(0)
        if tidx == 0:
            word = cute.make_ptr(Int32, self.calls + self.cta() * 4, cute.AddressSpace.gmem)
            slot = cute.arch.atomic_add(word, Int32(1), sem="relaxed", scope="gpu")
        self.call = slot & (RING - 1)

    @cute.jit
    def address(self, rank: Int32, name: str) -> Int64:
        """The 16-byte cell of event `name` of this call, rank and CTA."""
        cell = ((Int64(rank) * RING + Int64(self.call)) * MAX_CTAS + self.cta()) * len(EVENTS) + EVENTS.index(name)
        return Int64(self.base) + cell * 16

    @cute.jit
    def stamp(self, rank: Int32, name: str, taken: tuple | None = None):
        """Stamp event `name` now, or with the (globaltimer, clock64) pair `taken` earlier."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            t, c = (ptx.globaltimer(), ptx.clock64()) if taken is None else taken
            addr = self.address(rank, name)
            ptx.st_global_v2_b32(addr, Uint32(t & 0xFFFFFFFF), Uint32(t >> 32))
            ptx.st_global_v2_b32(addr + 8, Uint32(c & 0xFFFFFFFF), Uint32(c >> 32))

    @cute.jit
    def stamp_latest(self, rank: Int32, name: str):
        """Lane 0 of every warp stamps event `name` now; the cell keeps the latest (an atomic max of each half).
        Needs the call's ring slot on every warp's lane 0 (W > 1: each reads the call counter)."""
        if cute.arch.lane_idx() == 0:
            addr = self.address(rank, name)
            t, c = ptx.globaltimer(), ptx.clock64()
            cute.arch.atomic_max(cute.make_ptr(Int64, addr, cute.AddressSpace.gmem), t, sem="relaxed", scope="gpu")
            cute.arch.atomic_max(cute.make_ptr(Int64, addr + 8, cute.AddressSpace.gmem), c, sem="relaxed", scope="gpu")

    @cute.jit
    def stamp_sm(self, rank: Int32):
        """Thread 0 writes its SM id into the "sm" cell (the globaltimer half; the clock half 1, so that it counts
        as stamped)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            sm = Uint32(ptx.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", side_effects=True))
            addr = self.address(rank, "sm")
            ptx.st_global_v2_b32(addr, sm, Uint32(0))
            ptx.st_global_v2_b32(addr + 8, Uint32(1), Uint32(0))

    @cute.jit
    def stamp_after(self, rank: Int32, name: str, value: Float32):
        """Stamp event `name` once `value` (a loaded row's first element) is in: a store of its bits goes first (into
        the event's own cell, overwritten by the stamp), and the timer reads are not moved above a store."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            bits = ptx.f32_bits(value)
            ptx.st_global_v2_b32(self.address(rank, name), bits, bits)
        self.stamp(rank, name)


class WarpStamps:
    """Writes (%globaltimer, %clock64) per (rank, call % RING, CTA, warp, event) with plain stores by each warp's
    lane 0 (W > 1: every warp's lane 0 knows the call's ring slot from its own counter read)."""

    def __init__(self, base: int, stamps: Stamps) -> None:
        self.base = base
        self.stamps = stamps

    @cute.jit
    def stamp(self, rank: Int32, name: str, value: Float32 | None = None):
        """Stamp warp event `name` now; with `value`, once it is in (a store of its bits goes first)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx % 32 == 0:
            cta = self.stamps.cta()
            if cta < WARP_CTAS:
                warp = Int64(tidx // 32)
                cell = ((Int64(rank) * RING + Int64(self.stamps.call)) * WARP_CTAS + cta) * WARPS + warp
                addr = Int64(self.base) + (cell * len(WARP_EVENTS) + WARP_EVENTS.index(name)) * 16
                if const_expr(value is not None):
                    bits = ptx.f32_bits(value)
                    ptx.st_global_v2_b32(addr, bits, bits)
                t, c = ptx.globaltimer(), ptx.clock64()
                ptx.st_global_v2_b32(addr, Uint32(t & 0xFFFFFFFF), Uint32(t >> 32))
                ptx.st_global_v2_b32(addr + 8, Uint32(c & 0xFFFFFFFF), Uint32(c >> 32))


def traced_kernel(
    hidden: int,
    world: int,
    protocol: str,
    staged: bool,
    arch: str,
    base: int,
    calls: int,
    trigger: str = "shipped",
    warp_base: int | None = None,
):
    """The shipped kernel (bf16 partial in, bf16 out; W > 1: the peer kernel, inline or staged) with the stamps of
    `Stamps` at `base`. `trigger` "end": the PDL trigger after each CTA's last row instead of where it ships (a
    diagnostic: whether the next grid's launch, which the trigger sets off, disturbs this one's epilogue)."""
    stamps = Stamps(base, calls)
    warp_stamps = None if warp_base is None or world == 1 else WarpStamps(warp_base, stamps)

    def rank_of(ctx) -> Int32:
        return Int32(0) if ctx.peer is None else ctx.peer.rank

    class TracedLoads(RowLoads):
        @cute.jit
        def load_row(self, ctx, regs, row: Int32, partial: bool = True):
            if const_expr(not stamps.begun):  # the kernel's first load (unstaged): right after the wait
                stamps.begun = True
                stamps.released = (ptx.globaltimer(), ptx.clock64())
                if const_expr(world == 1):
                    stamps.count_call()
            RowLoads.load_row(self, ctx, regs, row, partial)

        @cute.jit
        def partial(self, ctx, regs, row: Int32) -> cute.Tensor:
            y = RowLoads.partial(self, ctx, regs, row)
            # The times taken earlier, written now that the ring slot is known, with the rank read before the wait
            # (a reload of the rank word from the state would put a load on the chain the stamps measure).
            stamps.stamp(rank_of(ctx), "released", stamps.released)
            stamps.stamp(rank_of(ctx), "at wait", stamps.at_wait)
            if const_expr(world > 1):
                stamps.stamp(rank_of(ctx), "gen", stamps.gen)
                stamps.stamp_sm(rank_of(ctx))
            stamps.stamp_after(rank_of(ctx), "loaded", y[0, 0])
            return y

    class TracedPeer(PeerReduce):
        @cute.jit
        def read_counter(self, mState: cute.Tensor) -> Int32:
            if const_expr(not stamps.begun):  # staged: the counter is the first read after the wait
                stamps.begun = True
                stamps.released = (ptx.globaltimer(), ptx.clock64())
            return PeerReduce.read_counter(self, mState)

        @cute.jit
        def call_generation(self, mState: cute.Tensor, calls: Int32) -> Int32:
            gen = PeerReduce.call_generation(self, mState, calls)
            stamps.call = (calls >> CALL_SHIFT) & (RING - 1)  # lane 0's read: thread 0 is the one that stamps
            stamps.gen = (ptx.globaltimer(), ptx.clock64())  # written with the row's first stamp
            return gen

        @cute.jit
        def wait(self, ctx, rIn: cute.Tensor, row: Int32, sources: list, deadline: Int64, pending=None):
            stamps.stamp(ctx.peer.rank, "pushed")
            PeerReduce.wait(self, ctx, rIn, row, sources, deadline, pending)
            stamps.stamp(ctx.peer.rank, "arrived")
            if const_expr(warp_stamps is not None):
                warp_stamps.stamp(ctx.peer.rank, "arrived")
            if const_expr(warp_stamps is None):  # per-warp stamps replace the atomic ones
                stamps.stamp_latest(ctx.peer.rank, "all arrived")

        @cute.jit
        def rearm(self, ctx, row: Int32, sources: list):
            PeerReduce.rearm(self, ctx, row, sources)
            stamps.stamp(ctx.peer.rank, "rearmed")

    real_trigger = cute.arch.griddepcontrol_launch_dependents

    class TracedKernel(FusedBoundaryKernel):
        @cute.jit
        def process_row(self, ctx, regs, row: Int32, stage: int, phase: Int32):
            FusedBoundaryKernel.process_row(self, ctx, regs, row, stage, phase)
            stamps.stamp(rank_of(ctx), "row done")
            if const_expr(trigger == "end"):
                if row + ctx.clusters >= ctx.rows:
                    real_trigger()

    class TracedEpilogue(Epilogue):
        @cute.jit
        def compute_row(self, ctx, rR, y, post, comb, pre, row: Int32, *more):
            rC, sumsq = Epilogue.compute_row(self, ctx, rR, y, post, comb, pre, row, *more)
            if const_expr(warp_stamps is not None):
                warp_stamps.stamp(rank_of(ctx), "computed", sumsq)
            stamps.stamp(rank_of(ctx), "computed")  # the new streams' stores issued
            if const_expr(world > 1 and warp_stamps is None):
                stamps.stamp_latest(rank_of(ctx), "all computed")
            stamps.rank = rank_of(ctx)  # for the stamps of the row's sum, which takes no ctx
            return rC, sumsq

        @cute.jit
        def send_warp_sum(self, val, sRed, mbar, cta, stage: int, *more):
            if const_expr(warp_stamps is None):
                Epilogue.send_warp_sum(self, val, sRed, mbar, cta, stage, *more)
            else:
                # Epilogue.send_warp_sum's steps (cluster kernels), a warp stamp after the shuffles and the pushes.
                lane = cute.arch.lane_idx()
                warp = cute.arch.warp_idx()
                val = reduce.warp_sum(val)
                warp_stamps.stamp(stamps.rank, "shuffled", val)
                base = const_expr(stage * self.slots)
                slot = cta * self.warps + warp
                if warp == 0:
                    reduce.expect_bytes(mbar + stage, self.slots * 4)
                if lane < self.cluster_n:
                    reduce.push(sRed.iterator + base + slot, val, mbar + stage, lane)
                warp_stamps.stamp(stamps.rank, "sent")
            if const_expr(world > 1 and warp_stamps is None):
                stamps.stamp_latest(stamps.rank, "all sent")  # every warp's sum pushed into the cluster

        @cute.jit
        def gather_sum(self, sRed, mbar, stage: int, phase, *more):
            total = Epilogue.gather_sum(self, sRed, mbar, stage, phase, *more)
            if const_expr(warp_stamps is not None):
                warp_stamps.stamp(stamps.rank, "waited", total)
            stamps.stamp(stamps.rank, "summed")  # the cluster's sum of squares in (and fenced)
            return total

    config = default_config(hidden, arch, world, world)
    for traced, shipped in (
        (TracedLoads, RowLoads),
        (TracedPeer, PeerReduce),
        (TracedKernel, FusedBoundaryKernel),
        (TracedEpilogue, Epilogue),
    ):
        stale = [name for name in vars(traced) if not name.startswith("__") and not hasattr(shipped, name)]
        if stale:  # a hook the shipped role no longer calls would stamp nothing
            raise TypeError(f"{traced.__name__} overrides {stale}, which {shipped.__name__} no longer has")
    kernel = TracedKernel(hidden, config, world_size=world, protocol=protocol, staged=staged)
    kernel.loads = TracedLoads(hidden, kernel.vpt, y_source="x", shared=False, pre=True)
    kernel.epilogue = TracedEpilogue(
        hidden,
        config.cluster_n,
        config.threads,
        kernel.vpt,
        pre=True,
        mxfp8=False,
        aux=False,
        spin=kernel.epilogue.spin,
    )
    if world > 1:
        kernel.attach_allreduce(TracedPeer(hidden, world, protocol, kernel.vpt, kernel.cluster_n, staged=staged))
    variant = api.BoundaryVariant("x", False, True, False, False)
    real_wait = cute.arch.griddepcontrol_wait

    def stamped_wait(*args, **kwargs):
        stamps.at_wait = (ptx.globaltimer(), ptx.clock64())
        return real_wait(*args, **kwargs)

    if trigger not in ("shipped", "end"):
        raise ValueError(f"trigger must be 'shipped' or 'end', got {trigger!r}")
    # Only while this kernel is traced (the kernel calls both by name).
    cute.arch.griddepcontrol_wait = stamped_wait
    if trigger == "end":
        cute.arch.griddepcontrol_launch_dependents = lambda *args, **kwargs: None
    try:
        return api.compile_boundary_kernel(kernel, hidden, variant, world, arch=arch), config
    finally:
        cute.arch.griddepcontrol_wait = real_wait
        cute.arch.griddepcontrol_launch_dependents = real_trigger


def every_rank_launch(ranks: list[BoundaryAllReduce], fn, sets: list, outs: list):
    """A closure: every rank (no `ranks`: one rank alone) launches the compiled boundary `fn` (bf16 partial in,
    bf16 out) on its inputs of each of `sets` in turn, into outs[rank][i], each rank on its own stream."""
    world = max(1, len(ranks))

    def one_rank(rank: int, ws) -> None:
        peer = {} if ws is None else dict(slots=ws.slots, peers=ws.peers, state=ws.state, error=ws.error)
        for s, (new, out) in zip(sets, outs[rank]):
            x = s[rank]
            fn(
                *api.BoundaryArgs(
                    residual=x["residual"],
                    post=x["post"],
                    comb=x["comb"],
                    pre=x["pre"],
                    norm_weight=x["w"],
                    x=x["x"],
                    new_residual=new,
                    out=out,
                    **peer,
                    eps=1e-6,
                )
            )

    def every_rank() -> None:
        if ranks:
            BoundaryAllReduce.run_simulated(ranks, [lambda ar: one_rank(ar.rank, ar.workspace)] * world)
        else:
            one_rank(0, None)

    return every_rank


def trace_point(
    ranks: list[BoundaryAllReduce], fn, trace: torch.Tensor, counts: torch.Tensor, hidden: int, rows: int, calls: int
) -> torch.Tensor:
    """The stamps ([W, RING, CTAs, events, (ns, cycles)]) of the last RING of `calls` back-to-back boundaries on every
    rank (no `ranks`: one rank alone, W = 1), from a CUDA graph replay, launched as the bench launches them (a
    stream per rank)."""
    device = counts.device
    world = max(1, len(ranks))
    sets = rank_sets(world, rows, hidden, calls, device)
    outs = [[(torch.empty_like(s[r]["residual"]), torch.empty_like(s[r]["x"])) for s in sets] for r in range(world)]
    every_rank = every_rank_launch(ranks, fn, sets, outs)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        every_rank()  # loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        every_rank()
    graph.replay()
    torch.cuda.synchronize()
    trace.zero_()
    counts.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for ar in ranks:
        ar.check()
    return trace.clone()


def summarize(stamps: torch.Tensor, ctas: int, protocol: str | None) -> dict[str, float]:
    """Per step, the median over (rank, call, CTA) in ns (clock64 deltas scaled by the run's ns per cycle); the
    call period, the spread of the ranks' releases and the row's end after its last CTA's last input (median and
    90th percentile; globaltimer); one-shot, the wait's exit after the last peer's push of the same CTA.
    `protocol` None: one rank alone (its own events only)."""
    events = ONE_RANK_EVENTS if protocol is None else CHAIN
    at = [EVENTS.index(e) for e in events]
    t = stamps[:, :, :ctas, :, 0].double()  # [W, RING, CTAs, events] ns
    c = stamps[:, :, :ctas, :, 1].double()  # cycles
    first, last = at[0], at[-1]
    ns_per_cycle = float((t[..., last] - t[..., first]).sum() / (c[..., last] - c[..., first]).sum())
    steps = {}

    def step(i: int, j: int) -> float:
        """Median of event j - event i (ns) over the cells that stamped both (a staged two-shot CTA that owns
        every row never waits, so it stamps no wait)."""
        both = (c[..., i] > 0) & (c[..., j] > 0)
        return float((c[..., j] - c[..., i])[both].median()) * ns_per_cycle if both.any() else float("nan")

    for i, j in zip(at, at[1:]):
        steps[f"{EVENTS[i]}->{EVENTS[j]}"] = step(i, j)
    steps["released->row done"] = step(first, last)
    # How long thread 0 waited at griddepcontrol.wait: near 0, the CTA came after the previous grid's end.
    waited = EVENTS.index("at wait")
    both = (c[..., waited] > 0) & (c[..., first] > 0)
    held = (c[..., first] - c[..., waited])[both] * ns_per_cycle
    steps["at wait->released"] = float(held.median()) if held.numel() else float("nan")
    steps["p10 at wait->released"] = float(held.quantile(0.1)) if held.numel() else float("nan")
    release = t[..., first].min(dim=2).values  # [W, RING]: each rank's first CTA of each call
    ordered = release.sort(dim=1).values
    periods = ordered[:, 1:] - ordered[:, :-1]
    steps["call period"] = float(periods.median())
    steps["mean period"] = float(periods.mean())
    steps["p90 period"] = float(periods.quantile(0.9))
    steps["max period"] = float(periods.max())
    steps["rank spread"] = float((ordered.max(dim=0).values - ordered.min(dim=0).values).median())
    # The epilogue after the row's last input (W > 1: the last CTA's wait exit; one rank: its last load), per call.
    last_in = EVENTS.index("loaded" if protocol is None else "arrived")
    tail = t[..., EVENTS.index("row done")].max(dim=2).values - t[..., last_in].max(dim=2).values
    steps["last in->done"] = float(tail.median())
    steps["p90 last in->done"] = float(tail.quantile(0.9))
    if protocol is not None:
        # Thread 0 stamps "arrived": a CTA's other warps may still wait for their own words then.
        every, arrived = EVENTS.index("all arrived"), EVENTS.index("arrived")
        both = (c[..., every] > 0) & (c[..., arrived] > 0)
        # A ring cell is shared by calls k and k + RING, and each half of it keeps its own maximum: where the
        # later call ran on an SM whose clock64 is behind, the clock half is the earlier call's. Such cells
        # disagree with the globaltimer (monotonic, so always the later call's) by a call or more: left out.
        skew = (c[..., every] - c[..., arrived]) * ns_per_cycle
        both &= (skew - (t[..., every] - t[..., arrived])).abs() < 512  # two globaltimer ticks
        skew = skew[both]
        steps["warp skew at arrival"] = float(skew.median()) if skew.numel() else float("nan")
        steps["p90 warp skew at arrival"] = float(skew.quantile(0.9)) if skew.numel() else float("nan")
        tail = t[..., EVENTS.index("row done")].max(dim=2).values - t[..., every].max(dim=2).values
        steps["all in->done"] = float(tail.median())
        steps["p90 all in->done"] = float(tail.quantile(0.9))
    steps["CTA spread"] = float((t[..., first].max(dim=2).values - release).median())
    if protocol == "oneshot":
        world = t.shape[0]
        pushed, arrived = EVENTS.index("pushed"), EVENTS.index("arrived")
        later = torch.stack(
            [t[[p for p in range(world) if p != r], :, :, pushed].max(dim=0).values for r in range(world)]
        )
        steps["last push->arrived"] = float((t[..., arrived] - later).median())
    if protocol is not None:
        # The cluster's sum after its CTAs' thread 0 stored (a stall there held every CTA of the cluster in v18's
        # dumps), and after its last warp stored and pushed its sum (per call: a one-row call is one cluster).
        done = t[..., EVENTS.index("summed")].max(dim=2).values
        for name in ("computed", "all computed", "all sent"):
            lag = done - t[..., EVENTS.index(name)].max(dim=2).values
            steps[f"{name}->summed (cluster)"] = float(lag.median())
            steps[f"p90 {name}->summed (cluster)"] = float(lag.quantile(0.9))
    return {k: v / 1e3 for k, v in steps.items()}


def main(argv: list[str] | None = None) -> int:
    from cute_kernels.compile import arch_for_device

    p = argparse.ArgumentParser(prog="python -m bench.experiments.peer_trace", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--protocol", nargs="+", default=["oneshot", "twoshot"])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dump", type=str, default=None, help="save every point's raw stamps (torch.save) here")
    p.add_argument(
        "--trigger",
        choices=["shipped", "end"],
        default="shipped",
        help="end: the PDL trigger after each CTA's last row (a diagnostic)",
    )
    p.add_argument(
        "--warp-stamps",
        action="store_true",
        help="W > 1: every warp also stamps its wait's exit, streams, shuffles, pushes and cluster sum",
    )
    args = p.parse_args(argv)
    if args.calls < RING + 8:
        p.error(f"--calls must be at least {RING + 8}: the last {RING} calls are kept, after 8 or more to settle")
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    raw = {}
    warp_raw = {}
    print(
        f"W > 1: SIMULATED ranks on one GPU (not NVLink); medians over ranks, the last {RING} calls and CTAs, us; "
        f"PDL trigger: {args.trigger}"
    )
    for world in args.world:
        trace = torch.zeros(world, RING, MAX_CTAS, len(EVENTS), 2, dtype=torch.int64, device=device)
        warps = None
        if args.warp_stamps and world > 1:
            warps = torch.zeros(world, RING, WARP_CTAS, WARPS, len(WARP_EVENTS), 2, dtype=torch.int64, device=device)
        counts = torch.zeros(MAX_CTAS, dtype=torch.int32, device=device)
        for hidden in args.hidden:
            ranks = (
                [] if world == 1 else BoundaryAllReduce.simulated(hidden, world, max_rows=max(args.rows), device=device)
            )
            for protocol in ["oneshot"] if world == 1 else args.protocol:
                with forced_protocol(protocol):
                    for rows in args.rows:
                        config = default_config(hidden, arch, world, world)
                        staged = world > 1 and config.clusters(rows) < rows
                        fn, _ = traced_kernel(
                            hidden,
                            world,
                            protocol,
                            staged,
                            arch,
                            trace.data_ptr(),
                            counts.data_ptr(),
                            trigger=args.trigger,
                            warp_base=None if warps is None else warps.data_ptr(),
                        )
                        if warps is not None:
                            warps.zero_()
                        ctas = config.cluster_n * config.clusters(rows)
                        stamps = trace_point(ranks, fn, trace, counts, hidden, rows, args.calls)
                        name = "one rank" if world == 1 else protocol
                        raw[(world, hidden, rows, name)] = stamps[:, :, :ctas].cpu()
                        if warps is not None:
                            warp_raw[(world, hidden, rows, name)] = warps[:, :, : min(ctas, WARP_CTAS)].cpu()
                        steps = summarize(stamps, ctas, None if world == 1 else protocol)
                        cells = "  ".join(f"{k} {v:5.2f}" for k, v in steps.items())
                        print(f"W={world} H={hidden} rows={rows:4d} {name:8s}  {cells}", flush=True)
    if args.dump:
        torch.save({"events": EVENTS, "stamps": raw, "warp_events": WARP_EVENTS, "warp_stamps": warp_raw}, args.dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
