"""The peer all-reduce role of the fused boundary (CONTRACT §7): a row's y from every rank's partial.

Each thread pushes its own 16-byte vectors of its rank's partial and polls for the same vectors of the
other ranks, so the exchange needs no barrier and no flag besides the data: every 32-bit word of a
slot is the sentinel until its writer's store lands. The sum runs in rank order 0..W-1 in fp32 with
one bf16 rounding, on canonical words (a payload word equal to the sentinel travels, and is summed
by its own rank too, as 0), so every rank gets the same bits.

One-shot: every rank pushes its partial to every other rank and sums all W itself.
Two-shot: the owner of a segment (row, CTA column chunk) receives the W - 1 other partials, sums, and
pushes y to every other rank; the others wait for y. Half the bytes of one-shot for W > 2, one more hop.

A call whose clusters each take one row runs the exchange inline, row by row. A call whose clusters
take several rows (with a ready partial x) takes the staged kernel (its own variant, so that each
path has its own register allocation; the host knows the rows and the clusters), so that no row
waits for a push its peer has not issued yet: first every row's partial goes out, then (two-shot)
each owner waits for, sums and sends y of all its segments, and only then the row loop runs the
epilogue, y loaded with the row's other loads (one-shot: summed there from the slots, already full).

The slot generation of a call comes from the rank's call counter (protocol.CALL_UNIT): each warp reads
it, then adds its share (right away, or in the inline one-shot after its first row's pushes, which so go
out first), so no CTA counts itself at its end.

Every wait has a deadline (the call's start + the workspace's timeout; a two-shot wait for y, half a
timeout more, so that an owner stuck on a missing rank gives up, and names it, first): past it, the
thread records the ranks it is still missing in the error word and goes on with what it has, so the
call finishes (with wrong values) instead of hanging; later waits of the same call give up after one
look.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import VEC, ptx
from cute_kernels.allreduce.protocol import (
    CALL_SHIFT,
    CALL_UNIT,
    ERROR_MISSING,
    GENERATIONS,
    PROTOCOLS,
    SENTINEL_WORD,
    STATE_CALLS,
)


@dataclass(frozen=True)
class PeerState:
    """The exchange's part of a kernel's Ctx (W > 1), made by FusedBoundaryKernel.kernel: the workspace's tensors,
    what it reads of them at its start, and this call's generation and deadlines."""

    mSlots: cute.Tensor  # [generations, W + 1, max_rows, H] bf16, this rank's receive slots
    mPeers: cute.Tensor  # [W] int64, every rank's receive-slot base address
    mState: cute.Tensor  # [3] int32: the call counter, rank, timeout (us)
    table: list | None  # mPeers as read at the kernel's start; None: read where pushed (peer_table)
    rank: Int32  # this rank, read from mState at the kernel's start
    gen: Int32  # this call's slot generation (call_generation)
    deadline: Int64  # every wait's: the call's start + the workspace's timeout
    deadline_y: Int64  # a two-shot wait for y: half a timeout more (see the module's docstring)


class PeerReduce:
    """y of a row for this thread's `vpt` vectors, through the receive slots of `world_size` ranks. Its `ctx` is the
    kernel's (cute_kernels/boundary/loads.py Ctx): the row part, and this role's own in `ctx.peer` (PeerState)."""

    generations = GENERATIONS  # a class attribute, so that a test can build the one-generation control

    def __init__(self, H: int, world_size: int, protocol: str, vpt: int, cluster_n: int, *, staged: bool) -> None:
        assert world_size > 1 and protocol in PROTOCOLS and self.generations in (1, 2)
        self.H = H
        self.W = world_size
        self.protocol = protocol
        self.vpt = vpt
        self.cluster_n = cluster_n
        # Staged phases: rows of partial loads in flight while pushing, and owned rows whose loads and first polls
        # go out together (a window's poll registers, W x vpt x 4 words each, stay within 32 per thread).
        self.push_depth = max(1, 4 // vpt)
        # Staged rows load their slot words with their other loads: two-shot y, one-shot (up to W 4: W x vpt x 4
        # words live across a row) every partial.
        self.slots_with_row = staged and (protocol == "twoshot" or world_size <= 4)
        self.window = max(1, min(4, 8 // (world_size * vpt)))
        self.staged = staged  # every row's exchange goes out before the row loop (a ready partial x)

    @cute.jit
    def read_counter(self, mState: cute.Tensor) -> Int32:
        """Lane 0's read of the call counter (0 on the other lanes); nothing waits for it here."""
        addr = (mState.iterator + STATE_CALLS).toint()
        return Int32(ptx.ld_relaxed_gpu_b32_pred(addr, cute.arch.lane_idx() == 0))

    def adds_after_push(self) -> bool:
        """Whether a warp adds its share of the call counter after its first row's pushes (the inline one-shot, so
        that the pushes go out first: docs/PERF.md decisions: adds_after_push) rather than right after its read."""
        return not self.staged and self.protocol == "oneshot"

    @cute.jit
    def call_generation(self, mState: cute.Tensor, calls: Int32) -> Int32:
        """This call's slot generation from lane 0's read of the call counter (this warp's share goes in now, or
        after its first row's pushes: adds_after_push)."""
        share = None if const_expr(self.adds_after_push()) else self.warp_share()
        calls = cute.arch.shuffle_sync(calls, 0)
        if const_expr(share is not None):
            self.add_share(mState, share)
        gen = Int32(0)
        if const_expr(self.generations == 2):
            gen = (calls >> CALL_SHIFT) & 1  # the call index's parity (the counter may wrap: 2^16 calls is even)
        return gen

    @cute.jit
    def warp_share(self) -> Int32:
        """This warp's share of the call counter (protocol.CALL_UNIT)."""
        # Warp-uniform values: warp_idx() is a whole-warp shuffle, which must not run in a one-lane branch.
        bx, by, _ = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        tx, _, _ = cute.arch.block_dim()
        warps = gx * gy * (tx // 32)
        first = (bx == 0) & (by == 0) & (cute.arch.warp_idx() == 0)
        return Int32(cutlass.select_(first, Int32(CALL_UNIT) - (warps - 1), Int32(1)))

    @cute.jit
    def add_share(self, mState: cute.Tensor, share: Int32):
        """Lane 0 adds this warp's share to the call counter (after the warp's read of it)."""
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_add(mState.iterator + STATE_CALLS, share, sem="relaxed", scope="gpu")

    @cute.jit
    def owner(self, ctx, row: Int32) -> Int32:
        """The rank that reduces segment (row, this CTA's column chunk) in the two-shot protocol
        (protocol.segment_owner; the same for every thread of the CTA)."""
        return ((row % ctx.clusters) * self.cluster_n + ctx.cta + row // ctx.clusters) % self.W

    @cute.jit
    def offset(self, mSlots: cute.Tensor, gen: Int32, slot, row: Int32, vcol: Int32) -> Int64:
        """Byte offset of vector `vcol` of (generation, slot, row) in a rank's receive slots."""
        max_rows = mSlots.shape[2]
        cell = Int64(gen * (self.W + 1) + slot) * Int64(max_rows) + Int64(row)
        return (cell * self.H + Int64(vcol * VEC)) * 2

    @cute.jit
    def reduce(self, ctx, y: cute.Tensor, row: Int32, rSlot: cute.Tensor | None, later: Callable[[], Any]) -> tuple:
        """(y of `row`, fp32 holding bf16 values, (vpt, 8), from this rank's partial `y` and every peer's; what
        `later` returns). `later` is the row's other work that needs no y (its coefficient shuffles, which wait on
        a load, and the premix), done where no push waits for it and before the row waits: after an inline row's
        pushes (a two-shot owner pushes only y, after its wait: it does `later` first; without the premix a
        two-shot row does it after its exchange), before a staged row's (whose pushes went out before the row
        loop).
        `rSlot`: the row's slot words as loaded with the row (staged: row_slot_shape)."""
        vpt = const_expr(self.vpt)
        words = self.words(y)
        rIn = cute.make_rmem_tensor((self.W, vpt, 4), Uint32)
        rY = cute.make_rmem_tensor((vpt, 4), Uint32)
        if const_expr(self.staged):
            taken = later()  # the exchange went out before the row loop: nothing to wait for here
            self.staged_row(ctx, words, row, rIn, rY, rSlot)
        elif const_expr(self.protocol == "oneshot"):
            taken = self.oneshot(ctx, words, row, rIn, rY, later)
        else:
            taken = self.twoshot(ctx, words, row, rIn, rY, later)
        out = cute.make_rmem_tensor(y.layout, Float32)
        for v in cutlass.range_constexpr(vpt):
            for e in cutlass.range_constexpr(VEC):
                out[v, e] = ptx.bf16_lo(rY[v, e // 2]) if e % 2 == 0 else ptx.bf16_hi(rY[v, e // 2])
        return out, taken

    def words(self, y: cute.Tensor) -> list:
        """This thread's vectors of a partial as canonical bf16-pair words, [vpt][4]."""
        return [[canonical(ptx.cvt_bf16x2(y[v, e], y[v, e + 1])) for e in range(0, VEC, 2)] for v in range(self.vpt)]

    @cute.jit
    def push_rows(self, ctx, loads, first_row: Int32):
        """Push the partial of each of this cluster's rows to whoever sums it, `push_depth` rows' loads (by the
        kernel's loads role `loads`) in flight."""
        depth = const_expr(self.push_depth)
        bufs = [loads.regs() for _ in range(depth)]
        for d in cutlass.range_constexpr(depth):
            r = first_row + d * ctx.clusters
            if r < ctx.rows:
                if self.sends_partial(ctx, r):  # a two-shot owner's own partial is loaded when it sums
                    loads.load_partial(ctx, bufs[d], r)
        row = first_row
        while row < ctx.rows:
            for d in cutlass.range_constexpr(depth):
                r = row + d * ctx.clusters
                if r < ctx.rows:
                    words = self.words(loads.partial(ctx, bufs[d], r))
                    ahead = r + depth * ctx.clusters
                    if ahead < ctx.rows:
                        if self.sends_partial(ctx, ahead):
                            loads.load_partial(ctx, bufs[d], ahead)
                    if const_expr(self.protocol == "oneshot"):
                        self.push_partial(ctx, words, r)
                    else:
                        self.push_partial(ctx, words, r, self.owner(ctx, r), owned_here=True)
            row = row + depth * ctx.clusters

    @cute.jit
    def sends_partial(self, ctx, row: Int32) -> cutlass.Boolean:
        """Whether this rank pushes its partial of `row` in a staged call (two-shot: unless it owns the segment)."""
        sends = cutlass.Boolean(True)
        if const_expr(self.protocol == "twoshot"):
            sends = self.owner(ctx, row) != ctx.peer.rank
        return sends

    @cute.jit
    def reduce_owned(self, ctx, loads, first_row: Int32):
        """Two-shot: for each of this cluster's rows whose segment this rank owns, wait for the other partials,
        sum, and push y to every peer and into this rank's own y slot (read back and re-armed by this same thread
        in the row loop). Rows go `window` at a time: the owned ones' partial loads (by the kernel's loads role
        `loads`) and first polls all go out before the first is checked."""
        vpt = const_expr(self.vpt)
        window = const_expr(self.window)
        bufs = [loads.regs() for _ in range(window)]
        rIns = [cute.make_rmem_tensor((self.W, vpt, 4), Uint32) for _ in range(window)]
        rY = cute.make_rmem_tensor((vpt, 4), Uint32)
        sources = self.partial_sources(ctx)
        row = first_row
        while row < ctx.rows:
            for d in cutlass.range_constexpr(window):
                r = row + d * ctx.clusters
                if r < ctx.rows:
                    if self.owner(ctx, r) == ctx.peer.rank:
                        loads.load_partial(ctx, bufs[d], r)
                        self.issue(ctx, rIns[d], r, sources)
            for d in cutlass.range_constexpr(window):
                r = row + d * ctx.clusters
                if r < ctx.rows:
                    if self.owner(ctx, r) == ctx.peer.rank:
                        self.wait(ctx, rIns[d], r, sources, ctx.peer.deadline, self.missing(ctx, rIns[d], sources))
                        self.rank_sum(ctx, self.words(loads.partial(ctx, bufs[d], r)), rIns[d], rY)
                        self.send_y(ctx, rY, r, keep=True)
                        self.rearm(ctx, r, sources)
            row = row + window * ctx.clusters

    def row_slot_shape(self) -> tuple:
        """The words a staged row loads from its slots with its other loads: two-shot y, one-shot every partial."""
        return (self.vpt, 4) if self.protocol == "twoshot" else (self.W, self.vpt, 4)

    @cute.jit
    def prefetch_slots(self, ctx, rSlot: cute.Tensor, row: Int32):
        """Issue a staged row's slot loads with the row's other loads (nothing waits for them here)."""
        if const_expr(self.protocol == "twoshot"):
            self.prefetch_y(ctx, rSlot, row)
        else:
            self.issue(ctx, rSlot, row, self.partial_sources(ctx))

    @cute.jit
    def prefetch_y(self, ctx, rSlot: cute.Tensor, row: Int32):
        """Issue the load of a staged two-shot row's y slot with the row's other loads."""
        base = ctx.peer.mSlots.iterator.toint()
        for v in cutlass.range_constexpr(self.vpt):
            addr = base + self.offset(ctx.peer.mSlots, ctx.peer.gen, self.W, row, ctx.vcols[v])
            want = self.real(ctx, v)
            w = ptx.ld_sys_v4_pred(addr, cutlass.Boolean(True) if want is None else want)
            for k in cutlass.range_constexpr(4):
                rSlot[v, k] = w[k]

    @cute.jit
    def staged_row(self, ctx, words: list, row: Int32, rIn: cute.Tensor, rY: cute.Tensor, rSlot: cute.Tensor | None):
        """A row of the staged row loop. One-shot: the slots as loaded with the row (full, or nearly), polled on
        where not, summed and re-armed. Two-shot:
        y as loaded with the row (the owner's own, or a peer's once it has landed), its slot re-armed."""
        if const_expr(self.protocol == "oneshot"):
            sources = self.partial_sources(ctx)
            if const_expr(self.slots_with_row):
                rIn = rSlot
                self.wait(ctx, rIn, row, sources, ctx.peer.deadline, self.missing(ctx, rIn, sources))
            else:
                self.wait(ctx, rIn, row, sources, ctx.peer.deadline)
            self.rank_sum(ctx, words, rIn, rY)
            self.rearm(ctx, row, sources)
        else:
            owner = self.owner(ctx, row)
            for v in cutlass.range_constexpr(self.vpt):
                for k in cutlass.range_constexpr(4):
                    rY[v, k] = rSlot[v, k]
            if owner != ctx.peer.rank:
                late = cutlass.Boolean(False)
                for v in cutlass.range_constexpr(self.vpt):
                    want = self.real(ctx, v)
                    for k in cutlass.range_constexpr(4):
                        miss = rSlot[v, k] == Uint32(SENTINEL_WORD)
                        late = late | (miss if const_expr(want is None) else miss & want)
                if late:
                    self.wait_y(ctx, row, owner, rIn, rY)
            # Owners change with the call's cluster count: the owner's own copy is re-armed too.
            self.rearm(ctx, row, [(self.W, owner, None)])

    @cute.jit
    def oneshot(self, ctx, words: list, row: Int32, rIn: cute.Tensor, rY: cute.Tensor, later: Callable[[], Any]):
        """Push this rank's vectors into slot `rank` of every peer, do `later` (returned), wait for the W - 1
        others, sum them all."""
        self.push_partial(ctx, words, row)
        if const_expr(self.adds_after_push()):
            if row < ctx.clusters:  # this cluster's first row
                self.add_share(ctx.peer.mState, self.warp_share())
        taken = later()
        sources = self.partial_sources(ctx)
        self.wait(ctx, rIn, row, sources, ctx.peer.deadline)
        self.rank_sum(ctx, words, rIn, rY)
        self.rearm(ctx, row, sources)
        return taken

    @cute.jit
    def twoshot(self, ctx, words: list, row: Int32, rIn: cute.Tensor, rY: cute.Tensor, later: Callable[[], Any]):
        """Not the owner: push this rank's partial into the owner's slot `rank`, do `later` (returned; without the
        premix: last), wait for y in slot W. The owner: do `later`, wait for the W - 1 other partials, sum, push y to
        every peer."""
        # Without the premix (its cells absent: a MoE partial) `later` is the coefficient shuffles alone, done after
        # the exchange, where they delay no push (docs/PERF.md decisions: PeerReduce.twoshot).
        premix = ctx.sMix is not None
        owner = self.owner(ctx, row)
        if owner != ctx.peer.rank:
            self.push_partial(ctx, words, row, owner)
        taken = None
        if const_expr(premix):
            taken = later()
        if owner != ctx.peer.rank:
            self.wait_y(ctx, row, owner, rIn, rY)
            self.rearm(ctx, row, [(self.W, owner, None)])
        else:
            self.reduce_and_send(ctx, words, row, rIn, rY)
        if const_expr(not premix):
            taken = later()
        return taken

    @cute.jit
    def reduce_and_send(self, ctx, words: list, row: Int32, rIn: cute.Tensor, rY: cute.Tensor):
        """Two-shot, the owner: the W - 1 other partials, the rank-order sum, y into slot W of every peer."""
        sources = self.partial_sources(ctx)
        self.wait(ctx, rIn, row, sources, ctx.peer.deadline)
        self.rank_sum(ctx, words, rIn, rY)
        self.send_y(ctx, rY, row, keep=False)
        self.rearm(ctx, row, sources)

    def partial_sources(self, ctx) -> list:
        """The wait sources of every rank's partial of a row: (slot, rank it comes from, needed: not this rank's)."""
        return [(s, Int32(s), ctx.peer.rank != s) for s in range(self.W)]

    @cute.jit
    def wait_y(self, ctx, row: Int32, owner: Int32, rIn: cute.Tensor, rY: cute.Tensor):
        """Two-shot, not the owner: wait for the owner's y in slot W of `row` and take it into rY."""
        self.wait(ctx, rIn, row, [(self.W, owner, None)], ctx.peer.deadline_y)
        for v in cutlass.range_constexpr(self.vpt):
            for k in cutlass.range_constexpr(4):
                rY[v, k] = rIn[0, v, k]

    @cute.jit
    def push_partial(self, ctx, words: list, row: Int32, owner: Int32 | None = None, owned_here: bool = False):
        """This rank's vectors of `row` into slot `rank` of every other rank (one-shot: `owner` None) or of the
        segment's owner (two-shot; `owned_here`: the owner may be this rank, which then pushes nothing)."""
        peers = self.peer_table(ctx)
        peer = None if const_expr(owner is None) else self.peer_base(peers, owner)
        for v in cutlass.range_constexpr(self.vpt):
            mine = self.offset(ctx.peer.mSlots, ctx.peer.gen, ctx.peer.rank, row, ctx.vcols[v])
            if const_expr(owner is None):
                for p in cutlass.range_constexpr(self.W):
                    self.push(ctx, peers[p] + mine, words[v], self.real(ctx, v, ctx.peer.rank != p))
            else:
                self.push(ctx, peer + mine, words[v], self.real(ctx, v, owner != ctx.peer.rank if owned_here else None))

    @cute.jit
    def send_y(self, ctx, rY: cute.Tensor, row: Int32, keep: bool):
        """The owner's y into slot W of every other rank and, with `keep` (staged), of its own, which this same
        thread reads back. y travels (and is used) in canonical words, so that every rank has the same zero signs."""
        base = ctx.peer.mSlots.iterator.toint() if const_expr(keep) else None
        peers = self.peer_table(ctx)
        for v in cutlass.range_constexpr(self.vpt):
            y_words = [canonical(rY[v, k]) for k in range(4)]
            for k in cutlass.range_constexpr(4):
                rY[v, k] = y_words[k]
            reduced = self.offset(ctx.peer.mSlots, ctx.peer.gen, self.W, row, ctx.vcols[v])
            for p in cutlass.range_constexpr(self.W):
                self.push(ctx, peers[p] + reduced, y_words, self.real(ctx, v, ctx.peer.rank != p))
            if const_expr(keep):
                ptx.st_global_v4_pred(base + reduced, *y_words, self.real(ctx, v))

    def peer_table(self, ctx) -> list:
        """Every rank's receive-slot base address: as the kernel read them at its start, or (no table) loaded here, all
        before any is used."""
        if ctx.peer.table is not None:
            return ctx.peer.table
        return [ctx.peer.mPeers[p] for p in range(self.W)]

    def peer_base(self, peers: list, rank: Int32) -> Int64:
        """Rank `rank`'s receive-slot base address from the table."""
        base = peers[0]
        for p in range(1, self.W):
            base = Int64(cutlass.select_(rank == p, peers[p], base))
        return base

    def real(self, ctx, v: int, needed: cutlass.Boolean | None = None) -> cutlass.Boolean | None:
        """Whether this thread's vector v is a real one (threads past the chunk hold a clamped duplicate)
        and `needed`; None when both always hold (a constant predicate must not reach the PTX)."""
        if ctx.valid[v] is None:
            return needed
        return ctx.valid[v] if needed is None else needed & ctx.valid[v]

    @cute.jit
    def push(self, ctx, addr: Int64, words: list, pred: cutlass.Boolean):
        """One 16-byte vector into a peer's slot (st.relaxed.sys: the peer polls the words)."""
        ptx.st_sys_v4_pred(addr, words[0], words[1], words[2], words[3], pred)

    @cute.jit
    def issue(self, ctx, rIn: cute.Tensor, row: Int32, sources: list):
        """One round of loads of slots `sources` = [(slot, rank it comes from, needed)] of `row` into rIn[i];
        nothing waits for them here."""
        base = ctx.peer.mSlots.iterator.toint()
        for i in cutlass.range_constexpr(len(sources)):
            slot, _, needed = sources[i]
            for v in cutlass.range_constexpr(self.vpt):
                want = self.real(ctx, v, needed)
                addr = base + self.offset(ctx.peer.mSlots, ctx.peer.gen, slot, row, ctx.vcols[v])
                w = ptx.ld_sys_v4_pred(addr, cutlass.Boolean(True) if want is None else want)
                for k in cutlass.range_constexpr(4):
                    rIn[i, v, k] = w[k]

    @cute.jit
    def missing(self, ctx, rIn: cute.Tensor, sources: list) -> Int32:
        """The mask of the ranks whose needed words in rIn (as issued) still hold the sentinel."""
        missing = Int32(0)
        for i in cutlass.range_constexpr(len(sources)):
            _, who, needed = sources[i]
            for v in cutlass.range_constexpr(self.vpt):
                want = self.real(ctx, v, needed)
                late = rIn[i, v, 0] == Uint32(SENTINEL_WORD)
                for k in cutlass.range_constexpr(1, 4):
                    late = late | (rIn[i, v, k] == Uint32(SENTINEL_WORD))
                if const_expr(want is not None):
                    late = late & want
                missing = missing | Int32(cutlass.select_(late, Int32(1) << who, Int32(0)))
        return missing

    @cute.jit
    def wait(self, ctx, rIn: cute.Tensor, row: Int32, sources: list, deadline: Int64, pending: Int32 | None = None):
        """Load slots `sources` of `row` into rIn[i] until no needed word holds the sentinel, or `deadline` has
        passed (then the missing ranks go to the error word). `pending`: the mask of a round issued and checked
        already (earlier, with the row's loads): nothing more when it is 0, else the wait starts afresh."""
        if const_expr(pending is None and self.W <= 4):
            # A loop whose first look is its own body at W 2 and 4, the form below at W 8: each where it is the
            # faster (docs/PERF.md decisions: PeerReduce.wait).
            pending = Int32(1)
            while pending != 0:
                self.issue(ctx, rIn, row, sources)  # every slot's loads are in flight before any is checked
                pending = self.missing(ctx, rIn, sources)
                if pending != 0:
                    if ptx.globaltimer() > deadline:
                        self.report_missing(ctx, pending)
                        pending = Int32(0)
        else:
            if const_expr(pending is None):
                self.issue(ctx, rIn, row, sources)
                pending = self.missing(ctx, rIn, sources)
            else:
                if pending != 0:  # that look may predate the deadline: a fresh one decides
                    self.issue(ctx, rIn, row, sources)
                    pending = self.missing(ctx, rIn, sources)
            while pending != 0:
                if ptx.globaltimer() > deadline:
                    self.report_missing(ctx, pending)
                    pending = Int32(0)
                else:
                    self.issue(ctx, rIn, row, sources)
                    pending = self.missing(ctx, rIn, sources)

    @cute.jit
    def report_missing(self, ctx, missing: Int32):
        """The ranks of mask `missing` into the error word (a wait's deadline has passed)."""
        cute.arch.atomic_or(ctx.mError.iterator + ERROR_MISSING, missing, sem="relaxed", scope="gpu")

    @cute.jit
    def rank_sum(self, ctx, words: list, rIn: cute.Tensor, rY: cute.Tensor):
        """rY = bf16(sum over s = 0..W-1 in order of partial s), this rank's own from `words`."""
        for v in cutlass.range_constexpr(self.vpt):
            for k in cutlass.range_constexpr(4):
                halves = []
                for h in cutlass.range_constexpr(2):
                    acc = Float32(0.0)
                    for s in cutlass.range_constexpr(self.W):
                        word = Uint32(cutlass.select_(ctx.peer.rank == s, words[v][k], rIn[s, v, k]))
                        term = ptx.bf16_lo(word) if h == 0 else ptx.bf16_hi(word)
                        acc = term if s == 0 else ptx.add_rn(acc, term)
                    halves.append(acc)
                rY[v, k] = ptx.cvt_bf16x2(halves[0], halves[1])

    @cute.jit
    def rearm(self, ctx, row: Int32, sources: list):
        """Write the sentinel back into the slots this call consumed (no peer writes them before call k + 2)."""
        base = ctx.peer.mSlots.iterator.toint()
        s = Uint32(SENTINEL_WORD)
        for i in cutlass.range_constexpr(len(sources)):
            slot, _, needed = sources[i]
            for v in cutlass.range_constexpr(self.vpt):
                addr = base + self.offset(ctx.peer.mSlots, ctx.peer.gen, slot, row, ctx.vcols[v])
                ptx.st_global_v4_pred(addr, s, s, s, s, self.real(ctx, v, needed))


def canonical(word: Uint32) -> Uint32:
    """A payload word as it travels: the sentinel's bit pattern (a -0.0 beside a +0.0) becomes 0."""
    return Uint32(cutlass.select_(word == Uint32(SENTINEL_WORD), Uint32(0), word))
