"""The projection role: a CTA's K slice of one row tile, multiplied on the tensor cores and summed in a
fixed order, then handed to the CTA that finishes the rows.

Per row t: mixes = (x . fn) * rsqrt(sum x^2 / K + rms_eps) over the K = 4H stream columns (or the H
embedding columns of the broadcast variant). The K columns are split into S = 8*G CTA slices (a function
of H only, never of the row count: config.projection_split); CTA slice s, warp w owns the 32 columns
[(s*W + w)*32, +32). A warp reads its fn slice once (fp32, split into bf16 hi + lo, which is exact to
2^-17) and then, for each 16-row m-tile of its row tile, multiplies the bf16 rows by it on the tensor
cores (mma.sync m16n8k16, fp32 accumulation): 3 n-tiles x (hi, lo) give the 24 dot products, and the
rows' Gram block (the A fragment doubles as B) gives the sums of squares on its diagonal. The k order
inside a fragment is permuted (a lane holds 8 contiguous columns) identically for A and B. With
config.row_split > 1 several warps share a 32-column chunk, each with its own m-tiles.

Reduction, in a fixed order for every row: warps 0..W-1 of a CTA (shared memory), then the 8 CTAs of a
thread-block cluster (each CTA owns TM/8 rows of the tile and receives every peer's partials for them
with st.async into its shared memory), then the G clusters (global workspace partials [G, rows, 25]; a
written partial never has the sentinel's bits, NaN rows included). Ticket handoff: each CTA takes a
ticket when it starts; the last of the G to start (so every other one is resident and will finish)
keeps its own partial, polls the others' slots until none holds the NaN sentinel, sums the G partials
in order and runs the epilogue on its share of the rows. It puts the counter back to 0 and the slots
back to the sentinel, so every call and every CUDA-graph replay starts clean.

Schedule "partials": the same CTAs without the cluster exchange. Each stores its warp-ordered sums into
the workspace's rank_partials [G*8, rows, 25] and exits; the epilogue's finish kernel adds them in the
very order of the tile schedule. Without a layer input its CTAs may take 256 or 512 rows (more 64-row
batches with fn held) and stage their rows in shared memory by cp.async (config.stage_rows), which keeps
ptxas from issuing a CTA's row loads only after its fn round trip (docs/PERF.md decisions: stage_rows).

PDL: before griddepcontrol.wait a CTA reads only weights (fn, scale, base); the rows and the workspace
come after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels import ptx as prim
from cute_kernels import reduce
from cute_kernels.coefficients.config import (
    CHUNK,
    CLUSTER,
    HC,
    MIX,
    NV,
    WARP,
    CoefficientsConfig,
    projection_width,
)
from cute_kernels.coefficients.epilogue import EpilogueRole

CANONICAL_NAN = 0x7FFFFFFF  # what the GPU's arithmetic gives for every NaN result
# The value of an empty workspace partial slot: a NaN that arithmetic never produces (the GPU's NaN
# results are the canonical 0x7FFFFFFF), so a slot holding it has not been written yet.
SENTINEL = -4137299  # 0xFFC0DEAD as int32: a negative quiet NaN with a payload


def not_sentinel(x: Float32) -> Float32:
    """x, or the canonical NaN where x has the sentinel's bits (arithmetic never gives them, this makes
    sure): a written workspace slot never reads as empty, so a NaN row cannot stall the poll."""
    bits = Float32(x).bitcast(Int32)
    return Int32(cutlass.select_(bits == Int32(SENTINEL), Int32(CANONICAL_NAN), bits)).bitcast(Float32)


class ProjectionRole:
    """The projection CTAs of one compile-time shape: split along K, row tile, batches, staging."""

    def __init__(self, H: int, broadcast: bool, config: CoefficientsConfig, epilogue: EpilogueRole) -> None:
        self.epilogue = epilogue
        self.K = projection_width(H, broadcast)
        self.row_stride = H if broadcast else HC * H  # elements per row of the input tensor
        self.warps = config.warps  # 32-column chunks per CTA
        self.groups = config.groups  # clusters along K
        self.tm = config.rows_per_tile
        self.row_split = config.row_split
        self.cta_warps = self.warps * config.row_split
        self.threads = config.threads
        self.share = self.tm // CLUSTER  # rows of a tile each CTA of a cluster finishes
        self.mtiles_per_batch = min(4, self.tm // 16)
        if self.mtiles_per_batch % self.row_split:
            # A warp would get no m-tile (or some none): its columns' products would be missing from every row.
            raise ValueError(
                f"row_split {self.row_split} must divide the {self.mtiles_per_batch} 16-row m-tiles of a batch "
                f"(rows_per_tile {self.tm})"
            )
        self.mtiles_per_warp = self.mtiles_per_batch // self.row_split
        self.batches = self.tm // (16 * self.mtiles_per_batch)
        self.batch_rows = 16 * self.mtiles_per_batch
        self.stage_rows = config.stage_rows
        self.stage_slots = config.stage_depth or self.batches  # batch slots of the staging buffer
        self.sum_buffers = config.sum_buffers
        self.push_vec = config.push_vec

    # -----------------------------------------------------------------------------------------
    # Schedule "tile": exchange in the cluster, ticket handoff, the last CTA finishes the rows
    # -----------------------------------------------------------------------------------------

    @cute.jit
    def tile_cta(
        self,
        smem: cutlass.memory.SmemAllocator,
        mbar: cute.Pointer,
        mX: cute.Tensor,
        mFn: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        rank: Int32,
        cluster: Int32,
        own_args: tuple | None = None,
    ):
        """One CTA of a projection cluster: its K slice of one row tile, then its share of the rows (with `own_args`,
        (mX, mW, mOut, mQ, mScale, norm_eps), also their own-pre layer input: EpilogueRole.finish_rows)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane, split, tile, group, row0, tile_rows, col = self.cta_coords(mX, rank, cluster)
        share_rows = cutlass.max(cutlass.min(tile_rows - rank * self.share, self.share), 0)

        sWarp = smem.allocate_tensor(Float32, cute.make_layout(self.warps * self.batch_rows * NV), byte_alignment=16)
        sRecv = smem.allocate_tensor(Float32, cute.make_layout(CLUSTER * self.share * NV), byte_alignment=16)
        sMix = smem.allocate_tensor(Float32, cute.make_layout(self.share * NV), byte_alignment=16)
        sParam = smem.allocate_tensor(Float32, cute.make_layout(3 + MIX), byte_alignment=16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        own = self.epilogue.own_tile if const_expr(own_args is not None) else None
        own_buffers = own.allocate(smem, self.share) if const_expr(own is not None) else None

        # Weights before the wait (the previous kernel does not write them): this warp's fn slice, and
        # scale / base for whichever CTA ends up running the epilogue.
        fn = self.load_fn(mFn, col, lane)
        if tidx < 3:
            sParam[tidx] = mScale[tidx]
        if tidx < MIX:
            sParam[3 + tidx] = mBase[tidx]
        cute.arch.griddepcontrol_wait()
        counter = mCounter.iterator + (tile * CLUSTER + rank)
        ticket = Int32(0)
        hi, lo = None, None
        words = self.load_rows(mX, row0, col, lane, split)
        if const_expr(own is not None):
            if const_expr(own.mxfp8 is not None):
                # The MXFP8 scale padding, a share per CTA of the grid (one consumer CTA alone took ~2 us at 1 row),
                # once the rows' loads are in flight (before them it cost 0.69 us at 7168 x 1, perf-log v42).
                _, clusters, _ = cute.arch.grid_dim()
                own.zero_padding_share(own_args[4], mX.shape[0], cluster * CLUSTER + rank, clusters * CLUSTER)
        for b in cutlass.range_constexpr(self.batches):
            batch_row0 = b * self.batch_rows
            if const_expr(b == 0):
                # Take this CTA's ticket while the first rows are in flight.
                if tidx == 0:
                    if share_rows > 0:
                        ticket = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
                # Split fn once the first rows are in flight, not before the wait.
                hi, lo = self.split_fn(fn)
            self.project_batch(words, hi, lo, sWarp, tile_rows - batch_row0, warp, lane, split)
            if const_expr(b == self.batches - 1):
                cute.arch.griddepcontrol_launch_dependents()
            if const_expr(b == 0):
                if tidx == 0:
                    last = Int32(0)
                    if ticket == self.groups - 1:
                        # The last of the G to start: every other CTA of these rows is resident.
                        last = Int32(1)
                        cute.arch.store(counter, Int32(0))
                    sFlag[0] = last
            cute.arch.sync_threads()
            if const_expr(b == 0):
                cute.arch.cluster_wait()
                if tidx < WARP:
                    if share_rows > 0:
                        reduce.expect_bytes(mbar, CLUSTER * self.pushed(share_rows) * 4)
            self.push_batch(sWarp, sRecv, mbar, rank, batch_row0, tile_rows)
            if const_expr(b < self.batches - 1):
                words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
                cute.arch.sync_threads()

        if share_rows > 0:
            cute.arch.mbarrier_wait(mbar, 0)
            share_row0 = row0 + rank * self.share
            consumer = sFlag[0] != 0
            for e in cutlass.range(tidx, share_rows * NV, self.threads):
                # This cluster's partial of the share rows: peers summed in rank order.
                acc = self.cluster_sum(sRecv, e)
                grow = share_row0 + e // NV
                n = e % NV
                if consumer:
                    sMix[e] = self.gather_partials(mPartial, group, grow, n, acc)
                else:
                    ptr = mPartial.iterator + cute.crd2idx((group, grow, n), mPartial.layout)
                    cute.arch.store(ptr, not_sentinel(acc), sem="relaxed", scope="gpu")
            if consumer:
                cute.arch.sync_threads()
                self.epilogue.finish_rows(
                    sMix,
                    sParam,
                    share_row0,
                    share_rows,
                    mPost,
                    mComb,
                    mPre,
                    rms_eps,
                    pre_eps,
                    sinkhorn_eps,
                    post_mult,
                    own,
                    own_buffers,
                    own_args,
                )

    @cute.jit
    def push_batch(
        self, sWarp: cute.Tensor, sRecv: cute.Tensor, mbar: cute.Pointer, rank: Int32, batch_row0: int, tile_rows: Int32
    ):
        """Sum the warps' partials of a batch (warp order) and push each row to the CTA that owns it."""
        tidx, _, _ = cute.arch.thread_idx()
        rows_here = cutlass.max(cutlass.min(tile_rows - batch_row0, self.batch_rows), 0)
        seg = const_expr(self.share * NV)  # elements of one owner's rows
        if const_expr(self.push_vec):
            # 4 elements per store. seg, stride and batch_row0 * NV are multiples of 4, so a vector
            # never straddles two owners; the last one of an owner may run past its rows (padding
            # that nobody reads, counted by pushed()).
            for v in cutlass.range(tidx, (rows_here * NV + 3) // 4, self.threads):
                e = cute.assume(v * 4, divby=4)
                accs = []
                for k in cutlass.range_constexpr(4):
                    accs.append(self.warp_sum(sWarp, e + k))
                flat = batch_row0 * NV + e
                owner = flat // seg
                slot = cute.assume(rank * seg + flat - owner * seg, divby=4)
                reduce.push(sRecv.iterator + slot, tuple(accs), mbar, owner)
        else:
            for e in cutlass.range(tidx, rows_here * NV, self.threads):
                acc = self.warp_sum(sWarp, e)
                flat = batch_row0 * NV + e  # element index within the tile
                owner = flat // seg
                slot = rank * seg + flat - owner * seg
                reduce.push(sRecv.iterator + slot, acc, mbar, owner)

    def pushed(self, share_rows: Int32) -> Int32:
        """Elements each CTA of the cluster pushes to an owner of `share_rows` rows (whole vectors with push_vec)."""
        if const_expr(self.push_vec):
            return (share_rows * NV + 3) // 4 * 4
        return share_rows * NV

    @cute.jit
    def warp_sum(self, sWarp: cute.Tensor, e: Int32) -> Float32:
        """Element e of a batch's partials summed over the CTA's warps in warp order."""
        acc = sWarp[e]
        for w in cutlass.range_constexpr(1, self.warps):
            acc = acc + sWarp[w * (self.batch_rows * NV) + e]
        return acc

    @cute.jit
    def cluster_sum(self, sRecv: cute.Tensor, e: Int32) -> Float32:
        """Element e of the share rows summed over the cluster's CTAs in rank order."""
        acc = sRecv[e]
        for r in cutlass.range_constexpr(1, CLUSTER):
            acc = acc + sRecv[r * (self.share * NV) + e]
        return acc

    @cute.jit
    def gather_partials(self, mPartial: cute.Tensor, group: Int32, row: Int32, n: Int32, own: Float32) -> Float32:
        """The sum over the G groups in order of one partial, this CTA's own for `group`: polls the
        other slots (all G reads in flight per round) until none holds the sentinel, then clears them."""
        pending = Int32(1)
        total = Float32(0.0)
        while pending != 0:
            vals = [self.load_partial(mPartial, g, row, n) for g in range(self.groups)]
            pending = Int32(0)
            total = own
            for g in cutlass.range_constexpr(self.groups):
                unset = vals[g].bitcast(Int32) == Int32(SENTINEL)
                pending = pending + cutlass.select_(unset & (group != g), Int32(1), Int32(0))
                v = cutlass.select_(group == g, own, vals[g])
                if const_expr(g > 0):
                    total = total + v
                else:
                    total = v
        self.clear_partials(mPartial, row, n)
        return total

    @cute.jit
    def clear_partials(self, mPartial: cute.Tensor, row: Int32, n: Int32):
        """Put the sentinel back in the G slots of one partial, for the next call."""
        for g in cutlass.range_constexpr(self.groups):
            ptr = mPartial.iterator + cute.crd2idx((g, row, n), mPartial.layout)
            cute.arch.store(ptr, Int32(SENTINEL).bitcast(Float32), sem="relaxed", scope="gpu")

    @cute.jit
    def load_partial(self, mPartial: cute.Tensor, g: int, row: Int32, n: Int32) -> Float32:
        """One workspace partial, read at gpu scope (it was written by another CTA of this launch)."""
        ptr = mPartial.iterator + cute.crd2idx((g, row, n), mPartial.layout)
        return cute.arch.load(ptr, Float32, sem="relaxed", scope="gpu")

    # -----------------------------------------------------------------------------------------
    # Schedule "partials": CTA sums to the workspace, no exchange, no handoff
    # -----------------------------------------------------------------------------------------

    @cute.jit
    def partials_cta(
        self,
        smem: cutlass.memory.SmemAllocator,
        mX: cute.Tensor,
        mFn: cute.Tensor,
        mRank: cute.Tensor,
        rank: Int32,
        cluster: Int32,
    ):
        """CTA (rank, tile, group) of the tile schedule without the cluster exchange: its K slice of one row
        tile, summed over its warps in warp order (store_sums), into slot group * 8 + rank of mRank
        [G * 8, T, 25]."""
        tidx, _, _ = cute.arch.thread_idx()
        sum_words = const_expr(self.warps * self.batch_rows * NV)
        sSums = smem.allocate_tensor(Float32, cute.make_layout(self.sum_buffers * sum_words), byte_alignment=16)
        warp, lane, split, tile, group, row0, tile_rows, col = self.cta_coords(mX, rank, cluster)
        slot = group * CLUSTER + rank
        sStage = None
        if const_expr(self.stage_rows):
            # [batch][CTA warp][m-tile][half] 128 words: a lane's 16 bytes at 4 * lane.
            sStage = smem.allocate_tensor(
                Int32,
                cute.make_layout(self.stage_slots * self.cta_warps * self.mtiles_per_warp * 2 * WARP * 4),
                byte_alignment=16,
            )
        fn = self.load_fn(mFn, col, lane)
        cute.arch.griddepcontrol_wait()
        words = None
        if const_expr(self.stage_rows):
            for b in cutlass.range_constexpr(self.stage_slots):
                self.copy_rows(mX, sStage, row0 + b * self.batch_rows, b, col, warp, lane, split)
                cute.arch.cp_async_commit_group()
        else:
            words = self.load_rows(mX, row0, col, lane, split)
        hi, lo = self.split_fn(fn)
        for b in cutlass.range_constexpr(self.batches):
            batch_row0 = b * self.batch_rows
            current = words
            if const_expr(self.stage_rows):
                # The copies of the batches after b issued so far may still be in flight.
                cute.arch.cp_async_wait_group(min(self.batches, self.stage_slots + b) - 1 - b)
                current = self.staged_rows(sStage, b % self.stage_slots, warp, lane, split)
            sWarp = cute.make_tensor(sSums.iterator + (b % self.sum_buffers) * sum_words, cute.make_layout(sum_words))
            self.project_batch(current, hi, lo, sWarp, tile_rows - batch_row0, warp, lane, split)
            if const_expr(self.stage_rows and b + self.stage_slots < self.batches):
                # The MMAs above consumed this slot's words, so the lane may refill it.
                ahead = b + self.stage_slots
                self.copy_rows(
                    mX, sStage, row0 + ahead * self.batch_rows, ahead % self.stage_slots, col, warp, lane, split
                )
                cute.arch.cp_async_commit_group()
            if const_expr(b == self.batches - 1):
                cute.arch.griddepcontrol_launch_dependents()
            cute.arch.sync_threads()
            rows_here = cutlass.max(cutlass.min(tile_rows - batch_row0, self.batch_rows), 0)
            self.store_sums(sWarp, mRank, slot, row0 + batch_row0, rows_here)
            if const_expr(b < self.batches - 1):
                if const_expr(not self.stage_rows):
                    words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
                if const_expr(self.sum_buffers == 1):
                    # With two buffers, the barrier after the next batch's MMAs orders these reads
                    # before the batch after it writes this buffer again.
                    cute.arch.sync_threads()

    @cute.jit
    def store_sums(self, sWarp: cute.Tensor, mRank: cute.Tensor, slot: Int32, grow0: Int32, rows_here: Int32):
        """A batch's partials summed over the CTA's warps in warp order (warp_sum's additions) into
        mRank[slot, grow0 + r, n], 4 consecutive elements per thread: [rows][25] is contiguous both in a
        warp's block of sWarp and in mRank, so no thread divides by 25."""
        tidx, _, _ = cute.arch.thread_idx()
        block = const_expr(self.batch_rows * NV)  # one warp's partials; a multiple of 4
        vecs = const_expr(block // 4)
        count = rows_here * NV
        dst = mRank.iterator + cute.crd2idx((slot, grow0, 0), mRank.layout)
        for k in cutlass.range_constexpr(-(-vecs // self.threads)):
            e = (tidx + k * self.threads) * 4
            if e < count:  # count <= block: rows_here is at most a batch
                total = prim.ld_v4_f32(sWarp.iterator + e)
                for w in cutlass.range_constexpr(1, self.warps):
                    part = prim.ld_v4_f32(sWarp.iterator + (w * block + e))
                    total = tuple(total[i] + part[i] for i in range(4))
                for i in cutlass.range_constexpr(4):
                    if e + i < count:
                        cute.arch.store(dst + (e + i), total[i])

    def stage_slot(
        self, sStage: cute.Tensor, b: int, warp: Int32, lane: Int32, split, i: int, half: int
    ) -> cute.Pointer:
        """Where a lane's 16 bytes of (batch b, m-tile i of its split, half) sit in the staging buffer."""
        cta_warp = split * self.warps + warp
        return (
            sStage.iterator
            + ((((b * self.cta_warps + cta_warp) * self.mtiles_per_warp + i) * 2 + half) * WARP + lane) * 4
        )

    @cute.jit
    def copy_rows(
        self,
        mX: cute.Tensor,
        sStage: cute.Tensor,
        batch_row: Int32,
        b: int,
        col: Int32,
        warp: Int32,
        lane: Int32,
        split,
    ):
        """load_rows into this lane's staging slots of batch slot b with cp.async (rows past the end read
        the last row; a batch wholly past the end copies nothing, and its MMAs are skipped)."""
        if batch_row < mX.shape[0]:
            for i in cutlass.range_constexpr(self.mtiles_per_warp):
                for half in cutlass.range_constexpr(2):
                    src = self.row_piece(mX, batch_row, col, lane, split, i, half)
                    prim.cp_async_16(self.stage_slot(sStage, b, warp, lane, split, i, half), src)

    @cute.jit
    def staged_rows(self, sStage: cute.Tensor, b: int, warp: Int32, lane: Int32, split) -> list:
        """This lane's words of batch b back from its staging slots, shaped as load_rows returns them."""
        return [
            [prim.ld_v4_i32(self.stage_slot(sStage, b, warp, lane, split, i, half)) for half in range(2)]
            for i in range(self.mtiles_per_warp)
        ]

    # -----------------------------------------------------------------------------------------
    # Both schedules: coordinates, fn, rows, the MMA mainloop
    # -----------------------------------------------------------------------------------------

    @cute.jit
    def cta_coords(self, mX: cute.Tensor, rank: Int32, cluster: Int32) -> tuple:
        """(warp, lane, split, tile, group, row0, tile_rows, col) of a projection CTA: warp (chunk w,
        split s) takes the columns of chunk w and the m-tiles of split s of every batch; cluster index
        tile * G + group; col is the first of this lane's 8 columns."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        split = 0
        if const_expr(self.row_split > 1):
            split = warp // self.warps
            warp = warp - split * self.warps
        tile = cluster // self.groups
        group = cluster - tile * self.groups
        row0 = tile * self.tm
        tile_rows = cutlass.min(mX.shape[0] - row0, self.tm)
        col = ((group * CLUSTER + rank) * self.warps + warp) * CHUNK + (lane % 4) * 8
        return warp, lane, split, tile, group, row0, tile_rows, col

    @cute.jit
    def load_fn(self, mFn: cute.Tensor, col: Int32, lane: Int32) -> list:
        """This lane's fp32 fn values: [n-tile j][8 columns] of fn row 8j + lane/4."""
        g = lane // 4
        fn = []
        for j in cutlass.range_constexpr(3):
            base = mFn.iterator + ((8 * j + g) * self.K + col)
            fn.append(list(prim.ld_v4_f32(base) + prim.ld_v4_f32(base + 4)))
        return fn

    @cute.jit
    def split_fn(self, fn: list) -> tuple:
        """B fragments of fn^T: [n-tile][pair] hi and lo bf16x2 words, pair p = columns 2p, 2p+1."""
        hi, lo = [], []
        for j in cutlass.range_constexpr(3):
            hj, lj = [], []
            for p in cutlass.range_constexpr(4):
                h, low = prim.split_bf16x2(fn[j][2 * p], fn[j][2 * p + 1])
                hj.append(h)
                lj.append(low)
            hi.append(hj)
            lo.append(lj)
        return hi, lo

    @cute.jit
    def row_piece(self, mX: cute.Tensor, batch_row: Int32, col: Int32, lane: Int32, split, i: int, half: int):
        """Where this lane's 16 bytes of m-tile i of its split, row g + 8 * half of a batch, start in the
        rows (rows past the end read the last row)."""
        mt = split * self.mtiles_per_warp + i
        row = cutlass.min(batch_row + mt * 16 + half * 8 + lane // 4, mX.shape[0] - 1)
        return mX.iterator + (row * self.row_stride + col)

    @cute.jit
    def load_rows(self, mX: cute.Tensor, batch_row: Int32, col: Int32, lane: Int32, split) -> list:
        """[m-tile of this warp's split][rows g, g + 8] 16-byte words of this lane's columns; rows past
        the end read the last row."""
        return [
            [prim.ld_v4_i32(self.row_piece(mX, batch_row, col, lane, split, i, half)) for half in range(2)]
            for i in range(self.mtiles_per_warp)
        ]

    @cute.jit
    def project_batch(
        self,
        words: list,
        hi: list,
        lo: list,
        sWarp: cute.Tensor,
        batch_rows: Int32,
        warp: Int32,
        lane: Int32,
        split,
    ):
        """The projection mainloop: this warp's 25 partial sums over its 32 columns for each row of its
        m-tiles of a batch (tensor-core MMAs on the loaded words), into sWarp; m-tiles past the end
        are skipped. (ptxas sinks a register-loaded m-tile's row loads into this guard, below the fn
        split: one round trip after the other outside PDL's overlap; config.stage_rows avoids it.)"""
        g = lane // 4
        t = lane % 4
        for i in cutlass.range_constexpr(self.mtiles_per_warp):
            mt = split * self.mtiles_per_warp + i
            if mt * 16 < batch_rows:
                upper, lower = words[i][0], words[i][1]  # rows g and g + 8 of the m-tile
                # Logical k {2t, 2t+1} <-> columns 8t+4s+{0,1}; k {2t+8, 2t+9} <-> 8t+4s+{2,3}.
                a = [(upper[2 * s], lower[2 * s], upper[2 * s + 1], lower[2 * s + 1]) for s in range(2)]
                base = (warp * self.batch_rows + mt * 16 + g) * NV
                # The Gram block of the 16 rows: B = A^T, whose fragments are A's own registers.
                gram0 = [Float32(0.0)] * 4
                gram1 = [Float32(0.0)] * 4
                for s in cutlass.range_constexpr(2):
                    gram0 = list(prim.mma_bf16(a[s], (upper[2 * s], upper[2 * s + 1]), gram0))
                    gram1 = list(prim.mma_bf16(a[s], (lower[2 * s], lower[2 * s + 1]), gram1))
                # Row g's square sum is Gram[g][g], held by lane t = g/2 in register g % 2 (c0/c1 for
                # rows 0-7, c2/c3 for rows 8-15).
                if t == g // 2:
                    odd = (g % 2) == 1
                    sWarp[base + MIX] = Float32(cutlass.select_(odd, gram0[1], gram0[0]))
                    sWarp[base + 8 * NV + MIX] = Float32(cutlass.select_(odd, gram1[3], gram1[2]))
                # One n-tile's chain at a time (k step 0 hi, lo, then step 1 hi, lo: each chain's own
                # order, so the order of the n-tiles does not change a bit): 4 live accumulators.
                for j in cutlass.range_constexpr(3):
                    acc = [Float32(0.0)] * 4
                    for s in cutlass.range_constexpr(2):
                        acc = list(prim.mma_bf16(a[s], (hi[j][2 * s], hi[j][2 * s + 1]), acc))
                        acc = list(prim.mma_bf16(a[s], (lo[j][2 * s], lo[j][2 * s + 1]), acc))
                    n = 8 * j + 2 * t
                    sWarp[base + n] = acc[0]
                    sWarp[base + n + 1] = acc[1]
                    sWarp[base + 8 * NV + n] = acc[2]
                    sWarp[base + 8 * NV + n + 1] = acc[3]
