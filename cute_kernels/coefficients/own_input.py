"""DeepSeek-V4's own-pre layer input, written by the CTAs that finish the rows (CONTRACT §4d): out =
RMSNorm_w(bf16(sum_j pre[j] * R[j])) with the pre those CTAs have just computed, in the same launch as the mixes.

A finishing CTA's warp 0 runs the Sinkhorn chain of its rows; warp 1 computes their pre and post and puts the pre in
shared memory; then warps 1.. (the workers) collapse and normalise the rows one at a time while warp 0 is still busy.
Per row: every worker thread collapses its 8-column vectors (the same operations and roundings as the layer-input
kernel) into shared memory with each vector's sum of squares; warps sum the squares of the row's 8 column slices in
the layer-input kernel's order (a slice's vectors in lane order, then the warp butterfly), the slices are added in
slice order, and the normed row, with its MXFP8 or FP8 1x128 form, is written from the shared copy. The order is that
of `LayerInputRole` (whose CTA r of a cluster owns slice r), whatever the CTA's shape, so this layer input has the
layer-input kernel's bits, and a row's bits never depend on the schedule or the row count.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import VEC
from cute_kernels import ptx as prim
from cute_kernels.coefficients.config import CLUSTER, HC, WARP
from cute_kernels.coefficients.layer_input import QUANT_FORMS, collapse_vector, normed_vector, square_sum
from cute_kernels.quant import Fp8GroupWriter, Mxfp8Writer

WORKERS_BARRIER = 1  # the named barrier of the worker warps (0 is __syncthreads)
PASS_VECTORS = 4  # 16-byte vectors of each stream a worker thread has in flight per pass (rows x its vectors)


class OwnInputRole:
    """The own-pre layer input of the rows a finishing CTA of `threads` threads holds (warps 1.. work), up to `share`
    of them, `rows_per_pass` of them at once (all their loads in flight together). With MXFP8 the scale padding rows are
    zeroed by every CTA of the launch, a share each: by the workers in rows() (`pads`: the finish kernel, whose every
    CTA finishes a row) or by the whole CTA in zero_padding_share (the tile schedule, where most CTAs finish none)."""

    def __init__(self, H: int, threads: int, share: int, quant: str | None = None, *, pads: bool = True) -> None:
        if threads < 2 * WARP:
            raise ValueError(
                f"the own-pre layer input needs a finishing CTA of at least 2 warps, got {threads} threads"
            )
        if H % (CLUSTER * VEC):
            raise ValueError(f"the own-pre layer input needs H a multiple of {CLUSTER * VEC}, got {H}")
        self.H = H
        self.workers = threads - WARP
        self.vecs = H // VEC  # 8-column vectors of a row
        self.slice_vecs = self.vecs // CLUSTER  # vectors of one of the 8 column slices
        self.vpt = -(-self.vecs // self.workers)  # vectors per worker thread and row
        # Rows whose stream loads are in flight at once: PASS_VECTORS // vpt of them (at least 1: a thread with more
        # vectors per row than that has all of one row's in flight).
        self.rows_per_pass = max(1, min(share, PASS_VECTORS // self.vpt))
        self.quant = quant
        self.mxfp8 = self.fp8 = None
        if quant is not None:
            if quant not in QUANT_FORMS:
                raise ValueError(f"quant must be None or one of {QUANT_FORMS}, got {quant!r}")
            if self.slice_vecs * VEC % 128:
                raise ValueError(f"a quantized layer input needs H a multiple of {CLUSTER * 128}, got {H}")
            if quant == "mxfp8":
                # One CTA owns every column of its rows. `pads`: the CTAs of the launch running rows() zero the scale
                # padding rows among them (the finish kernel); else the launch's CTAs do with `pad_writer` (the tile).
                self.mxfp8 = Mxfp8Writer(H, H, self.workers)
                self.pads = pads
                self.pad_writer = None if pads else Mxfp8Writer(H, H, threads)  # every thread of the CTA zeroes
            else:
                self.fp8 = Fp8GroupWriter(H, ue8m0=quant == "fp8_1x128_ue8m0")

    def allocate(self, smem: cutlass.memory.SmemAllocator, rows: int) -> tuple:
        """Shared memory of the role for a CTA finishing up to `rows` rows: (pre, collapse words, vector sums of
        squares, slice sums), the last three for one pass of rows."""
        rp = self.rows_per_pass
        sPre = smem.allocate_tensor(Float32, cute.make_layout(rows * HC), byte_alignment=16)
        sC = smem.allocate_tensor(Int32, cute.make_layout(rp * self.vecs * 4), byte_alignment=16)
        sSq = smem.allocate_tensor(Float32, cute.make_layout(rp * self.vecs), byte_alignment=16)
        sSlice = smem.allocate_tensor(Float32, cute.make_layout(rp * CLUSTER), byte_alignment=16)
        return sPre, sC, sSq, sSlice

    @cute.jit
    def zero_padding_share(self, mScale: cute.Tensor, rows: Int32, cta: Int32, ctas: Int32):
        """CTA `cta` of the launch's `ctas` zeroes its share of the MXFP8 scale padding rows (every thread; `pads`
        False: the tile schedule calls it after its wait)."""
        tidx, _, _ = cute.arch.thread_idx()
        self.pad_writer.zero_padding(mScale, rows, Int32(0), tidx, cta, ctas)

    @cute.jit
    def sync(self):
        """Barrier of the worker warps only (warp 0 may still be in its Sinkhorn chain)."""
        cute.arch.barrier(barrier_id=WORKERS_BARRIER, number_of_threads=self.workers)

    @cute.jit
    def rows(self, buffers: tuple, share_row0: Int32, share_rows: Int32, args: tuple):
        """The layer input of the share rows [share_row0, +share_rows), their pre in buffers[0]; `args` (mX, mW,
        mOut, mQ, mScale, norm_eps). Every thread of the CTA calls it; the worker threads (tidx >= 32) run it, once warp 1
        has put the pre in shared memory."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx >= WARP:
            self.worker_rows(buffers, share_row0, share_rows, args)

    @cute.jit
    def worker_rows(self, buffers: tuple, share_row0: Int32, share_rows: Int32, args: tuple):
        """rows() on a worker thread: passes of rows_per_pass rows (collapse, slice sums, normalise and write)."""
        sPre, sC, sSq, sSlice = buffers
        mX, mW, mOut, mQ, mScale, norm_eps = args
        tidx, _, _ = cute.arch.thread_idx()
        wt = tidx - WARP
        lane = cute.arch.lane_idx()
        warp = wt // WARP
        rows = mX.shape[0]
        # The norm weight of this thread's vectors, once for every row (the same columns), while warp 1 finishes the pre.
        w_words = [
            prim.ld_v4_i32(mW.iterator + cutlass.min(wt + k * self.workers, self.vecs - 1) * VEC)
            for k in range(self.vpt)
        ]
        if const_expr(self.mxfp8 is not None and self.pads):
            # This CTA's share of the scale padding (every CTA of the launch finishes a row: one per block).
            block, _, _ = cute.arch.block_idx()
            blocks, _, _ = cute.arch.grid_dim()
            self.mxfp8.zero_padding(mScale, rows, Int32(0), wt, block, blocks)
        self.sync()  # the pre of the share rows is in sPre
        for p in cutlass.range(0, share_rows, self.rows_per_pass):
            self.collapse_rows(sPre, sC, sSq, mX, share_row0, share_rows, p, wt)
            self.sync()
            self.slice_sums(sSq, sSlice, warp, lane)
            self.sync()
            self.write_rows(sC, sSlice, w_words, mOut, mQ, mScale, norm_eps, share_row0, share_rows, p, rows, wt)
            self.sync()  # before the next pass reuses the buffers

    @cute.jit
    def collapse_rows(
        self,
        sPre: cute.Tensor,
        sC: cute.Tensor,
        sSq: cute.Tensor,
        mX: cute.Tensor,
        share_row0: Int32,
        share_rows: Int32,
        p: Int32,
        wt: Int32,
    ):
        """c = bf16(pre0*R0 + pre1*R1 + ...) of this thread's vectors of the pass's rows into sC, their sums of squares
        into sSq (the layer-input kernel's operations); every load in flight before any math."""
        loaded = []
        for rr in cutlass.range_constexpr(self.rows_per_pass):
            live = p + rr < share_rows
            base = Int64(share_row0 + p + rr) * (HC * self.H)
            for k in cutlass.range_constexpr(self.vpt):
                g = wt + k * self.workers
                ok = live & (g < self.vecs)
                addrs = [mX.iterator.toint() + (base + Int64(j * self.H) + Int64(g * VEC)) * 2 for j in range(HC)]
                loaded.append([prim.ld_global_v4_pred(a, ok) for a in addrs])
        for rr in cutlass.range_constexpr(self.rows_per_pass):
            i = cutlass.min(p + rr, share_rows - 1)  # a pass's rows past the share: any pre (nothing stored)
            pre = [sPre[i * HC + j] for j in range(HC)]
            for k in cutlass.range_constexpr(self.vpt):
                g = wt + k * self.workers
                cw = collapse_vector(pre, loaded[rr * self.vpt + k])
                part = square_sum(cw)
                if g < self.vecs:
                    prim.st_v4_i32(sC.iterator + (rr * self.vecs + g) * 4, tuple(cw))
                    sSq[rr * self.vecs + g] = part

    @cute.jit
    def slice_sums(self, sSq: cute.Tensor, sSlice: cute.Tensor, warp: Int32, lane: Int32):
        """Each (row, column slice)'s sum of squares, by one warp: the slice's vectors in lane order, then the
        butterfly (the layer-input kernel's order)."""
        for t in cutlass.range(warp, self.rows_per_pass * CLUSTER, self.workers // WARP):
            part = Float32(0.0)
            for i in cutlass.range_constexpr(-(-self.slice_vecs // WARP)):
                if lane + i * WARP < self.slice_vecs:
                    # Task t is slice t % 8 of pass row t // 8: its vectors start at t * slice_vecs.
                    part = part + sSq[t * self.slice_vecs + lane + i * WARP]
            part = cute.arch.warp_reduction_sum(part)
            if lane == 0:
                sSlice[t] = part

    @cute.jit
    def write_rows(
        self,
        sC: cute.Tensor,
        sSlice: cute.Tensor,
        w_words: list,
        mOut: cute.Tensor,
        mQ: cute.Tensor | None,
        mScale: cute.Tensor | None,
        norm_eps: Float32,
        share_row0: Int32,
        share_rows: Int32,
        p: Int32,
        rows: Int32,
        wt: Int32,
    ):
        """out = bf16(c * rsqrt(sum / H + eps) * w) of this thread's vectors of the pass's rows, and its quantized
        form; the slices' sums added in slice order."""
        for rr in cutlass.range_constexpr(self.rows_per_pass):
            live = p + rr < share_rows
            row = share_row0 + cutlass.min(p + rr, share_rows - 1)
            total = sSlice[rr * CLUSTER]
            for s in cutlass.range_constexpr(1, CLUSTER):
                total = total + sSlice[rr * CLUSTER + s]
            inv = prim.rsqrt_approx(prim.div_rn(total, Float32(self.H)) + norm_eps)
            for k in cutlass.range_constexpr(self.vpt):
                g = wt + k * self.workers
                gc = cutlass.min(g, self.vecs - 1)
                cw = prim.ld_v4_i32(sC.iterator + (rr * self.vecs + gc) * 4)
                out = normed_vector(cw, inv, w_words[k])
                valid = live & (g < self.vecs)
                if valid:
                    prim.st_v4_i32(mOut.iterator + (row * self.H + g * VEC), tuple(out))
                # Every lane joins its group's shuffles: a tail's whole groups of 16 lanes only skip the stores.
                if const_expr(self.mxfp8 is not None):
                    self.mxfp8.quantize_vector(out, self.mxfp8.place(mQ, mScale, row, gc), cutlass.Boolean(valid))
                if const_expr(self.fp8 is not None):
                    self.fp8.quantize_vector(out, self.fp8.place(mQ, mScale, row, rows, gc), cutlass.Boolean(valid))
